"""Lab script (bench/notebook/2026-12-07-hot-path.md): SmolLM2-135M's prefill of 16 prompts of
8,176 tokens each (the model's 8,192-token context less 16 for decoding) on this machine.

`Decoder.prefill` (the blocked forward, the cache filled, the prompt's last queries, the
first token) of 16 stdlib texts, each cut or repeated to --tokens ids, HBM 25%, sparse top 25%
(lrfu, the live policy, starts from the prompt's prior). Prints the compiled prefill's memory
(XLA's buffer assignment: temporaries, arguments, outputs), the wall time of one call after
compiling, and the process's peak resident memory.

  python bench/notebook/scripts/prefill_batch16.py [--dtype bfloat16] [--tokens 8176]
      [--compile-only]
"""

import argparse
import resource
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv import Decoder  # noqa: E402
from jaxkv.config import CacheConfig, PlacementConfig  # noqa: E402
from models.generate import load_model  # noqa: E402

MODULES = (
    "argparse", "difflib", "inspect", "typing", "dataclasses", "functools", "pathlib", "shutil",
    "subprocess", "tarfile", "zipfile/__init__", "textwrap", "logging/__init__", "json/decoder",
    "email/message", "http/client",
)  # fmt: skip


def prompts(tok, n: int) -> np.ndarray:
    lib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for m in MODULES:
        ids = np.asarray(tok.encode((lib / f"{m}.py").read_text()).ids, np.int32)
        while len(ids) < n:
            ids = np.concatenate([ids, ids])
        rows.append(ids[:n])
    return np.stack(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8176)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--policy", default="lrfu")
    ap.add_argument("--compile-only", action="store_true", help="the memory analysis alone")
    args = ap.parse_args()
    model, tok = load_model("smollm2", dtype=args.dtype)
    x = prompts(tok, args.tokens)[: args.batch]
    B, T = x.shape
    cfg = CacheConfig.for_model(
        model.config, batch=B, max_len=T + 16, block_size=16, hbm_fraction=0.25
    )
    place = PlacementConfig(policy=args.policy, attention="sparse", topk=0.25, window=16)
    dec = Decoder(model, cfg, place, max_new_tokens=16)
    params = nnx.split(model)[1]
    lengths = jnp.full((B,), T, jnp.int32)
    t0 = time.perf_counter()
    compiled = dec.prefill_fn.lower(params, x, lengths, jax.random.key(0)).compile()
    mem = compiled.memory_analysis()
    t1 = time.perf_counter()
    print(
        f"SmolLM2-135M {args.dtype}, batch {B} x {T} tokens, policy {args.policy}; jax "
        f"{jax.__version__} on {jax.devices()[0].device_kind}; compiled in {t1 - t0:.0f} s"
    )
    gb = 1e9
    print(
        f"XLA memory analysis: temp {mem.temp_size_in_bytes / gb:.2f} GB, arguments "
        f"{mem.argument_size_in_bytes / gb:.2f} GB, outputs {mem.output_size_in_bytes / gb:.2f} GB"
    )
    if args.compile_only:
        return 0
    t0 = time.perf_counter()
    state = jax.block_until_ready(compiled(params, x, lengths, jax.random.key(0)))
    t1 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB -> GB (about)
    first = np.asarray(state.tokens[:, 0]).tolist()
    print(f"prefill {t1 - t0:.1f} s; peak resident memory {peak:.2f} GB; first tokens {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
