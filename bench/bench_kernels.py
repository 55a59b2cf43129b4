"""Benchmarks the Pallas kernels against the XLA path and the device's copy bandwidth.

On a GPU: effective bandwidth (K/V bytes the step must read / time) of `blocked_attention`
(Mosaic GPU) vs `blocked_attention_reference` (XLA) at contexts 4k / 32k / 128k, batch 1 and 8,
exact and 25%-sparse block selection, against the measured device-to-device copy bandwidth;
and `compaction` GB/s (bytes moved, read + write) vs the XLA reference.
On CPU: runs both paths through the interpreter on small shapes and says that no GPU figure
was taken (interpreter times mean nothing for performance).

    python bench/bench_kernels.py [--json OUT.json] [--contexts 4096 32768 131072] [--quick]
    python bench/bench_kernels.py --dtype float32 --contexts 32768 --batches 8 --no-compaction
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.blocked_attention import (
    BlockSizes,
    blocked_attention,
    blocked_attention_reference,
)
from pallas_kernels.compaction import compaction, compaction_moves, compaction_reference


def timeit(fn, *args, warmup=2, iters=10):
    """Median seconds per call of fn(*args) (results blocked on)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_bandwidth(nbytes, iters):
    """Device copy GB/s (read + write bytes / time) of an nbytes array."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0 + 0.0)
    t = timeit(copy, x, iters=iters)
    return 2 * x.nbytes / t / 1e9


def attention_case(
    rng, *, batch, context, q_heads, kv_heads, head_dim, block_size, sparsity, dtype
):
    max_blocks = context // block_size
    slots = batch * max_blocks
    q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim)), dtype)
    k = jax.random.normal(jax.random.key(1), (slots, block_size, kv_heads, head_dim), dtype)
    v = jax.random.normal(jax.random.key(2), (slots, block_size, kv_heads, head_dim), dtype)
    table = jnp.asarray(rng.permutation(slots).reshape(batch, max_blocks), jnp.int32)
    if sparsity < 1.0:
        mask = rng.random((batch, max_blocks)) < sparsity
        mask[:, 0] = mask[:, -1] = True  # sink and recent block
    else:
        mask = np.ones((batch, max_blocks), bool)
    lengths = jnp.full((batch,), context, jnp.int32)
    kv_bytes = int(mask.sum()) * block_size * kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize
    return (q, k, v, table, jnp.asarray(mask), lengths), kv_bytes


def bench_attention(args, on_gpu, results):
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    iters = args.iters if on_gpu else 1
    for context in args.contexts:
        for batch in args.batches:
            for sparsity in (1.0, 0.25):
                case, kv_bytes = attention_case(
                    rng,
                    batch=batch,
                    context=context,
                    q_heads=args.q_heads,
                    kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    block_size=args.block_size,
                    sparsity=sparsity,
                    dtype=dtype,
                )
                row = dict(
                    kernel="blocked_attention",
                    context=context,
                    batch=batch,
                    selected=sparsity,
                    q_heads=args.q_heads,
                    kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    block_size=args.block_size,
                    dtype=str(dtype),
                    kv_bytes=kv_bytes,
                )
                pallas = functools.partial(blocked_attention, block_sizes=args.block_sizes)
                for name, fn in (("pallas", pallas), ("xla", blocked_attention_reference)):
                    try:
                        t = timeit(fn, *case, iters=iters, warmup=2 if on_gpu else 1)
                        row[f"{name}_s"] = t
                        row[f"{name}_GBps"] = kv_bytes / t / 1e9
                    except Exception as e:  # report, keep measuring the rest
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
                results.append(row)
                print_row(row, args.copy_GBps)
                del case


def print_row(row, copy_gbps):
    def fmt(name):
        if f"{name}_error" in row:
            return f"{name}: ERROR {row[name + '_error'][:80]}"
        s = f"{name}: {row[name + '_s'] * 1e3:9.3f} ms {row[name + '_GBps']:8.1f} GB/s"
        if copy_gbps:
            s += f" ({100 * row[name + '_GBps'] / copy_gbps:5.1f}% of copy)"
        return s

    print(
        f"ctx {row['context']:>6} batch {row['batch']} sel {row['selected']:.2f} | "
        f"{fmt('pallas')} | {fmt('xla')}",
        flush=True,
    )


def sweep(args, on_gpu, results):
    """Tuning table: the kernel's BlockSizes variants on one exact 32k-context case."""
    if not on_gpu:
        print("sweep: skipped, needs a GPU (interpreter times say nothing about tuning)")
        return
    rng = np.random.default_rng(1)
    context = 32768
    for batch in args.batches:
        case, kv_bytes = attention_case(
            rng,
            batch=batch,
            context=context,
            q_heads=args.q_heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            sparsity=1.0,
            dtype=jnp.dtype(args.dtype),
        )
        for stages in (2, 4, 8):
            for step in (1, 2, 4, 8):
                if step * args.block_size > 256:
                    continue
                sizes = BlockSizes(num_stages=stages, blocks_per_step=step)
                row = dict(kernel="sweep", context=context, batch=batch, block_sizes=repr(sizes))
                try:
                    fn = functools.partial(blocked_attention, block_sizes=sizes)
                    t = timeit(fn, *case, iters=args.iters if on_gpu else 1)
                    row.update(pallas_s=t, pallas_GBps=kv_bytes / t / 1e9)
                    msg = f"{kv_bytes / t / 1e9:8.1f} GB/s"
                    if args.copy_GBps:
                        msg += f" ({100 * kv_bytes / t / 1e9 / args.copy_GBps:5.1f}% of copy)"
                except Exception as e:
                    row["pallas_error"] = f"{type(e).__name__}: {e}"[:500]
                    msg = "ERROR " + row["pallas_error"][:100]
                results.append(row)
                print(f"sweep ctx {context} batch {batch} stages {stages} step {step}: {msg}")


def bench_compaction(args, on_gpu, results):
    layers, slots = (args.compaction_layers, args.compaction_slots) if on_gpu else (2, 8)
    shape = (layers, slots, args.block_size, args.kv_heads, args.head_dim)
    pool = jax.random.normal(jax.random.key(3), shape, jnp.dtype(args.dtype))
    occupied = jnp.asarray(np.random.default_rng(4).random((layers, slots)) < 0.5)
    src, dst, num_moves, _ = compaction_moves(occupied)
    block_bytes = math.prod(shape[2:]) * pool.dtype.itemsize
    moved = 2 * int(num_moves.sum()) * block_bytes  # read + write
    row = dict(kernel="compaction", layers=layers, slots=slots, moved_bytes=moved)
    iters = args.iters if on_gpu else 1
    for name, fn in (("pallas", compaction), ("xla", compaction_reference)):
        try:
            # Each call donates its pool: time on fresh copies.
            copies = iter([jnp.array(pool) for _ in range(iters + 2)])
            t = timeit(
                lambda f=fn, c=copies: f(next(c), src, dst, num_moves), iters=iters, warmup=2
            )
            row[f"{name}_s"] = t
            row[f"{name}_GBps"] = moved / t / 1e9
            print(
                f"compaction {name}: {t * 1e3:.3f} ms, {moved / t / 1e9:.1f} GB/s moved", flush=True
            )
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"compaction {name}: ERROR {row[name + '_error'][:200]}", flush=True)
    results.append(row)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compaction-layers", type=int, default=32)
    p.add_argument("--compaction-slots", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="4k and 32k only")
    p.add_argument("--num-stages", type=int, default=None, help="BlockSizes.num_stages")
    p.add_argument("--blocks-per-step", type=int, default=None, help="BlockSizes.blocks_per_step")
    p.add_argument("--num-splits", type=int, default=None, help="BlockSizes.num_splits")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="GPU: try BlockSizes variants at 32k context, batch 1 and 8, exact; report each",
    )
    p.add_argument("--only-sweep", action="store_true", help="the sweep and nothing else")
    p.add_argument("--no-compaction", action="store_true", help="attention only")
    args = p.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0]
    header = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        jax=jax.__version__,
        python=platform.python_version(),
        backend=jax.default_backend(),
        device=getattr(device, "device_kind", str(device)),
        gpu_figures=on_gpu,
        command=" ".join(["python", *sys.argv]),
    )
    print(f"jax {header['jax']} | backend {header['backend']} | device {header['device']}")
    if on_gpu:
        args.contexts = args.contexts or ([4096, 32768] if args.quick else [4096, 32768, 131072])
        args.copy_GBps = copy_bandwidth(1 << 30, args.iters)
        print(f"device copy bandwidth (1 GiB, read + write): {args.copy_GBps:.1f} GB/s")
    else:
        print(
            "NO GPU: no GPU figure was taken. Running the Mosaic GPU interpreter on small shapes "
            "only to show the benchmark runs; its times say nothing about performance."
        )
        args.contexts = args.contexts or [64]
        args.batches = [1, 2]
        args.q_heads, args.kv_heads, args.head_dim = 8, 2, 64
        args.copy_GBps = None
    header["copy_GBps"] = args.copy_GBps
    sizes = {}
    if args.num_stages is not None:
        sizes["num_stages"] = args.num_stages
    args.block_sizes = BlockSizes(
        blocks_per_step=args.blocks_per_step, num_splits=args.num_splits, **sizes
    )
    header["block_sizes"] = repr(args.block_sizes)
    print(f"kernel {args.block_sizes}")
    results = []
    if args.sweep or args.only_sweep:
        sweep(args, on_gpu, results)
    if not args.only_sweep:
        bench_attention(args, on_gpu, results)
        if not args.no_compaction:
            bench_compaction(args, on_gpu, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header, results=results), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
