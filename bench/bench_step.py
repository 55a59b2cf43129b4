"""CPU (or GPU) wall time per decode step of the tiny model at a long context, per policy and
attention mode: the fastest of several `Decoder.generate` calls of `--steps` steps each (window
steps included), after a warm-up, so one process gives a stable figure on a noisy machine.
`bench/ab_decode.sh` runs it at two revisions back to back.

    python bench/bench_step.py [--prompt-len 8192] [--steps 64] [--reps 6] [--json F]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv import Decoder
from jaxkv.config import CacheConfig, PlacementConfig
from models.tiny import tiny_model

CASES = (("static", "exact"), ("lru-plan", "exact"), ("static", "sparse"), ("lru-plan", "sparse"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--hbm-fraction", type=float, default=0.25)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = tiny_model(0)
    _, params = nnx.split(model)
    mc = model.config
    T, n = args.prompt_len, args.steps
    dev = jax.devices()[0]
    print(
        f"device: {dev.platform} {dev.device_kind}; jax {jax.__version__}; tiny model "
        f"({mc.num_layers} layers); prompt {T}, HBM {args.hbm_fraction:.0%}, window "
        f"{args.window}; fastest of {args.reps} x {n} steps"
    )
    res = {}
    for pol, mode in CASES:
        cfg = CacheConfig.for_model(
            mc, batch=1, max_len=T + (args.reps + 1) * n + 8, hbm_fraction=args.hbm_fraction
        )
        placement = PlacementConfig(policy=pol, window=args.window, attention=mode)
        dec = Decoder(model, cfg, placement, max_new_tokens=(args.reps + 1) * n + 6)
        state = dec.prefill(params, jnp.ones((1, T), jnp.int32))
        state = jax.block_until_ready(dec.generate(params, state, until=4))
        best, done = float("inf"), 4
        for _ in range(args.reps):
            t = time.perf_counter()
            state = jax.block_until_ready(dec.generate(params, state, until=done + n))
            best, done = min(best, (time.perf_counter() - t) / n), done + n
        res[f"{pol} {mode}"] = {"step_ms": 1e3 * best}
        print(f"  {pol:<7} {mode:<7} {1e3 * best:8.3f} ms/step", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.device_kind, "jax": jax.__version__, "results": res}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
