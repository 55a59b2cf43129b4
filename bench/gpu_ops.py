"""GPU operations per decode step, compiled for an H200 on a machine without a GPU.

Builds a Llama-3.1-8B-shaped model (32 layers, dim 4096, 32 q / 8 kv heads, head_dim 128,
ffn 14336, vocab 128256, bf16) and its decode state abstractly (nothing is allocated at full
size: `nnx.eval_shape`, `jax.eval_shape`, host pools as pinned_host ShapeDtypeStructs), compiles
the decode loop's jitted step for every (context, batch, attention mode, policy) case, plus
`plan_moves` + `migrate`, `compact` and (`--functions prefill`) the prefill (per policy: lrfu's
starts from the prompt's prior),
and prints what the optimized HLO executes per call (`jaxkv.gpu.hlo.analyze`).

    JAX_PLATFORMS=cpu python bench/gpu_ops.py --layers 2 --contexts 8k --batches 1
    JAX_PLATFORMS=cpu python bench/gpu_ops.py --json --check ...   # exit 1 if a must-hold fails

`read_overlap` is the fewest compute-stream operations the schedule runs while one of the
step's host reads is in flight on its own stream (`jaxkv.gpu.hlo.overlap`; blank where the
reads are not on a side stream).

`program_ops` is the number of operations of the lowered program (StableHLO, before XLA's
optimizations; `jaxkv.gpu.hlo.program_ops`), `gpu_ops` what the optimized module executes.

The must-hold checks (--check; bench/gpu_checks.py): no while loop but scans over layers (known
trip count = layers; so 0 unknown_trip_loops): the step's one, the prefill's forward and, under
lrfu, its recomputation of the prompt's last positions (`jaxkv.decode.prompt`); in the window
step (plan and migration) besides, the plan's loops of trip counts the policy fixes (the
annealer's `max_iters`, the forecast's window), the same at every context; 0 host_syncs, the
same lowered program (the same list of operations, `program_digest`) of a (batch, mode, policy,
function) at every context, its gpu_ops within OPS_BAND at every context (XLA's size-dependent
kernel choices for that same program, not per-block work; see `ops_context_free`), and host KV
traffic of at most 2 transfers per layer per call in each direction (K and V). Needs `pip
install -e .[gpu-compile]`.

Bytes (`--bytes`, and under --check for every decode step compiled): XLA's cost analysis of the
compiled step ("bytes accessed", `jaxkv.gpu.aot.cost_analysis`, every layer of the scan counted)
against the cost model's bytes for that step (`modeled_step_bytes`, `jaxkv.cost.step_bytes`:
weights, KV read from each tier, the token writes, the host blocks' staged copy and the sparse
selection's summaries); the check holds the ratio within BYTES_BAND up to
BYTES_CHECKED_CONTEXT, for the policies without a per-step rule (a follow policy's promotions
are migrations, priced apart). The prefill's temporary
memory (XLA's memory analysis) is checked under PREFILL_TEMP_SHARE of the target's HBM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin registers only on cpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv import Decoder  # noqa: E402
from jaxkv import cache as kvc  # noqa: E402
from jaxkv.cache.quant import parse_policy  # noqa: E402
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig  # noqa: E402
from jaxkv.cost import ARCHITECTURES, step_bytes  # noqa: E402
from jaxkv.decode.state import token_write_bytes  # noqa: E402
from jaxkv.gpu import aot as gc  # noqa: E402
from jaxkv.gpu import hlo  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_checks import (  # noqa: E402, F401  (the checks, re-exported for the tests)
    BYTES_BAND,
    BYTES_CHECKED_CONTEXT,
    OPS_BAND,
    PREFILL_TEMP_SHARE,
    check,
    explain,
    group_key,
    ops_context_free,
    policy_free,
    prefill_pairs,
    transfer_failures,
)

POLICIES = ("static", "lru-plan", "anneal", "anneal+reuse+follow", "lrfu")
MODES = ("exact", "sparse")
NEW_TOKENS = 64  # max_len = context + NEW_TOKENS
# functions that depend on the mode and policy (the prefill: lrfu starts from the prompt's prior)
PER_POLICY = ("step", "window_step", "prefill")
PLANNING = ("lru-plan", "anneal", "anneal+reuse+follow")  # the policies whose window step plans
READ_SCOPE = "host_part"  # jax.named_scope of the attention's host read (jaxkv.attention)
FIELDS = ("gpu_ops", "h2d", "d2h", "host_kernels", "loops", "unknown_trip_loops", "host_syncs")
TABLE = (
    "fn",
    "context",
    "batch",
    "mode",
    "policy",
    "program_ops",
    "gpu_ops",
    "h2d",
    "d2h",
    "host_reads",
    "read_overlap",
    "loops",
    "unknown_trip_loops",
    "host_syncs",
    "bytes_ratio",
    "temp_gb",
    "compile_s",
)
TARGET_PROFILES = {"h200": "h200-pcie", "gh200": "gh200"}  # the spec's HBM size

LLAMA_8B = {  # the one table (jaxkv.cost.ARCHITECTURES); the layers are set per program
    **{k: v for k, v in ARCHITECTURES["llama3-8b"].llama_fields().items() if k != "num_layers"},
    "dtype": "bfloat16",
}
SMALL = dict(  # the tests' small shape
    vocab_size=512,
    dim=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    ffn_dim=256,
    dtype="bfloat16",
)


def parse_tokens(text: str) -> int:
    """'8k' -> 8192, '1024' -> 1024."""
    t = text.strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError as e:
        raise ValueError(f"bad context {text!r}: expected an int or '<n>k'") from e


def abstract_model(layers: int, shape: dict, max_len: int):
    """A Llama of `shape` with `layers` layers whose parameters are ShapeDtypeStructs."""
    from models import Llama, LlamaConfig

    cfg = LlamaConfig(num_layers=layers, max_seq_len=max(max_len, 2048), **shape)
    return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))


def cache_config(mc, batch: int, max_len: int, **kw) -> CacheConfig:
    """The compile check's cache for model config `mc`: block 16, bf16, HBM 25% unless `kw`
    says otherwise (any CacheConfig field)."""
    base = dict(block_size=16, hbm_fraction=0.25, dtype="bfloat16")
    return CacheConfig(
        num_layers=mc.num_layers,
        kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        batch=batch,
        max_len=max_len,
        **{**base, **kw},
    )


def _is_host_pool(path, _leaf) -> bool:
    names = [getattr(k, "name", None) for k in path]
    return "host_k" in names or "host_v" in names


def build(
    *,
    layers: int,
    context: int,
    batch: int,
    mode: str,
    policy: str,
    shape: dict = LLAMA_8B,
    hbm: float = 0.25,
    topk: float = 0.25,
    window: int = 50,
    new_tokens: int = NEW_TOKENS,
    fp8: str = "off",
    fp8_age: int = 0,
    policy_kwargs: dict | None = None,
):
    """(decoder, abstract params, abstract decode state after a `context`-token prefill);
    `policy_kwargs` as the Decoder's (e.g. lrfu's {"steady_queries": 256}).

    The state comes from `jax.eval_shape` of the decoder's prefill; its leaves are re-made as
    CPU-sharded ShapeDtypeStructs, the cache's host_k / host_v as pinned_host (compiled S(5))."""
    max_len = context + new_tokens
    model = abstract_model(layers, shape, max_len)
    mc = model.config
    cache_cfg = cache_config(mc, batch, max_len, hbm_fraction=hbm, fp8=fp8, fp8_age=fp8_age)
    placement = PlacementConfig(policy=policy, attention=mode, topk=topk, window=window)
    dec = Decoder(
        model, cache_cfg, placement, max_new_tokens=new_tokens, profile="h200-pcie",
        policy_kwargs=policy_kwargs,
    )  # fmt: skip
    params = gc.abstract(nnx.split(model)[1], host=lambda p, x: False)
    prompts = jax.ShapeDtypeStruct((batch, context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    key = jax.random.key(0)
    state = jax.eval_shape(dec.prefill_fn, params, prompts, lengths, key)
    state = gc.abstract(state, host=_is_host_pool)
    return dec, params, state, (prompts, lengths, key)


def modeled_step_bytes(dec, context: int, mode: str, topk: float = 0.25) -> dict:
    """The cost model's bytes (`jaxkv.cost.step_bytes`, summed over the layers) for one decode
    step of `dec` after a `context`-token prefill of every sequence: exact mode reads every
    live block (the context's and the new token's), sparse mode ceil(topk x live) of them (at
    least the sink and recent blocks). The prefill leaves the first sealed blocks in HBM (its
    pool, less the tails' slots) and the rest on host; sparse reads take the tiers' shares of
    the live blocks (the selection does not look at placement), exact reads all of them."""
    c, p = dec.cache_config, dec.placement
    live = -(-(context + 1) // c.block_size)
    sealed = context // c.block_size
    in_hbm = min(sealed, c.hbm_pool_slots) + (live - sealed)  # the tail too
    if mode == "exact":
        reads = live
    else:
        reads = max(math.ceil(topk * live), min(live, p.sink_blocks + p.recent_blocks))
    host = reads * (live - in_hbm) / live
    summary = 0.0 if mode == "exact" else live * 2 * c.kv_heads * c.head_dim * 4
    per_layer = step_bytes(
        weight_bytes=dec.weight_bytes_per_layer,
        hbm_read_bytes=(reads - host) * c.batch * c.block_bytes,
        host_read_bytes=host * c.batch * c.host_block_bytes,
        write_bytes=token_write_bytes(c),
        summary_bytes=summary * c.batch,
    )
    return {k: float(v) * c.num_layers for k, v in per_layer.items()}


def compile_cases(
    layers, context, batch, mode, policy, *, shape, target, what, hbm=0.25, fp8="off", fp8_age=0,
    policy_kwargs=None,
):  # fmt: skip
    """Compiles the functions in `what` ("step", "window_step", "migrate", "compact",
    "prefill") for one case (`build`'s arguments).

    Returns {function: (CompiledModule, analysis)}."""
    dec, params, state, (prompts, lengths, key) = build(
        layers=layers,
        context=context,
        batch=batch,
        mode=mode,
        policy=policy,
        shape=shape,
        hbm=hbm,
        fp8=fp8,
        fp8_age=fp8_age,
        policy_kwargs=policy_kwargs,
    )
    c = dec.cache_config
    out = {}
    for fn in what:
        if fn == "step":  # the decode step: no plan, no migration
            m = gc.compile_for_gpu(dec.decode_step, params, state, target=target, name="step")
        elif fn == "window_step":  # the step that ends a window: plan, migrate (, compact)
            m = gc.compile_for_gpu(
                dec.window_step, params, state, target=target, name="window_step"
            )
        elif fn == "migrate":
            target_shape = jax.ShapeDtypeStruct((c.num_layers, c.batch * c.max_blocks), bool)
            max_moves = dec.placement.max_moves

            def migrate(cache, target_in_hbm, max_moves=max_moves):
                return kvc.migrate(cache, kvc.plan_moves(cache, target_in_hbm, max_moves))

            m = gc.compile_for_gpu(
                migrate,
                state.cache,
                target_shape,
                donate_argnums=(0,),
                target=target,
                name="migrate",
            )
        elif fn == "compact":
            m = gc.compile_for_gpu(
                lambda cache: kvc.compact(cache, impl="xla"),
                state.cache,
                donate_argnums=(0,),
                target=target,
                name="compact",
            )
        elif fn == "prefill":
            m = gc.compile_for_gpu(
                dec.prefill_fn, params, prompts, lengths, key, target=target, name="prefill"
            )
        else:
            raise ValueError(f"unknown function {fn!r}: expected step, migrate, compact, prefill")
        out[fn] = (m, m.analyze(scope=READ_SCOPE))
        if fn == "step":
            out[fn][1]["modeled_bytes"] = modeled_step_bytes(dec, context, mode)
    return out


def byte_fields(mod, analysis: dict, target: str) -> dict:
    """A case row's bytes and memory: XLA's bytes accessed, the modeled bytes of a step (by
    part) and their ratio, the temporary memory and its share of the target's HBM."""
    hbm = HardwareProfile.preset(TARGET_PROFILES.get(target, "h200-pcie")).hbm_bytes
    temp = mod.memory.get("temp_bytes")
    out = dict(
        bytes_accessed=mod.cost.get("bytes accessed") if mod.name == "step" else None,
        temp_gb=None if temp is None else round(temp / 1e9, 3),
        temp_share=None if temp is None else temp / hbm,
        bytes_ratio=None,
    )
    modeled = analysis.get("modeled_bytes")
    if modeled and out["bytes_accessed"]:
        out.update(
            modeled_total=modeled["total"],
            modeled=modeled,
            bytes_ratio=round(out["bytes_accessed"] / modeled["total"], 3),
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8k,32k,128k", help="comma list, e.g. 8k,32k,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--layers", type=int, default=32, help="model layers (fewer: quicker)")
    ap.add_argument("--small", action="store_true", help="the tests' small model dims")
    ap.add_argument(
        "--functions",
        default="step,window_step,migrate,compact",
        help="comma list of step, window_step, migrate, compact, prefill",
    )
    ap.add_argument("--target", default="h200", help=f"GPU spec: {gc.available_specs()}")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2 layers, contexts 8k,32k, batch 1 (overrides those options)",
    )
    ap.add_argument(
        "--must-hold",
        action="store_true",
        help="issue 18's must-hold set on the full 32-layer shape, batch 1 (overrides the case "
        "options): the decode step at 32k sparse under every policy, at 8k / 32k / 128k for "
        "static sparse and exact, migrate and compact at 8k / 32k / 128k, the planning "
        "policies' window steps at 32k (and anneal+reuse+follow's at 8k) (about 7 min here)",
    )
    ap.add_argument(
        "--fp8", default="off", help="the cache's FP8 policy: off, host or age:N (N tokens)"
    )
    ap.add_argument(
        "--explain",
        action="store_true",
        help="also print (to stderr) the source ops whose executed operations differ between "
        "contexts (XLA's size-dependent kernel choices, per jax op)",
    )
    ap.add_argument("--json", action="store_true", help='print {"cases": [...]} as JSON')
    ap.add_argument("--check", action="store_true", help="exit 1 if a must-hold check fails")
    args = ap.parse_args(argv)
    try:
        fp8, fp8_age = parse_policy(args.fp8)
    except ValueError as e:
        ap.error(f"--fp8: {e}")
    if args.quick:
        args.layers, args.contexts, args.batches = 2, "8k,32k", "1"
    contexts = [parse_tokens(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    modes = args.modes.split(",")
    policies = args.policies.split(",")
    functions = args.functions.split(",")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}: expected one of {MODES}")
    shape = SMALL if args.small else LLAMA_8B
    from tqdm import tqdm

    # step depends on (mode, policy); migrate, compact, prefill only on the cache's shape
    jobs = []
    if args.must_hold:
        args.layers, contexts, batches, functions = 32, [], [], []
        for ctx in (8192, 32768, 131072):
            jobs.append((ctx, 1, modes[0], policies[0], ["migrate", "compact"], True))
            jobs += [(ctx, 1, m, "static", ["step"], False) for m in MODES]
        jobs += [(32768, 1, "sparse", p, ["step"], False) for p in POLICIES if p != "static"]
        # the planning policies' window steps (plan + migration) at 32k, the richest plan's
        # (forecast, annealer, follow rule) at 8k too: its loops' trips may not grow
        jobs += [(32768, 1, "sparse", p, ["window_step"], False) for p in PLANNING]
        jobs.append((8192, 1, "sparse", PLANNING[-1], ["window_step"], False))
    for ctx in contexts:
        for b in batches:
            per_shape = [f for f in functions if f not in PER_POLICY]
            if per_shape:
                jobs.append((ctx, b, modes[0], policies[0], per_shape, True))
            per_policy = [f for f in functions if f in PER_POLICY]
            if per_policy:
                jobs += [(ctx, b, m, p, per_policy, False) for m in modes for p in policies]
    rows, sources = [], {}
    t_all = time.perf_counter()
    for ctx, b, mode, pol, what, shape_only in tqdm(jobs, file=sys.stderr, desc="compiling"):
        res = compile_cases(
            args.layers, ctx, b, mode, pol, shape=shape, target=args.target, what=what,
            fp8=fp8, fp8_age=fp8_age,
        )  # fmt: skip
        for fn, (mod, a) in res.items():
            rows.append(
                dict(
                    fn=fn,
                    context=ctx,
                    batch=b,
                    mode="-" if shape_only else mode,
                    policy="-" if shape_only else pol,
                    layers=args.layers,
                    fp8=args.fp8,
                    **{f: a[f] for f in FIELDS},
                    program_ops=len(ops := hlo.program_ops(mod.stablehlo_text)),
                    program_digest=hlo.program_digest(ops),
                    host_reads=a["scope_h2d"],
                    read_overlap=min(hlo.overlap(mod.hlo_text), default=None),
                    host_compute=a["host_compute"],
                    conditionals=a["conditionals"],
                    transfers=dict(a["transfers"]),
                    loop_trips=dict(a["loop_trips"]),
                    lower_s=round(mod.lower_seconds, 2),
                    compile_s=round(mod.compile_seconds, 2),
                    **byte_fields(mod, a, args.target),
                )
            )
            sources.setdefault(group_key(rows[-1]), {})[ctx] = a["ops_by_source"]
    if args.explain:
        for line in explain(sources) or ["no source op executes differently between contexts"]:
            print(line, file=sys.stderr)
    fails = check(rows, args.layers) if args.check else []
    if args.check:
        fails += policy_free(rows)
    if args.json:
        print(
            json.dumps(
                {
                    "cases": rows,
                    "failures": fails,
                    "seconds": round(time.perf_counter() - t_all, 1),
                },
                indent=1,
            )
        )
    else:
        head = TABLE
        print(" | ".join(head))
        print(" | ".join("---" for _ in head))
        for r in rows:
            print(" | ".join(str(r[h]) for h in head))
        print(
            f"\n{len(rows)} compiles in {time.perf_counter() - t_all:.1f} s "
            f"({args.layers} layers, target {args.target})"
        )
        for f in fails:
            print("FAIL", f)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
