"""Wall time of one decode step: all-HBM cache vs HBM holding a fraction of the KV footprint.

Runs the default model on the present device (CPU here; the GPU when run by gpu_check.sh) and
prints per-step wall milliseconds, the ratio to the all-HBM run measured in the same process,
the HBM hit rate and the modeled tokens/s under a hardware profile.

    python bench/bench_decode.py [--prompt-len 1024] [--steps 64] [--json bench/results/decode.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from flax import nnx

from jaxkv.config import CacheConfig, PlacementConfig
from jaxkv.decode import Decoder, summarize
from models.default import default_model
from models.demo import encode_prompt
from models.tiny import tiny_model


def time_steps(dec, params, prompt, steps: int, warmup: int = 4) -> tuple[float, dict]:
    """Median-free, simple: compile + warm up, then time `steps` steps in one generate call."""
    state = dec.prefill(params, prompt)
    state = dec.generate(params, state, until=warmup)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = dec.generate(params, state, until=warmup + steps)
    jax.block_until_ready(state)
    dt = time.perf_counter() - t0
    return dt / (int(state.step) - warmup), summarize(state)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--hbm-fraction", type=float, default=0.25)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--profile", default="gh200")
    ap.add_argument(
        "--model",
        choices=("default", "tiny"),
        default="default",
        help="the shipped default model, or the tiny random-init test model",
    )
    ap.add_argument("--json", default=None, help="write results to this path")
    args = ap.parse_args(argv)

    if args.model == "tiny":
        model, tokenizer = tiny_model(0), None
    else:
        model, tokenizer = default_model()
    mc = model.config
    _, params = nnx.split(model)
    prompt = np.stack([encode_prompt(model, tokenizer, args.prompt_len)] * args.batch)
    runs = [
        ("all-hbm exact", 1.0, PlacementConfig(policy="static", window=16)),
        (
            f"hbm {args.hbm_fraction:.0%} exact static",
            args.hbm_fraction,
            PlacementConfig(policy="static", window=16),
        ),
        (
            f"hbm {args.hbm_fraction:.0%} exact lru",
            args.hbm_fraction,
            PlacementConfig(policy="lru", window=16),
        ),
        ("all-hbm sparse 25%", 1.0, PlacementConfig(attention="sparse", topk=0.25, window=16)),
        (
            f"hbm {args.hbm_fraction:.0%} sparse 25% lru",
            args.hbm_fraction,
            PlacementConfig(policy="lru", attention="sparse", topk=0.25, window=16),
        ),
    ]
    dev = jax.devices()[0]
    print(
        f"device: {dev.platform} {dev.device_kind}; jax {jax.__version__}; model "
        f"{mc.num_layers} layers dim {mc.dim}; prompt {args.prompt_len}, batch {args.batch}, "
        f"{args.steps} timed steps, block {args.block_size}"
    )
    results = {}
    base = {}
    for name, frac, placement in runs:
        cfg = CacheConfig.for_model(
            mc,
            batch=args.batch,
            max_len=args.prompt_len + args.steps + 8,
            block_size=args.block_size,
            hbm_capacity=frac,
        )
        dec = Decoder(model, cfg, placement, max_new_tokens=args.steps + 6, profile=args.profile)
        per_step, s = time_steps(dec, params, prompt, args.steps)
        mode = placement.attention
        if frac == 1.0:
            base[mode] = per_step
        results[name] = {
            "step_ms": 1e3 * per_step,
            "ratio_vs_all_hbm": per_step / base[mode],
            "hbm_hit_rate": s["hbm_hit_rate"],
            "migrated_blocks": s["migrated_blocks"],
            "modeled_tokens_per_s": s["modeled_tokens_per_s"],
        }
        r = results[name]
        print(
            f"  {name:<28} {r['step_ms']:8.3f} ms/step  x{r['ratio_vs_all_hbm']:.2f} vs "
            f"all-HBM ({mode})  hit {100 * r['hbm_hit_rate']:5.1f}%  "
            f"modeled {r['modeled_tokens_per_s']:,.0f} tok/s ({args.profile})"
        )
    out = {
        "device": f"{dev.platform} {dev.device_kind}",
        "jax": jax.__version__,
        "args": vars(args),
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
