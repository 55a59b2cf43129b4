"""Lab script (bench/notebook/2026-12-06-forecast-limits.md, section 5): what lrfu's adaptive
estimator costs at prefill. `Decoder.prefill` recomputes the prompt's last `steady_queries`
positions (32 without the estimator) to start lrfu's statistics. Times the real model's
prefill (SmolLM2-135M, random token ids, 2,048 tokens, batch 1 and 4) for steady_queries 0,
128 and 256: the first call (compiles) and the best of two after it, under
`jax.block_until_ready`, on this machine's default device.

  python bench/notebook/scripts/prefill_cost.py [--batches 1,4] [--tokens 2048]
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv import CacheConfig, Decoder, PlacementConfig  # noqa: E402
from models.generate import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    model, _ = load_model("smollm2")
    params = nnx.split(model)[1]
    dev = jax.devices()[0]
    print(f"prefill_cost: {dev.platform} {dev.device_kind}, jax {jax.__version__}", flush=True)
    T = args.tokens
    for B in (int(b) for b in args.batches.split(",")):
        ids = np.random.default_rng(0).integers(0, 1000, (B, T)).astype(np.int32)
        cfg = CacheConfig.for_model(
            model.config, batch=B, max_len=T + 64, block_size=16, hbm_fraction=0.1
        )
        base = None
        for n in (0, 128, 256):
            placement = PlacementConfig(policy="lrfu", attention="sparse")
            kw = {"steady_queries": n}
            dec = Decoder(model, cfg, placement, max_new_tokens=8, policy_kwargs=kw)
            t0 = time.perf_counter()
            jax.block_until_ready(dec.prefill(params, ids))
            first = time.perf_counter() - t0
            runs = []
            for _ in range(2):
                t0 = time.perf_counter()
                jax.block_until_ready(dec.prefill(params, ids))
                runs.append(time.perf_counter() - t0)
            best = min(runs)
            base = best if base is None else base
            print(
                f"batch {B} x {T} tokens, steady_queries {n:>3}: first call {first:5.1f} s, "
                f"then {best:6.2f} s ({best / base - 1:+.0%} against steady_queries 0)",
                flush=True,
            )


if __name__ == "__main__":
    main()
