"""Does the live decode loop reach the two-tier bound at long context?

Builds a Llama-shaped model with random weights (no checkpoint; `--model tiny` for the test
model), gets a correctly shaped DecodeState from `Decoder.prefill` of a few prompt tokens, then
swaps its cache for one filled by `jaxkv.cache.prefill` with random K/V (scale ~1) of
`--context` tokens: the model's own prefill is dense attention and cannot reach 32k. The step
then decodes at position `context`. Cases, each timed over `--steps` steps of
`Decoder.generate` after a warm-up (wall seconds, blocked on):

- all-HBM exact;
- HBM 25% exact, static placement (HBM filled in write order, the rest read over the link);
- HBM 25% sparse top-25%, static;
- HBM 25% sparse top-25%, lru.

The bandwidths are measured in the same run (`HardwareProfile.measure()`: B_hbm from a
device-to-device copy, B_link from a pinned_host -> device copy). For the KV bytes each step
actually read from each tier (the decode state's metrics), the two-tier bound of a step is

    sum over layers of max((weights + HBM KV bytes) / B_hbm, host KV bytes / B_link)

(each layer taken at the mean of the step's per-tier bytes over layers); the "ideal split" bound
(unlimited HBM: every byte read split at alpha* = B_hbm / (B_hbm + B_link), `jaxkv.cost`'s
Unlimited bound) and the HBM-only bound (every byte from HBM) are printed for reference. The
ratio is measured tokens/s over bound tokens/s. On a GPU a PASS / FAIL line answers "HBM 25%
exact static reaches >= 50% of its two-tier bound". Off GPU both tiers are the same DRAM: the
run is a smoke test (`--model tiny --context 2048 --steps 8` unless given) and no GPU figure is
taken. The greedy tokens of the two exact cases (same random cache and prompt) are compared.

    python bench/bench_decode_bound.py [--context 32768] [--fetch auto,pallas] [--json PATH]
    JAX_PLATFORMS=cpu python bench/bench_decode_bound.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _progress import tqdm  # tqdm, or a stand-in where it is missing
from flax import nnx

from jaxkv import Decoder, summarize
from jaxkv import cache as kvc
from jaxkv._pytree import replace
from jaxkv.cache.transfer import read_blocks, resolve_fetch, write_blocks
from jaxkv.config import FETCH_OPTIONS, CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import unlimited_step_time
from jaxkv.decode.setup import model_weight_bytes
from models.llama import Llama, LlamaConfig
from models.tiny import tiny_model
from pallas_kernels.common import on_gpu, single_device_sharding

TARGET_RATIO = 0.50  # of the two-tier bound, HBM 25% exact static at 32k
QUICK = dict(model="tiny", context=2048, steps=8, window=4)  # the CPU smoke defaults
FULL = dict(model="llama", context=32768, steps=32, window=16)
T_START = time.perf_counter()
PROMPT_LEN = 4  # tokens of the short prompt that only shapes the DecodeState
MARGIN = 8  # cache tokens beyond context + generated ones


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        choices=("llama", "tiny"),
        default=None,
        help="random-init Llama of the shape below (default on a GPU), or the tiny "
        "test model (default off GPU)",
    )
    ap.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens in the cache before decoding (32768 on a GPU, 2048 off it)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps (32 GPU, 8 CPU)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps, >= 2 (compile included)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 2048 context, 8 steps (the CPU defaults) on any device",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hbm-fraction", type=float, default=0.25)
    ap.add_argument("--topk", type=float, default=0.25, help="sparse cases' top-k fraction")
    ap.add_argument(
        "--window", type=int, default=None, help="steps between plans (16; 4 in the smoke run)"
    )
    ap.add_argument(
        "--fetch",
        default="auto",
        help=f"transfer mechanism, or a comma list to compare: {FETCH_OPTIONS}",
    )
    ap.add_argument("--impl", default="auto", help="attention implementation auto|xla|pallas")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument(
        "--init-std",
        type=float,
        default=0.5,
        help="weight init scale (large, as the tiny model's: clear greedy margins)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write args, bandwidths and rows here")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=100.0,
        help="start no case later than this many seconds after start (0: no limit); the JSON "
        "is written after every case, so a killed run keeps what it measured",
    )
    args = ap.parse_args(argv)
    defaults = QUICK if (args.quick or not on_gpu()) else FULL
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    fetches = [f.strip() for f in args.fetch.split(",") if f.strip()]
    bad = [f for f in fetches if f not in FETCH_OPTIONS]
    if bad or not fetches:
        ap.error(f"--fetch {args.fetch!r}: expected a comma list of {FETCH_OPTIONS}")
    args.fetches = fetches
    if args.warmup < 2:
        ap.error("--warmup must be >= 2 (two warm-up calls)")
    for name in ("context", "steps", "batch", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    return args


def build_model(args) -> Llama:
    n_new = args.warmup + args.steps + 2
    need = args.context + n_new + MARGIN
    if args.model == "tiny":
        return tiny_model(args.seed, dtype=args.dtype, max_seq_len=max(4096, need))
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn_dim=args.ffn,
        max_seq_len=need,
        dtype=args.dtype,
        init_std=args.init_std,
    )
    return Llama(cfg, rngs=nnx.Rngs(args.seed))


def step_weight_bytes(model) -> float:
    """Weight bytes one decode step reads: every parameter but the embedding table (one row of
    it is read) unless the embedding is tied to the LM head."""
    _, params = nnx.split(model)
    total = model_weight_bytes(params)
    if not model.config.tie_embeddings:
        e = model.embed[...]
        total -= e.size * e.dtype.itemsize
    return total


@jax.jit
def _random_kv(key, shape_probe):
    """[layers, batch, T, kv_heads, head_dim] K and V, standard normal in the probe's dtype,
    made one layer at a time (lax.map: no full-size float32 intermediate)."""
    L, B, T, KV, D = shape_probe.shape
    dt = shape_probe.dtype

    def one(kk):
        a, b = jax.random.split(kk)
        return (
            jax.random.normal(a, (B, T, KV, D), jnp.float32).astype(dt),
            jax.random.normal(b, (B, T, KV, D), jnp.float32).astype(dt),
        )

    return jax.lax.map(one, jax.random.split(key, L))


def random_cache(cfg: CacheConfig, context: int, seed: int) -> kvc.TieredKVCache:
    """A cache holding `context` tokens of random K/V per sequence (same for the same seed)."""
    L, B = cfg.num_layers, cfg.batch
    probe = jax.ShapeDtypeStruct((L, B, context, cfg.kv_heads, cfg.head_dim), cfg.jnp_dtype)
    k, v = _random_kv(jax.random.key(seed + 1), probe)
    lengths = np.full((B,), context, np.int32)
    cache = kvc.prefill(kvc.TieredKVCache.create(cfg), k, v, lengths)
    del k, v
    return jax.block_until_ready(cache)


def cases(args):
    f, t, w = args.hbm_fraction, args.topk, args.window
    pct = f"{round(100 * f)}"
    return [
        ("all-hbm exact", 1.0, PlacementConfig(policy="static", window=w)),
        (f"hbm{pct} exact static", f, PlacementConfig(policy="static", window=w)),
        (
            f"hbm{pct} sparse{round(100 * t)} static",
            f,
            PlacementConfig(policy="static", attention="sparse", topk=t, window=w),
        ),
        (
            f"hbm{pct} sparse{round(100 * t)} lru",
            f,
            PlacementConfig(policy="lru-plan", attention="sparse", topk=t, window=w),
        ),
    ]


def run_case(args, model, profile, frac, placement, fetch):
    mc = model.config
    n_new = args.warmup + args.steps + 2
    cfg = CacheConfig.for_model(
        mc,
        batch=args.batch,
        max_len=args.context + n_new + MARGIN,
        block_size=args.block_size,
        hbm_fraction=frac,
        fetch=fetch,
    )
    dec = Decoder(model, cfg, placement, max_new_tokens=n_new, profile=profile, impl=args.impl)
    _, params = nnx.split(model)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, mc.vocab_size, (args.batch, PROMPT_LEN), dtype=np.int32)
    t0 = time.perf_counter()
    state = dec.prefill(params, prompt)  # only shapes the state; its cache is replaced
    state = replace(state, cache=None)  # drop the short-prompt cache before the big one
    state = replace(state, cache=random_cache(cfg, args.context, args.seed))
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    # two warm-up calls: a trace can change jax's trace context (the first Pallas trace
    # imports a module that registers a config option), and then the next call of the same
    # jit recompiles; that recompile must land in the warm-up, not in the timed call
    state = dec.generate(params, state, until=1)
    state = dec.generate(params, state, until=args.warmup)
    jax.block_until_ready(state)
    warm_s = time.perf_counter() - t0
    n_compiled = _cache_size(dec._generate)
    t0 = time.perf_counter()
    state = dec.generate(params, state, until=args.warmup + args.steps)
    jax.block_until_ready(state)
    dt = time.perf_counter() - t0
    recompiled = n_compiled is not None and _cache_size(dec._generate) != n_compiled
    done = int(state.step) - args.warmup
    s = summarize(state)
    m = jax.device_get(state.metrics)
    sl = slice(args.warmup, args.warmup + done)
    tokens = np.asarray(state.tokens)[:, : args.warmup + done + 1]
    lengths = np.asarray(state.cache.lengths)
    return dict(
        cfg=cfg,
        dec=dec,
        step_s=dt / max(done, 1),
        steps=done,
        setup_s=setup_s,
        warmup_s=warm_s,
        hbm_bytes=np.asarray(m.hbm_bytes[sl], np.float64),
        host_bytes=np.asarray(m.host_bytes[sl], np.float64),
        modeled_s=float(np.sum(m.latency[sl])) / max(done, 1),
        summary=s,
        tokens=tokens,
        final_len=int(lengths.max()),
        recompiled=recompiled,
    )


def prewarm_transfers(cfg: CacheConfig, fetches) -> None:
    """Traces, compiles and runs a tiny bulk read and write through each Pallas fetch path
    before the first case, so the modules the first Pallas trace imports (and the trace-context
    options they register) are there before any case's jit is traced: saves the first case a
    second compile. Failures are printed, not raised (the cases then report their own)."""
    kind = cfg.host_memory_kind
    for fetch in sorted({resolve_fetch(f) for f in fetches}):
        if fetch != "pallas":
            continue
        shape = (1, 8, cfg.block_size, cfg.kv_heads, cfg.head_dim)
        host = single_device_sharding(jax.devices()[0], memory_kind=kind)
        pool = jax.device_put(jnp.zeros(shape, cfg.jnp_dtype), host)
        rows = jnp.asarray([0, 3, -1, 5], jnp.int32)

        def f(pool, rows, fetch=fetch):
            got = read_blocks(pool, rows, fetch, pool_kind=kind)
            return write_blocks(pool, rows, got + 1, fetch, pool_kind=kind, after_reads=got)

        try:
            jax.block_until_ready(jax.jit(f)(pool, rows))
        except Exception as e:
            print(f"prewarm {fetch}: {type(e).__name__}: {str(e)[:300]}")


def _cache_size(jitted) -> int | None:
    """Compiled entries of a jitted function (None where jax does not tell)."""
    try:
        return int(jitted._cache_size())
    except Exception:
        return None


def bounds(hbm_bytes, host_bytes, *, layers: int, weight_bytes: float, bh: float, bl: float):
    """Mean bound seconds per step: two-tier, ideal split, HBM only (per-step arrays in)."""
    w = weight_bytes / layers
    hb, xb = hbm_bytes / layers, host_bytes / layers
    two = layers * np.maximum((w + hb) / bh, xb / bl)
    prof = HardwareProfile("measured", bh, bl, 1.0)
    ideal = layers * np.asarray(unlimited_step_time(hb + xb, profile=prof, weight_bytes=w))
    hbm_only = layers * (w + hb + xb) / bh
    return float(two.mean()), float(ideal.mean()), float(hbm_only.mean())


def _fast_cpu_compile() -> None:
    """Off GPU the timings are a smoke test: compile XLA:CPU code at optimisation level 0
    (about half the compile time of this script's cases, slower steps). Only when the process is
    pinned to the CPU (JAX_PLATFORMS=cpu) and before any backend starts; an explicit
    XLA_FLAGS setting of the level wins."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" and "optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


def verdict(rows, target: str, context: int) -> tuple[bool, str]:
    """(ok, line) of the GPU question for the best fetch mechanism among `rows`."""
    hits = [r for r in rows if r["case"] == target and "ratio" in r]
    best = max(hits, key=lambda r: r["ratio"]) if hits else None
    ok = best is not None and best["ratio"] >= TARGET_RATIO
    got = f"{best['ratio']:.2f} (fetch {best['fetch']})" if best else "no result"
    line = (
        f"{'PASS' if ok else 'FAIL'}: {target} at context {context} reaches {got} of its "
        f"two-tier bound (target >= {TARGET_RATIO:.0%})"
    )
    return ok, line


def main(argv=None) -> int:
    _fast_cpu_compile()
    args = parse_args(argv)
    gpu = on_gpu()
    dev = jax.devices()[0]
    model = build_model(args)
    mc = model.config
    w_step = step_weight_bytes(model)
    kv_token = 2 * mc.num_kv_heads * mc.head_dim * jnp.dtype(mc.dtype).itemsize  # per layer
    kv_ctx = kv_token * mc.num_layers * args.context * args.batch
    print(
        f"device: {dev.platform} {dev.device_kind}; backend {jax.default_backend()}; "
        f"jax {jax.__version__}"
    )
    print(
        f"model: {args.model} {mc.num_layers} layers, dim {mc.dim}, heads {mc.num_heads}/"
        f"{mc.num_kv_heads} kv x {mc.head_dim}, ffn {mc.ffn_dim}, vocab {mc.vocab_size}, "
        f"{mc.dtype}; weights read per step {w_step / 2**20:.1f} MiB, KV at context "
        f"{kv_ctx / 2**20:.1f} MiB ({kv_ctx / w_step:.1f}x)"
    )
    print(
        f"context {args.context}, batch {args.batch}, {args.steps} timed steps after "
        f"{args.warmup} warm-up, block {args.block_size}, HBM {args.hbm_fraction:.0%}, "
        f"fetch {','.join(args.fetches)} (auto = {resolve_fetch('auto')}), impl {args.impl}"
    )
    if gpu:
        print("GPU run: this is a GPU figure")
    else:
        print("CPU run: both tiers are the same DRAM, no GPU figure was taken")
    sys.stdout.flush()

    t0 = time.perf_counter()
    profile = HardwareProfile.measure()
    bh, bl = profile.hbm_bandwidth, profile.link_bandwidth
    print(
        f"measured: B_hbm {bh / 1e9:.1f} GB/s (device copy r+w), B_link {bl / 1e9:.1f} GB/s "
        f"(pinned_host -> device), alpha* {profile.alpha_star:.3f} "
        f"({time.perf_counter() - t0:.1f} s)"
    )

    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"{dev.platform} {dev.device_kind}",
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "gpu_figure": gpu,
        "args": {k: v for k, v in vars(args).items()},
        "model": {
            "layers": mc.num_layers,
            "dim": mc.dim,
            "heads": mc.num_heads,
            "kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "ffn": mc.ffn_dim,
            "vocab": mc.vocab_size,
            "dtype": mc.dtype,
            "weight_bytes_per_step": w_step,
            "kv_bytes_at_context": kv_ctx,
        },
        "bandwidth": {"hbm": bh, "link": bl, "alpha_star": profile.alpha_star},
        "rows": [],
    }

    def dump():
        if args.json:
            d = os.path.dirname(os.path.abspath(args.json))
            os.makedirs(d, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)

    dump()
    probe = CacheConfig.for_model(mc, batch=args.batch, max_len=args.block_size, hbm_fraction=1.0)
    prewarm_transfers(probe, args.fetches)
    jobs = [(fetch, *c) for fetch in args.fetches for c in cases(args)]
    hdr = (
        f"{'case':<26} {'fetch':<6} {'ms/step':>9} {'tok/s':>9} {'bound':>9} {'ratio':>6} "
        f"{'ideal':>9} {'hit':>6} {'moved':>6}  notes"
    )
    tqdm.write(hdr, file=sys.stdout)
    tokens = {}
    t_all = time.perf_counter()
    pct = f"{round(100 * args.hbm_fraction)}"
    target = f"hbm{pct} exact static"
    judge = gpu and args.context >= 32768
    for fetch, name, frac, placement in tqdm(
        jobs, desc="bench_decode_bound", file=sys.stderr, leave=False
    ):
        elapsed = time.perf_counter() - T_START
        if args.budget_s and elapsed > args.budget_s:
            tqdm.write(
                f"{name:<26} {fetch:<6} SKIPPED: {elapsed:.0f} s > --budget-s {args.budget_s:g}",
                file=sys.stdout,
            )
            out["rows"].append({"case": name, "fetch": fetch, "skipped": "time budget"})
            continue
        try:
            r = run_case(args, model, profile, frac, placement, fetch)
        except Exception as e:  # keep going: one case failing must not lose the others
            msg = f"{type(e).__name__}: {str(e)[:300]}"
            tqdm.write(f"{name:<26} {fetch:<6} ERROR {msg}", file=sys.stdout)
            out["rows"].append({"case": name, "fetch": fetch, "error": msg})
            dump()
            continue
        two, ideal, hbm_only = bounds(
            r["hbm_bytes"],
            r["host_bytes"],
            layers=mc.num_layers,
            weight_bytes=w_step,
            bh=bh,
            bl=bl,
        )
        tps = args.batch / r["step_s"]
        row = {
            "case": name,
            "fetch": fetch,
            "fetch_resolved": resolve_fetch(fetch),
            "hbm_fraction": frac,
            "attention": placement.attention,
            "policy": placement.policy,
            "hbm_blocks_per_layer": r["cfg"].hbm_slots,
            "host_blocks_per_layer": r["cfg"].host_slots,
            "step_ms": 1e3 * r["step_s"],
            "tokens_per_s": tps,
            "timed_steps": r["steps"],
            "setup_s": r["setup_s"],
            "warmup_s": r["warmup_s"],
            "hbm_kv_bytes_per_step": float(r["hbm_bytes"].mean()),
            "host_kv_bytes_per_step": float(r["host_bytes"].mean()),
            "bound_ms": 1e3 * two,
            "bound_tokens_per_s": args.batch / two,
            "ratio": tps / (args.batch / two),
            "ideal_split_ms": 1e3 * ideal,
            "ideal_split_tokens_per_s": args.batch / ideal,
            "hbm_only_ms": 1e3 * hbm_only,
            "ratio_vs_hbm_only": tps / (args.batch / hbm_only),
            "modeled_ms": 1e3 * r["modeled_s"],
            "hbm_hit_rate": r["summary"]["hbm_hit_rate"],
            "migrated_blocks": r["summary"]["migrated_blocks"],
            "final_length": r["final_len"],
            "recompiled_in_timed_call": r["recompiled"],
        }
        tokens[(fetch, name)] = r["tokens"]
        out["rows"].append(row)
        notes = (
            f"KV {row['hbm_kv_bytes_per_step'] / 2**20:.1f}+"
            f"{row['host_kv_bytes_per_step'] / 2**20:.1f} MiB hbm+link"
        )
        if frac == 1.0:
            notes += f"; vs HBM-only bound {row['ratio_vs_hbm_only']:.2f}"
        if r["recompiled"]:
            notes += "; WARNING: the timed call recompiled (time includes a compile)"
        tqdm.write(
            f"{name:<26} {fetch:<6} {row['step_ms']:9.3f} {tps:9.1f} "
            f"{row['bound_tokens_per_s']:9.1f} {row['ratio']:6.2f} "
            f"{row['ideal_split_tokens_per_s']:9.1f} {100 * row['hbm_hit_rate']:5.1f}% "
            f"{row['migrated_blocks']:6d}  {notes}",
            file=sys.stdout,
        )
        if judge and name == target:  # answer as soon as measured: a later kill keeps it
            tqdm.write(verdict([row], target, args.context)[1], file=sys.stdout)
        sys.stdout.flush()
        dump()
        del r

    # exact attention reads every block wherever it lives: the greedy tokens must agree
    same = {}
    ref = next((tokens[k] for k in tokens if k[1] == "all-hbm exact"), None)
    for (fetch, name), toks in tokens.items():
        if "exact" in name and ref is not None and toks.shape == ref.shape:
            same[f"{name} [{fetch}]"] = bool(np.array_equal(toks, ref))
    identical = bool(same) and all(same.values()) and len(same) >= 2
    detail = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in same.items())
    print(
        f"tokens identical (exact cases vs the first all-HBM exact, same cache and prompt): "
        f"{'yes' if identical else 'no'} ({detail or 'nothing to compare'})"
    )
    out["tokens_identical"] = identical
    out["tokens_compared"] = same
    if ref is not None:
        out["tokens_all_hbm_exact"] = ref.tolist()

    if judge:
        ok, line = verdict(out["rows"], target, args.context)
        print(line + (" [best of the fetch mechanisms]" if len(args.fetches) > 1 else ""))
        out["pass"] = ok
    elif gpu:
        print(f"no PASS/FAIL: the target is at context >= 32768, this run is {args.context}")
        out["pass"] = None
    else:
        print("no PASS/FAIL off GPU: CPU smoke run, no GPU figure was taken")
        out["pass"] = None
    out["total_s"] = time.perf_counter() - t_all
    dump()
    print(f"cases done in {out['total_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
