"""GB/s of the bulk block transfers (`jaxkv.cache.transfer`) against the DMA rate of the same run.

Moves N KV blocks (bf16, block_size 16, kv_heads 8, head_dim 128: 32 KiB a block) between a
pinned_host pool [1, slots, 16, 8, 128] and the device, both directions:

- h2d: `read_blocks(pool, rows, fetch)` (host pool -> device blocks, one operation);
- d2h: `write_blocks(pool, rows, blocks, fetch)` in a jit that donates the pool (written in
  place);

for each mechanism ("xla", "pallas") and N in 64, 128, ..., 4096, the rows a random subset of
the pool's slots (2 N slots, at least 8192 on a GPU). Each time is the median of --iters calls
after a warm-up (blocked on); GB/s is listed bytes / time, and the ratio is to the DMA rate
measured in the same run (`jax.device_put` of a 1 GiB array each way). Every case is also
checked once for correctness (the blocks read equal the pool's rows; after the writes the pool
equals a NumPy model of it).

GPU acceptance target: the best mechanism reaches >= 70% of the measured DMA rate at 2,048
blocks in each direction (a PASS / FAIL line). Off GPU both tiers are the same DRAM: small sizes
(N <= 512, 16 MiB DMA), "pallas" skipped unless --interpret (the Pallas interpreter: slow, use
tiny N), and no GPU figure is taken.

    python bench/bench_transfer.py [--json [PATH]] [--plot [PATH]] [--blocks 64,128] [--quick]
    JAX_PLATFORMS=cpu python bench/bench_transfer.py --interpret --blocks 8,16
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from _progress import tqdm  # tqdm, or a stand-in where it is missing

from jaxkv.cache.transfer import read_blocks, write_blocks
from jaxkv.config import HBM_KIND, HOST_KIND
from pallas_kernels.common import on_gpu, single_device_sharding

MECHANISMS = ("xla", "pallas")
DIRECTIONS = ("h2d", "d2h")
DEFAULT_BLOCKS = tuple(64 << i for i in range(7))  # 64 ... 4096
QUICK_BLOCKS = (64, 128, 256, 512)
INTERPRET_BLOCKS = (8, 16)
TARGET_BLOCKS, TARGET_RATIO = 2048, 0.70
GPU_MIN_SLOTS = 8192
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _sharding(kind: str):
    return single_device_sharding(jax.devices()[0], memory_kind=kind)


def median_seconds(fn, iters: int, warmup: int = 1) -> float:
    """Median seconds of fn() (fn blocks on its own result) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def dma_rates(nbytes: int, iters: int) -> tuple[dict[str, float], dict[str, float]]:
    """GB/s of moving an nbytes array host -> device and device -> host, two ways each:
    `jax.device_put` and a jitted identity whose out_shardings name the other memory kind
    (`HardwareProfile.measure`'s way). The DMA rate of a direction is the faster of the two
    (the stricter reference); the second dict holds all four."""
    dev = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), _sharding(HBM_KIND))
    host = jax.device_put(dev, _sharding(HOST_KIND), may_alias=False)
    jax.block_until_ready((dev, host))
    to_kind = {k: jax.jit(lambda a: a, out_shardings=_sharding(k)) for k in (HBM_KIND, HOST_KIND)}

    def timed(x, kind, how):
        def fn():
            if how == "device_put":
                y = jax.device_put(x, _sharding(kind), may_alias=False)
            else:
                y = to_kind[kind](x)
            y.block_until_ready()
            y.delete()

        return nbytes / median_seconds(fn, iters) / 1e9

    detail = {}
    for how in ("device_put", "jit"):
        detail[f"h2d_{how}"] = timed(host, HBM_KIND, how)
        detail[f"d2h_{how}"] = timed(dev, HOST_KIND, how)
    dev.delete()
    host.delete()
    rates = {d: max(detail[f"{d}_device_put"], detail[f"{d}_jit"]) for d in DIRECTIONS}
    return rates, detail


def _same(a, b) -> bool:
    """Bit-exact equality of two bf16 arrays."""
    return bool(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)))


class Case:
    """Compiled read / write of one mechanism over the shared host pool."""

    def __init__(self, mechanism: str):
        self.mechanism = mechanism
        self.read = jax.jit(
            lambda pool, rows: read_blocks(pool, rows, mechanism, pool_kind=HOST_KIND)
        )
        self.write = jax.jit(
            lambda pool, rows, blocks: write_blocks(
                pool, rows, blocks, mechanism, pool_kind=HOST_KIND
            ),
            donate_argnums=0,
            out_shardings=_sharding(HOST_KIND),
        )


class Bench:
    def __init__(self, slots: int, iters: int, block_shape=(16, 8, 128)):
        self.iters = iters
        self.block_shape = block_shape
        self.block_bytes = math.prod(block_shape) * 2  # bf16
        self.slots = slots
        rng = np.random.default_rng(0)
        self.rng = rng
        # the NumPy model of the pool: updated by every write, compared after each write case
        bits = rng.integers(0, 1 << 16, (1, slots, *block_shape), dtype=np.uint16)
        bits &= np.uint16(0xBFFF)  # finite values only (exponent never all ones): exact compares
        self.model = bits.view(jnp.bfloat16)
        self.pool = jax.device_put(self.model, _sharding(HOST_KIND))
        self.pool.block_until_ready()

    def rows_for(self, n: int):
        rows = self.rng.permutation(self.slots)[:n].astype(np.int32)
        return rows, jnp.asarray(rows)

    def h2d(self, case: Case, n: int):
        rows_np, rows = self.rows_for(n)
        out = case.read(self.pool, rows)
        ok = _same(out, self.model[0, rows_np])
        del out
        t = median_seconds(lambda: case.read(self.pool, rows).block_until_ready(), self.iters)
        return t, ok, []

    def d2h(self, case: Case, n: int):
        rows_np, rows = self.rows_for(n)
        bits = self.rng.integers(0, 1 << 16, (n, *self.block_shape), dtype=np.uint16)
        blocks_np = (bits & np.uint16(0xBFFF)).view(jnp.bfloat16)
        blocks = jax.device_put(blocks_np, _sharding(HBM_KIND))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.pool = case.write(self.pool, rows, blocks)
            self.pool.block_until_ready()
        notes = [str(w.message)[:200] for w in caught if "donat" in str(w.message).lower()]
        self.model[0, rows_np] = blocks_np
        ok = _same(self.pool, self.model)

        def call():
            self.pool = case.write(self.pool, rows, blocks)  # same blocks: the model still holds
            self.pool.block_until_ready()

        t = median_seconds(call, self.iters)
        return t, ok, notes


def parse_blocks(text: str) -> list[int]:
    out = [int(x) for x in text.replace(",", " ").split()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--blocks wants positive integers, got {text!r}")
    return out


def plot(path, rows, dma, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, direction in zip(axes, DIRECTIONS, strict=True):
        for mech in MECHANISMS:
            pts = [
                (r["blocks"], r["gbps"])
                for r in rows
                if r["direction"] == direction and r["mechanism"] == mech and r["gbps"]
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=mech)
        ax.axhline(dma[direction], ls="--", color="k", label=f"DMA {dma[direction]:.1f} GB/s")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["blocks"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("blocks per transfer (32 KiB each)")
        ax.set_ylabel("GB/s")
        name = "host -> device (read_blocks)" if direction == "h2d" else "device -> host"
        ax.set_title(name if direction == "h2d" else name + " (write_blocks)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(rows, mechanisms, blocks):
    """GB/s (% of that direction's DMA rate) per blocks x (direction, mechanism)."""
    cols = [(d, m) for d in DIRECTIONS for m in mechanisms]
    print("\nsummary: GB/s (% of the DMA rate of that direction)")
    print(f"{'blocks':>6} " + " ".join(f"{d + ' ' + m:>18}" for d, m in cols))
    for n in blocks:
        cells = []
        for d, m in cols:
            r = next(
                (r for r in rows if (r["direction"], r["mechanism"], r["blocks"]) == (d, m, n)),
                None,
            )
            if r is None:
                cells.append("-")
            elif r["gbps"] is None:
                cells.append("ERROR")
            else:
                bad = "" if r["correct"] else " BAD"
                cells.append(f"{r['gbps']:.2f} ({100 * r['ratio_to_dma']:.0f}%){bad}")
        print(f"{n:>6} " + " ".join(f"{c:>18}" for c in cells))


def acceptance(rows, dma) -> tuple[bool, list[str]]:
    ok, lines = True, []
    for direction in DIRECTIONS:
        got = [
            r
            for r in rows
            if r["direction"] == direction
            and r["blocks"] == TARGET_BLOCKS
            and r["ratio_to_dma"] is not None
            and r["correct"]
        ]
        if not got:
            ok = False
            lines.append(f"{direction}: no correct measurement at {TARGET_BLOCKS} blocks")
            continue
        best = max(got, key=lambda r: r["ratio_to_dma"])
        passed = best["ratio_to_dma"] >= TARGET_RATIO
        ok &= passed
        lines.append(
            f"{direction}: best {best['mechanism']} {best['gbps']:.1f} GB/s = "
            f"{100 * best['ratio_to_dma']:.1f}% of DMA {dma[direction]:.1f} GB/s "
            f"({'>=' if passed else '<'} {100 * TARGET_RATIO:.0f}%)"
        )
    return ok, lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=parse_blocks, default=None, help="e.g. 64,128,256")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS), help="xla,pallas")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 10; CPU 5)")
    p.add_argument("--dma-mib", type=int, default=None, help="DMA probe size (1024; CPU 16)")
    p.add_argument("--quick", action="store_true", help="N <= 512, 16 MiB DMA probe")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="off GPU: also run 'pallas' in the Pallas interpreter (slow; default N 8, 16)",
    )
    p.add_argument(
        "--json", nargs="?", const=os.path.join(RESULTS, "bench_transfer.json"), default=None
    )
    p.add_argument(
        "--plot", nargs="?", const=os.path.join(RESULTS, "bench_transfer.png"), default=None
    )
    args = p.parse_args(argv)

    gpu = on_gpu()
    dev = jax.devices()[0]
    quick = args.quick or not gpu
    mechanisms = [m.strip() for m in args.mechanisms.split(",") if m.strip()]
    if bad := [m for m in mechanisms if m not in MECHANISMS]:
        p.error(f"unknown mechanism(s) {bad}; expected {MECHANISMS}")
    skipped = []
    if not gpu and not args.interpret and "pallas" in mechanisms:
        mechanisms.remove("pallas")
        skipped.append("pallas skipped off GPU (the interpreter is slow; --interpret runs it)")
    if args.blocks:
        blocks = args.blocks
    elif not gpu and args.interpret and "pallas" in mechanisms:
        blocks = list(INTERPRET_BLOCKS)
    else:
        blocks = list(QUICK_BLOCKS if quick else DEFAULT_BLOCKS)
    iters = args.iters or (10 if gpu else 5)
    dma_bytes = (args.dma_mib or (16 if quick else 1024)) << 20
    slots = max(2 * max(blocks), GPU_MIN_SLOTS if gpu else 16)

    header = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=getattr(dev, "device_kind", str(dev)),
        platform=dev.platform,
        jax=jax.__version__,
        python=platform.python_version(),
        gpu=gpu,
        command=" ".join(["python", *sys.argv]),
    )
    t_start = time.perf_counter()
    print(
        f"device {header['device']} | platform {header['platform']} | jax {header['jax']} | "
        f"GPU figure: {'yes' if gpu else 'NO'}"
    )
    if not gpu:
        print("CPU run: both tiers are the same DRAM, no GPU figure was taken")
    for s in skipped:
        print(s)
    dma, dma_detail = dma_rates(dma_bytes, iters)
    print(
        f"DMA rate ({dma_bytes >> 20} MiB array, median of {iters}, the faster of device_put / "
        f"jitted identity): h2d {dma['h2d']:.2f} GB/s, d2h {dma['d2h']:.2f} GB/s"
    )
    print(
        "  " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in dma_detail.items()) + " GB/s"
    )
    bench = Bench(slots, iters)
    print(
        f"pool: pinned_host [1, {slots}, 16, 8, 128] bf16 "
        f"({slots * bench.block_bytes / 2**20:.0f} MiB), {bench.block_bytes >> 10} KiB a block; "
        f"rows: a random subset; median of {iters} after a warm-up"
    )
    pool_bytes = slots * bench.block_bytes
    print(
        f"a whole-pool copy would take {1e3 * pool_bytes / (dma['h2d'] * 1e9):.2f} ms h2d / "
        f"{1e3 * pool_bytes / (dma['d2h'] * 1e9):.2f} ms d2h at the DMA rate: a time near that "
        "at every N means the mechanism moves the whole pool"
    )
    line = f"{'mechanism':<9} {'dir':<4} {'blocks':>6} {'MiB':>7} {'seconds':>11} {'GB/s':>9} "
    line += f"{'of DMA':>7}  check"
    print(line)
    print("-" * len(line))

    out = dict(
        header,
        dma_gbps=dma,
        dma_detail_gbps=dma_detail,
        dma_bytes=dma_bytes,
        pool_slots=slots,
        iters=iters,
        rows=[],
    )
    cases = [(m, d, n) for n in blocks for d in DIRECTIONS for m in mechanisms]  # small N first
    compiled = {m: Case(m) for m in mechanisms}
    mismatches = 0
    for mech, direction, n in tqdm(cases, desc="bench_transfer", file=sys.stderr, leave=False):
        row = dict(mechanism=mech, direction=direction, blocks=n, block_bytes=bench.block_bytes)
        try:
            t, ok, notes = getattr(bench, direction)(compiled[mech], n)
            gbps = n * bench.block_bytes / t / 1e9
            row.update(seconds=t, gbps=gbps, ratio_to_dma=gbps / dma[direction], correct=ok)
            if notes:
                row["notes"] = notes
            msg = f"{t:11.3e} {gbps:9.2f} {100 * row['ratio_to_dma']:6.1f}%  "
            msg += "ok" if ok else "MISMATCH"
        except Exception as e:  # report, keep measuring the rest
            row.update(seconds=None, gbps=None, ratio_to_dma=None, correct=False)
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            msg = f"ERROR {row['error'][:120]}"
            if direction == "d2h" and bench.pool.is_deleted():  # donated, then failed: rebuild
                bench.pool = jax.device_put(bench.model, _sharding(HOST_KIND))
        out["rows"].append(row)
        mib = n * bench.block_bytes / 2**20
        tqdm.write(f"{mech:<9} {direction:<4} {n:>6} {mib:>7.1f} {msg}", file=sys.stdout)
        for note in row.get("notes", []):
            tqdm.write(f"    WARNING (donation): {note}", file=sys.stdout)
        if not row["correct"] and "error" not in row:
            mismatches += 1
            tqdm.write(
                f"!!! MISMATCH: {mech} {direction} {n} blocks: data moved is WRONG !!!",
                file=sys.stdout,
            )
        if args.json:  # after every case, so a run cut short still leaves its rows
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    print_summary(out["rows"], mechanisms, blocks)
    if mismatches:
        print(f"!!! {mismatches} case(s) moved wrong data (see MISMATCH above) !!!")
    else:
        print("correctness: every case moved the right data")
    if gpu:
        passed, lines = acceptance(out["rows"], dma)
        for s in lines:
            print(f"  {s}")
        verdict = "PASS" if passed else "FAIL"
        print(
            f"{verdict}: best mechanism >= {100 * TARGET_RATIO:.0f}% of the measured DMA rate "
            f"at {TARGET_BLOCKS} blocks in each direction"
        )
        out["acceptance"] = dict(passed=passed, detail=lines)
    else:
        print("no GPU: the acceptance target (>= 70% of DMA at 2048 blocks) was not evaluated")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        title = f"{header['device']} ({header['platform']}), jax {header['jax']}"
        if not gpu:
            title += " - CPU run: both tiers are the same DRAM, not a GPU figure"
        plot(args.plot, out["rows"], dma, title)
        print(f"wrote {args.plot}")
    print(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
