"""Compile time against depth: the first `generate` call (mostly compilation) and the prefill
of models that differ only in their number of layers, per live policy.

Issue 19's setting: a random-init Llama of dim 256, 8 query / 2 KV heads, head_dim 64 (ffn 512,
vocab 256), a 2,048-token prompt, sparse attention over the top 25% of blocks, HBM at 25% of
the KV footprint, block 16. For each depth and case it builds a fresh Decoder (nothing is
shared between cases, and no persistent compilation cache is used), then times, blocked on:

- `prefill`: the compile of `Decoder.prefill`: its first call (compile + run) less a second,
  compiled call (the run alone: 8x the layers run 8x the prompt's compute);
- `first generate`: the first `Decoder.generate` call of `--steps` steps (compiles the loop
  with both steps, then runs it);
- `steady generate`: a second call of `--steps` steps (no compilation), for reference.

It prints a table with the ratio of each depth's times to the shallowest depth's, measured in
this run, and writes JSON with `--json`. The must-hold of issue 19: the deepest model's first
generate <= 1.5x the shallowest's for every live policy, under 60 s for anneal+reuse+follow at
32 layers, and prefill likewise.

    JAX_PLATFORMS=cpu python bench/bench_compile.py [--layers 4,32] [--json PATH]
    JAX_PLATFORMS=cpu python bench/bench_compile.py --quick   # 2 and 4 layers, 256 tokens
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
from _progress import tqdm  # tqdm, or a stand-in where it is missing
from flax import nnx

from jaxkv import Decoder
from jaxkv.config import CacheConfig, PlacementConfig
from models.llama import Llama, LlamaConfig

CASES = (  # (name, HBM fraction, policy)
    ("all-hbm", 1.0, "static"),
    ("static", 0.25, "static"),
    ("lru-plan", 0.25, "lru-plan"),
    ("anneal", 0.25, "anneal"),
    ("anneal+reuse+follow", 0.25, "anneal+reuse+follow"),
)
SHAPE = dict(vocab_size=256, dim=256, num_heads=8, num_kv_heads=2, head_dim=64, ffn_dim=512)
RATIO_LIMIT = 1.5  # deepest / shallowest first generate (and prefill)
FOLLOW_LIMIT_S = 60.0  # anneal+reuse+follow's first generate at the deepest depth


def run_case(layers, frac, policy, *, prompt_len, steps, window, topk):
    cfg = LlamaConfig(num_layers=layers, max_seq_len=prompt_len + steps + 8, **SHAPE)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    params = nnx.split(model)[1]
    cache = CacheConfig.for_model(
        cfg, batch=1, max_len=prompt_len + steps + 8, block_size=16, hbm_fraction=frac
    )
    placement = PlacementConfig(policy=policy, window=window, attention="sparse", topk=topk)
    dec = Decoder(model, cache, placement, max_new_tokens=2 * steps + 2)
    prompt = jax.random.randint(jax.random.key(1), (1, prompt_len), 0, cfg.vocab_size)
    prompt = prompt.astype(jnp.int32)
    t0 = time.perf_counter()
    state = jax.block_until_ready(dec.prefill(params, prompt))
    t1 = time.perf_counter()
    jax.block_until_ready(dec.prefill(params, prompt))  # compiled: the run alone
    t_run = time.perf_counter() - t1
    t1 = time.perf_counter()
    state = jax.block_until_ready(dec.generate(params, state, until=steps))
    t2 = time.perf_counter()
    state = jax.block_until_ready(dec.generate(params, state, until=2 * steps))
    t3 = time.perf_counter()
    first = t1 - t0 - t_run
    return {
        "prefill_first_s": first,
        "prefill_run_s": t_run,
        "prefill_s": max(first - t_run, 0.0),  # the compile: first call less a compiled run
        "first_generate_s": t2 - t1,
        "steady_generate_s": t3 - t2,
        "steps": int(state.step),
        "compilations": dec.compilations(),
    }


def check(results: dict, depths: list[int]) -> list[str]:
    """The must-hold failures (see the module docstring)."""
    lo, hi = str(min(depths)), str(max(depths))
    fails = []
    for name, by_depth in results.items():
        for key in ("first_generate_s", "prefill_s"):
            r = by_depth[hi][key] / by_depth[lo][key]
            if r > RATIO_LIMIT:
                fails.append(f"{name}: {key} at {hi} layers is {r:.2f}x {lo} layers'")
    follow = results.get("anneal+reuse+follow", {}).get(hi)
    if follow and follow["first_generate_s"] > FOLLOW_LIMIT_S:
        fails.append(
            f"anneal+reuse+follow: first generate {follow['first_generate_s']:.1f} s at {hi} "
            f"layers (limit {FOLLOW_LIMIT_S:.0f} s)"
        )
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,32", help="comma list of depths")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="steps per generate call")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--topk", type=float, default=0.25)
    ap.add_argument("--policies", default=",".join(n for n, _, _ in CASES))
    ap.add_argument("--quick", action="store_true", help="2 and 4 layers, 256-token prompt")
    ap.add_argument("--check", action="store_true", help="exit 1 if a must-hold fails")
    ap.add_argument("--json", default=None, help="write results to this path")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.prompt_len, args.steps = "2,4", 256, 4
    depths = sorted(int(x) for x in args.layers.split(","))
    if len(depths) < 2 or depths[0] < 1:
        raise SystemExit(f"--layers {args.layers!r}: expected at least two depths >= 1")
    names = args.policies.split(",")
    cases = [c for c in CASES if c[0] in names]
    unknown = sorted(set(names) - {c[0] for c in CASES})
    if unknown:
        raise SystemExit(f"unknown cases {unknown}: expected some of {[c[0] for c in CASES]}")
    dev = jax.devices()[0]
    print(
        f"device: {dev.platform} {dev.device_kind}; jax {jax.__version__}; shape {SHAPE}; "
        f"prompt {args.prompt_len}, sparse top {args.topk:.0%}, HBM 25% (all-hbm: 100%), "
        f"W={args.window}, {args.steps} steps per generate",
        flush=True,
    )
    results: dict[str, dict[str, dict]] = {}
    jobs = [(c, d) for c in cases for d in depths]
    for (name, frac, policy), d in tqdm(jobs, desc="compiling", file=sys.stderr):
        results.setdefault(name, {})[str(d)] = run_case(
            d,
            frac,
            policy,
            prompt_len=args.prompt_len,
            steps=args.steps,
            window=args.window,
            topk=args.topk,
        )
    lo = str(depths[0])
    head = ["case"] + [
        f"{d} layers: prefill compile (run) / first gen / steady gen (s)" for d in depths
    ]
    head += [f"ratio {depths[-1]}/{depths[0]}: first gen, prefill"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, by in results.items():
        cells = [name]
        for d in depths:
            r = by[str(d)]
            cells.append(
                f"{r['prefill_s']:.1f} ({r['prefill_run_s']:.1f}) / "
                f"{r['first_generate_s']:.1f} / {r['steady_generate_s']:.2f}"
            )
        hi = by[str(depths[-1])]
        cells.append(
            f"{hi['first_generate_s'] / by[lo]['first_generate_s']:.2f}, "
            f"{hi['prefill_s'] / by[lo]['prefill_s']:.2f}"
        )
        print("| " + " | ".join(cells) + " |")
    fails = check(results, depths)
    for f in fails:
        print("FAIL:", f)
    if args.check and not fails:
        print("PASS: every must-hold of the compile-time check")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": f"{dev.platform} {dev.device_kind}",
                    "jax": jax.__version__,
                    "args": vars(args),
                    "shape": SHAPE,
                    "results": results,
                    "failures": fails,
                },
                f,
                indent=2,
            )
    return 1 if args.check and fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
