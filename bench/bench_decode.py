"""Decode benchmark on a Llama-3.1-8B shape (or a scaled-down one): per policy and attention
mode, compile time, wall ms per step, planning ms, HBM hit rate and modeled tokens/s.

The model has random weights (`--shape 8b`: 32 layers, dim 4096, 32 q / 8 kv heads, head_dim
128, ffn 14,336, vocab 128,256, bf16; `--shape mh`: issue 19's CPU setting, 8 layers, dim 512,
4 q / 2 kv heads, head_dim 128; `--shape tiny`: 2 layers, for a smoke run; any field can be
overridden, e.g. `--layers 4`). The cache holds `--context` tokens per sequence before decoding:
by default the model's own prefill of a prompt up to 8k tokens (its keys have the structure
the model gives them, so Quest's selection and the policies see real recency), beyond that
random K/V (`--fill random`; the dense prefill cannot reach 32k). Every case decodes the same
prompt and the same cache.

Cases: all-HBM (exact and sparse), then with HBM holding `--hbm-fraction` (25%) of the KV:
static, lru-plan (LRU planned every W steps), the field's rules in the step (the LRU hot
buffer, ARC, SLRU, LFU with aging, W-TinyLFU), anneal, anneal+reuse+follow and lrfu (the live
policy), each exact and sparse (top 25%). Per case, timed
on the present device and blocked on: the first `generate` call (compile + warm-up steps), the
wall ms per step over `--steps` steps, one plan's wall ms (`Decoder.plan_seconds`: observe and
plan, all layers), the planning ms per step (a plan every W steps) and its share of the
all-HBM step of the same mode measured in this run; the HBM hit rate; the modeled tokens/s
under `--profile` (the measured bandwidths of this device with `--profile measured`) and the
same with planning charged (`jaxkv.summarize`: each modeled step lengthened by the share
of a step's wall time that planning adds here). On a GPU the bandwidths are measured in the
same run (HBM copy, host -> device, device -> host) and each row reports its fraction of the
two-tier bound (`bench_decode_bound.bounds`). Exact-mode tokens are compared with all-HBM's.

    JAX_PLATFORMS=cpu python bench/bench_decode.py --shape mh --context 8192 --json PATH
    python bench/bench_decode.py --shape 8b --contexts 32768,131072 --batches 1,8   # on a GPU
    JAX_PLATFORMS=cpu python bench/bench_decode.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _progress import tqdm  # tqdm, or a stand-in where it is missing
from bench_decode_bound import bounds, prewarm_transfers, random_cache, step_weight_bytes
from flax import nnx

from jaxkv import Decoder, summarize
from jaxkv._pytree import replace
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import ARCHITECTURES
from jaxkv.placement import presets
from jaxkv.sim import loop
from models.llama import Llama, LlamaConfig
from pallas_kernels.common import on_gpu

SHAPES = {
    "8b": ARCHITECTURES["llama3-8b"].llama_fields(),  # the one table (jaxkv.cost)
    "mh": dict(
        num_layers=8,
        dim=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        ffn_dim=1536,
        vocab_size=32000,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        num_layers=2,
        dim=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        vocab_size=256,
        rope_theta=10000.0,
    ),
}
FIELD = ("lru", "arc", "slru", "lfu", "tinylfu")  # the field's rules, in the step
POLICIES = ("static", "lru-plan", *FIELD, "anneal", "anneal+reuse+follow", "lrfu")
MODES = ("exact", "sparse")
PREFILL_MAX = 8192  # --fill auto: the model's prefill up to this context, random K/V beyond
MARGIN = 8


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="8b on a GPU, else mh")
    for name in ("layers", "dim", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument(
        "--init-std",
        type=float,
        default=0.5,
        help="weight init scale (large, as the tiny model's: clear greedy margins, so exact-mode "
        "tokens can be compared)",
    )
    ap.add_argument("--contexts", default=None, help="comma list (32768,131072 GPU; 8192 CPU)")
    ap.add_argument("--batches", default="1", help="comma list of batch sizes")
    ap.add_argument("--fill", choices=("auto", "prefill", "random"), default="auto")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps after the compile")
    ap.add_argument("--window", type=int, default=8, help="steps between plans (W)")
    ap.add_argument("--hbm-fraction", type=float, default=0.25)
    ap.add_argument(
        "--host-tier",
        choices=("write-through", "exclusive"),
        default="write-through",
        help="CacheConfig.host_tier of every tiered case",
    )
    ap.add_argument("--topk", type=float, default=0.25)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma list; a name may carry overrides of the policy's fields after a colon, "
        "e.g. anneal+reuse+follow:follow_admit=ranked",
    )
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--profile", default=None, help="modeled profile (h200-pcie GPU / CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny shape, 512 tokens, 4 steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write everything here (after every case)")
    ap.add_argument(
        "--bounds",
        action="store_true",
        help="sparse mode: record the reads once, replay every policy through the simulator in "
        "the decode loop's accounting (jaxkv.sim.loop; it must equal each case's figures) and "
        "print the lower bounds on the modeled time and the share of the gap each policy closes",
    )
    args = ap.parse_args(argv)
    gpu = on_gpu()
    if args.quick:
        args.shape, args.contexts, args.steps, args.warmup = "tiny", "512", 4, 2
    args.shape = args.shape or ("8b" if gpu else "mh")
    args.contexts = args.contexts or ("32768,131072" if gpu else "8192")
    args.profile = args.profile or "h200-pcie"
    args.context_list = [int(x) for x in args.contexts.split(",")]
    args.batch_list = [int(x) for x in args.batches.split(",")]
    args.policy_list = [p for p in args.policies.split(",") if p]
    args.mode_list = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad:
        ap.error(f"--modes {bad}: expected some of {MODES}")
    if min(args.context_list) < 1 or min(args.batch_list) < 1 or args.steps < 1:
        ap.error("--contexts, --batches and --steps must be >= 1")
    return args


def build_model(args, max_len: int) -> Llama:
    shape = dict(SHAPES[args.shape])
    for arg, field in (
        ("layers", "num_layers"),
        ("dim", "dim"),
        ("heads", "num_heads"),
        ("kv_heads", "num_kv_heads"),
        ("head_dim", "head_dim"),
        ("ffn", "ffn_dim"),
        ("vocab", "vocab_size"),
    ):
        if getattr(args, arg) is not None:
            shape[field] = getattr(args, arg)
    cfg = LlamaConfig(**shape, max_seq_len=max_len, dtype=args.dtype, init_std=args.init_std)
    return Llama(cfg, rngs=nnx.Rngs(args.seed))


def cases(args):
    """(name, HBM fraction, PlacementConfig) of every case, all-HBM of each mode first."""
    out = []
    for mode in args.mode_list:
        kw = dict(attention=mode, topk=args.topk, window=args.window)
        out.append((f"all-hbm {mode}", 1.0, PlacementConfig(policy="static", **kw), {}))
        for pol in args.policy_list:
            name, _, over = pol.partition(":")
            kwargs = dict(x.split("=", 1) for x in over.split(";") if x)
            kwargs = {k: _value(v) for k, v in kwargs.items()}
            placement = PlacementConfig(policy=name, **kw)
            out.append((f"{pol} {mode}", args.hbm_fraction, placement, kwargs))
    return out


def _value(text: str):
    """A policy override's value: int, float, bool or the string itself."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def fill_cache(dec, params, args, context: int, batch: int, rng):
    """A DecodeState whose cache holds `context` tokens per sequence: the model's prefill of a
    random prompt (`--fill prefill`), or random K/V after a 4-token prefill (`random`)."""
    fill = args.fill
    if fill == "auto":
        fill = "prefill" if context <= PREFILL_MAX else "random"
    vocab = dec.model_config.vocab_size
    if fill == "prefill":
        prompt = rng.integers(0, vocab, (batch, context), dtype=np.int32)
        return dec.prefill(params, prompt), fill
    prompt = rng.integers(0, vocab, (batch, 4), dtype=np.int32)
    state = dec.prefill(params, prompt)
    state = replace(state, cache=None)
    state = replace(state, cache=random_cache(dec.cache_config, context, args.seed))
    return state, fill


def run_case(args, model, profile, frac, placement, context, batch, policy_kwargs=None):
    mc = model.config
    n_new = args.warmup + args.steps + 2
    cfg = CacheConfig.for_model(
        mc,
        batch=batch,
        max_len=context + n_new + MARGIN,
        block_size=args.block_size,
        hbm_fraction=frac,
        host_tier=args.host_tier,
    )
    dec = Decoder(
        model, cfg, placement, max_new_tokens=n_new, profile=profile, policy_kwargs=policy_kwargs
    )
    params = nnx.split(model)[1]
    rng = np.random.default_rng(args.seed)  # the same prompt for every case
    t0 = time.perf_counter()
    state, fill = fill_cache(dec, params, args, context, batch, rng)
    jax.block_until_ready(state)
    fill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(dec.generate(params, state, until=1))
    compile_s = time.perf_counter() - t0
    state = jax.block_until_ready(dec.generate(params, state, until=args.warmup))
    n_compiled = dec.compilations()
    t0 = time.perf_counter()
    state = jax.block_until_ready(dec.generate(params, state, until=args.warmup + args.steps))
    dt = time.perf_counter() - t0
    done = int(state.step) - args.warmup
    step_s = dt / max(done, 1)
    plan_s = dec.plan_seconds(params, state)
    s = summarize(state)
    m = jax.device_get(state.metrics)
    sl = slice(args.warmup, args.warmup + done)
    return dict(
        dec=dec,
        fill=fill,
        fill_s=fill_s,
        compile_s=compile_s,
        step_s=step_s,
        steps=done,
        plan_s=plan_s,
        summary=s,
        hbm_bytes=np.asarray(m.hbm_bytes[sl], np.float64),
        host_bytes=np.asarray(m.host_bytes[sl], np.float64),
        tokens=np.asarray(state.tokens)[:, : args.warmup + done + 1],
        recompiled=dec.compilations() != n_compiled,
        hbm_blocks=cfg.hbm_slots,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = on_gpu()
    dev = jax.devices()[0]
    max_ctx = max(args.context_list)
    model = build_model(args, max_ctx + args.warmup + args.steps + 2 + MARGIN)
    mc = model.config
    w_step = step_weight_bytes(model)
    print(
        f"device: {dev.platform} {dev.device_kind}; jax {jax.__version__}; "
        f"{'GPU run' if gpu else 'CPU run (both tiers are the same DRAM: no GPU figure)'}"
    )
    print(
        f"model: --shape {args.shape}, {mc.num_layers} layers, dim {mc.dim}, heads "
        f"{mc.num_heads}/{mc.num_kv_heads} kv x {mc.head_dim}, ffn {mc.ffn_dim}, vocab "
        f"{mc.vocab_size}, {mc.dtype}, random weights; contexts {args.context_list}, batches "
        f"{args.batch_list}, {args.steps} timed steps after a compile call and {args.warmup} "
        f"warm-up steps, W={args.window}, HBM {args.hbm_fraction:.0%}, sparse top "
        f"{args.topk:.0%}, host tier {args.host_tier}"
    )
    measured = None
    if gpu:
        t0 = time.perf_counter()
        measured = HardwareProfile.measure()
        print(
            f"measured: B_hbm {measured.hbm_bandwidth / 1e9:.1f} GB/s, B_link "
            f"{measured.link_bandwidth / 1e9:.1f} GB/s ({time.perf_counter() - t0:.1f} s)"
        )
    profile = args.profile
    if profile == "measured":
        profile = measured or HardwareProfile.measure()
    prof_name = profile if isinstance(profile, str) else profile.name
    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"{dev.platform} {dev.device_kind}",
        "jax": jax.__version__,
        "gpu_figure": gpu,
        "args": {k: v for k, v in vars(args).items()},
        "model": dataclasses.asdict(mc),
        "weight_bytes_per_step": w_step,
        "bandwidth": None
        if measured is None
        else {"hbm": measured.hbm_bandwidth, "link": measured.link_bandwidth},
        "rows": [],
    }

    def dump():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2, default=str)

    probe = CacheConfig.for_model(mc, batch=1, max_len=args.block_size, hbm_fraction=1.0)
    prewarm_transfers(probe, ["auto"])
    jobs = [
        (c, b, *case) for c in args.context_list for b in args.batch_list for case in cases(args)
    ]
    head = (
        f"{'case':<28} {'ctx':>6} {'B':>2} {'compile s':>9} {'ms/step':>9} {'x all-HBM':>9} "
        f"{'plan ms':>8} {'plan/step':>9} {'hit':>6} {'modeled tok/s':>13} {'+plan':>11}"
        + ("  bound" if gpu else "")
    )
    tqdm.write(head, file=sys.stdout)
    base, ref_tokens, same = {}, {}, {}
    replayed = {}  # (context, batch) -> [(row, LoopSetup)] of the sparse tiered cases
    for context, batch, name, frac, placement, pkw in tqdm(
        jobs, desc="bench_decode", file=sys.stderr
    ):
        try:
            r = run_case(args, model, profile, frac, placement, context, batch, pkw)
        except Exception as e:  # one case failing must not lose the others
            msg = f"{type(e).__name__}: {str(e)[:300]}"
            tqdm.write(f"{name:<28} {context:>6} {batch:>2} ERROR {msg}", file=sys.stdout)
            out["rows"].append({"case": name, "context": context, "batch": batch, "error": msg})
            dump()
            continue
        mode = placement.attention
        key = (context, batch, mode)
        if frac == 1.0:
            base[key] = r["step_s"]
            ref_tokens[key] = r["tokens"]
        s = r["summary"]
        all_hbm = base.get(key)
        row = {
            "case": name,
            "policy": placement.policy if frac < 1.0 else "all-hbm",
            "attention": mode,
            "context": context,
            "batch": batch,
            "fill": r["fill"],
            "hbm_fraction": frac,
            "hbm_blocks_per_layer": r["hbm_blocks"],
            "compile_s": r["compile_s"],
            "fill_s": r["fill_s"],
            "step_ms": 1e3 * r["step_s"],
            "ratio_vs_all_hbm": r["step_s"] / all_hbm if all_hbm else None,
            "plan_ms": 1e3 * r["plan_s"],
            # a plan every W steps
            "plan_ms_per_step": 1e3 * r["plan_s"] / args.window,
            "plan_share_of_all_hbm_step": (r["plan_s"] / args.window / all_hbm)
            if all_hbm
            else None,
            "hbm_hit_rate": s["hbm_hit_rate"],
            "migrated_blocks": s["migrated_blocks"],
            "modeled_tokens_per_s": s["modeled_tokens_per_s"],
            # each modeled step lengthened by the share of a wall step planning adds here
            "modeled_tokens_per_s_with_plan": s["modeled_tokens_per_s"]
            / (1.0 + r["plan_s"] / args.window / r["step_s"]),
            "profile": prof_name,
            "timed_steps": r["steps"],
            "recompiled_in_timed_call": r["recompiled"],
            "wall_tokens_per_s": batch / r["step_s"],
        }
        if mode == "exact" and key in ref_tokens and frac < 1.0:
            same[f"{name} ctx={context} B={batch}"] = bool(
                np.array_equal(r["tokens"], ref_tokens[key])
            )
            row["tokens_equal_all_hbm"] = same[f"{name} ctx={context} B={batch}"]
        extra = ""
        if measured is not None:
            two, ideal, _ = bounds(
                r["hbm_bytes"],
                r["host_bytes"],
                layers=mc.num_layers,
                weight_bytes=w_step,
                bh=measured.hbm_bandwidth,
                bl=measured.link_bandwidth,
            )
            row["bound_ms"] = 1e3 * two
            row["fraction_of_bound"] = two / r["step_s"]
            extra = f"  {row['fraction_of_bound']:.2f}"
        out["rows"].append(row)
        if args.bounds and mode == "sparse" and frac < 1.0:
            replayed.setdefault((context, batch), []).append((row, r["dec"]))
        ratio = f"{row['ratio_vs_all_hbm']:.2f}" if row["ratio_vs_all_hbm"] else "-"
        tqdm.write(
            f"{name:<28} {context:>6} {batch:>2} {row['compile_s']:9.1f} {row['step_ms']:9.2f} "
            f"{ratio:>9} {row['plan_ms']:8.2f} {row['plan_ms_per_step']:9.3f} "
            f"{100 * row['hbm_hit_rate']:5.1f}% {row['modeled_tokens_per_s']:13,.0f} "
            f"{row['modeled_tokens_per_s_with_plan']:11,.0f}{extra}"
            + ("  RECOMPILED in the timed call" if r["recompiled"] else ""),
            file=sys.stdout,
        )
        sys.stdout.flush()
        dump()
        del r
    out["exact_tokens_equal_all_hbm"] = same
    replay_ok = True
    for (context, batch), runs in replayed.items():
        out.setdefault("bounds", []).append(sparse_bounds(args, model, context, batch, runs))
        replay_ok &= out["bounds"][-1]["replay_equals_decode"]
        dump()
    ok = all(same.values()) if same else None
    print(
        "exact-mode tokens identical to all-HBM: "
        + ("yes" if ok else "NO" if ok is False else "nothing compared")
        + f" ({len(same)} cases)"
    )
    print(
        f"modeled tok/s under {prof_name}; '+plan' charges planning as the share of a step it "
        "adds on this device; 'x all-HBM' is the wall step over the all-HBM step of the same "
        "mode, context and batch, measured in this run"
    )
    dump()
    return 0 if ok in (True, None) and replay_ok else 1


def sparse_bounds(args, model, context: int, batch: int, runs) -> dict:
    """The sparse cases of one (context, batch), in the decode loop's accounting: each case's
    decode recorded (`jaxkv.sim.loop.record`: the same prompt and steps as its timed run) and
    replayed through the simulator with its policy (the modeled tok/s must equal the case's to
    1e-6), the reads of every record counted where they differ from the first case's (a sparse
    selection depends on the logical blocks, but a near-tie can flip with the rounding of the
    layers above), Belady's MIN with bypass priced on the first case's reads
    (`jaxkv.sim.loop.limit`, the attainable limit) and the lower bounds
    (`jaxkv.sim.loop.bounds`); per case the share of the gap between the best of the field's
    rules and Belady that it closes, with planning charged as in its row."""
    params = nnx.split(model)[1]
    n = args.warmup + runs[0][0]["timed_steps"]
    t0 = time.perf_counter()
    rows, equal, first = [], True, None
    for row, d in runs:
        rng = np.random.default_rng(args.seed)
        state, _ = fill_cache(d, params, args, context, batch, rng)
        rec, _ = loop.record(d, params, state, n)
        got = loop.replay(loop.LoopSetup.of(d), rec).summary()["modeled_tokens_per_s"]
        same = abs(got / row["modeled_tokens_per_s"] - 1) < 1e-6
        if first is None:
            first = rec
        # reads differing from the first case's: a selection near a tie flips with the
        # rounding of the layers above, whose attention merges its partials per placement
        other = int(np.sum(rec.reads != first.reads))
        equal &= same
        rows.append(
            dict(case=row["case"], replayed_tokens_per_s=got, equal=same, reads_differing=other)
        )
    setup = loop.LoopSetup.of(runs[0][1])
    b = loop.bounds(setup, first)
    rate = {k: batch * n / b[k] for k in ("unlimited", "capacity", "cache", "best")}
    # a perfect forecast in the loop's accounting (replay only: the loop refuses oracles)
    oracle = presets.resolve("anneal-oracle", setup.env, presets.Settings(window=1))
    one = dataclasses.replace(setup.placement, window=1)
    o = loop.replay(dataclasses.replace(setup, policy=oracle, placement=one), first).summary()
    rate["anneal-oracle, W 1 (replay)"] = o["modeled_tokens_per_s"]
    belady = loop.limit(setup, first).summary()
    limit = belady["modeled_tokens_per_s"]
    rate["belady (limit, replay)"] = limit
    with_plan = {row["policy"]: row["modeled_tokens_per_s_with_plan"] for row, _ in runs}
    field = {p: with_plan[p] for p in FIELD if p in with_plan}
    best_rule = max(field, key=field.get) if field else None
    base = field.get(best_rule, max(with_plan.values()))
    for r, (row, _) in zip(rows, runs, strict=True):
        gap = limit - base
        r["gap_closed_with_plan"] = (row["modeled_tokens_per_s_with_plan"] - base) / gap
    print(
        f"\nbounds, sparse, ctx {context}, B {batch}: each case's {n} steps recorded and replayed "
        f"in the decode loop's accounting ({time.perf_counter() - t0:.0f} s); "
        "modeled tok/s at most (bounds), and an oracle's: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in rate.items())
        + f"; link crossings per layer {b['crossings']}"
    )
    print(
        f"{'case':<28} {'replay tok/s':>12} {'= decode':>8} {'reads differing':>15} "
        f"{'gap closed (+plan)':>18}"
    )
    for r in rows:
        eq = "yes" if r["equal"] else "NO"
        print(
            f"{r['case']:<28} {r['replayed_tokens_per_s']:12,.0f} {eq:>8} "
            f"{r['reads_differing']:>15,}"
            f" {100 * r['gap_closed_with_plan']:17.0f}%"
        )
    print(
        f"gap closed: (the case's tok/s with planning charged - the best field rule's, "
        f"{best_rule}) / (Belady's - the best field rule's); negative: slower than that rule"
    )
    return dict(
        context=context,
        batch=batch,
        steps=n,
        bounds_tokens_per_s=rate,
        best_field_rule=best_rule,
        belady=dict(
            modeled_tokens_per_s=limit,
            hbm_hit_rate=float(belady["hbm_hit_rate"]),
            migrated_blocks=int(belady["migrated_blocks"]),
        ),
        crossings=b["crossings"],
        cases=rows,
        replay_equals_decode=bool(equal),
    )


if __name__ == "__main__":
    jnp.zeros(())  # start the backend before any timing
    raise SystemExit(main())
