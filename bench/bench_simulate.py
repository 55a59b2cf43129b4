"""Placement tables (issue 3): the paper's shape and the beyond-the-paper comparison.

    # the paper's shape: Static > Reactive > Page > paper-sa >= Unlimited at 60% sparsity
    .venv/bin/python bench/bench_simulate.py paper-shape --block-sizes 16,1
    # beyond the paper: every trace x sparsity, ours against the paper's policies
    .venv/bin/python bench/bench_simulate.py beyond --layers 8 --steps 1024

Both print markdown tables (latency s, speedup vs Static, latency / Unlimited, HBM hit rate) and
write the full results as JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

from jaxkv.sim import simulate as sim
from jaxkv.sim import trace as tr
from jaxkv.sim.cli import add_simulation_args, simulation_kwargs

PAPER = ["static", "lru-plan", "page", "paper-sa", "unlimited"]
OURS = [
    "static",
    "lru-plan",
    "page",
    "paper-sa",
    "anneal",
    "anneal+aw",
    "anneal+ec",
    "anneal+aw+ec",
    "anneal+reuse",
    "anneal+reuse+now",
    "anneal+reuse+follow",
    "anneal-oracle",
    "unlimited",
]


def run(kind, block_size, sparsity, names, args):
    trace = tr.SyntheticTrace(kind, args.prompt_len, args.steps, args.layers, block_size, args.seed)
    t = time.perf_counter()
    res = sim.simulate(
        trace, names, sparsity=sparsity, progress=not args.quiet, **simulation_kwargs(args)
    )
    res["wall_s"] = time.perf_counter() - t
    return res


def row(res, names, with_plan=False):
    p = res["policies"]
    cells = []
    for n in names:
        v = p[n]
        plan = f" / {v['vs_unlimited_with_plan']:.3f}" if with_plan else ""
        # the plan time measured here per simulated step (plan_seconds x plans / steps)
        per = f", {1e3 * v['plan_seconds'] / res['setup']['steps']:.2f} ms" if with_plan else ""
        cells.append(
            f"{v['latency_s']:.3f} ({v['vs_unlimited']:.3f}{plan}, "
            f"{100 * v['hbm_hit_rate']:.0f}%{per})"
        )
    return cells


def trace_stats(args) -> int:
    """Dynamics of traces (synthetic kinds or recorded .npz files): read-set swap per step,
    re-read within 50 steps, 16-token page fill, leavers read again within 1 / 5 steps."""
    print(f"# trace stats: prompt {args.prompt_len}, {args.steps} steps, {args.layers} layers")
    print(
        "| trace | block | s | read set swapped per step | reads re-read within 50 steps "
        "| page fill | leavers back within 1 / 5 steps |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in (args.traces or ",".join(tr.SYNTHETIC_KINDS)).split(","):
        sizes = [int(b) for b in args.block_sizes.split(",")]
        for bs in [None] if kind.endswith(".npz") else sizes:
            for s in (float(x) for x in (args.sparsities or "0.6,0.8").split(",")):
                if bs is None:
                    t = tr.load(kind)
                else:
                    t = tr.SyntheticTrace(
                        kind, args.prompt_len, args.steps, args.layers, bs, args.seed
                    )
                st = tr.read_stats(t, s, steps=args.steps)
                print(
                    f"| {kind} | {t.block_size} | {s:g} | {100 * st['swap_per_step']:.1f}% | "
                    f"{100 * st['reread_within_50']:.1f}% | {st['page_fill']:.2f} | "
                    f"{100 * st['leavers_back_1']:.0f}% / {100 * st['leavers_back_5']:.0f}% |"
                )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("table", choices=["paper-shape", "beyond", "stats"])
    ap.add_argument("--traces", default=None)
    ap.add_argument("--sparsities", default=None)
    ap.add_argument("--block-sizes", default="16")
    ap.add_argument("--policies", default=None)
    add_simulation_args(ap, geometry="paper", chunk=128)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument(
        "--with-plan",
        action="store_true",
        help="cells also show latency / Unlimited with the measured plan time charged serially",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.table == "stats":
        return trace_stats(args)
    paper = args.table == "paper-shape"
    traces = args.traces or (
        "real-like,recency-low" if paper else "recency-low,recency-high,patterns,real-like"
    )
    sparsities = args.sparsities or ("0.6" if paper else "0.4,0.5,0.6,0.8")
    names = (args.policies or ",".join(PAPER if paper else OURS)).split(",")
    dev = jax.devices()[0]
    print(f"# {args.table}: device {dev.platform}:{dev.device_kind}, jax {jax.__version__}")
    print(f"# command: .venv/bin/python bench/bench_simulate.py {' '.join(sys.argv[1:])}")
    print(
        f"# prompt {args.prompt_len}, {args.steps} steps, {args.layers} layers, geometry "
        f"{args.geometry}, batch {args.batch}, profile {args.profile}, anneal W={args.window} "
        f"interval="
        f"{args.interval} discount={args.discount} ride="
        f"{'default' if args.ride is None else args.ride} (+now W={args.now_window}, ride "
        f"{1 if args.ride is None else args.ride}, spread {args.now_spread}; oracle W="
        f"{args.oracle_window} discount={args.oracle_discount} tail={args.oracle_tail}, +dual "
        f"W={args.dual_window}; +follow W={args.follow_window} admit="
        f"{args.follow_admit or 'default'}) "
        f"chains={args.chains}"
    )
    print(
        "# cell: latency s (latency / Unlimited"
        + (" / with the plan time charged" if args.with_plan else "")
        + ", HBM hit rate"
        + (", plan ms per step: plan_seconds / steps, measured here" if args.with_plan else "")
        + ")"
    )
    print("# bound@capacity, bound@cache: the lower bounds / Unlimited (jaxkv.sim.bounds)")
    print(
        "| trace | block | s | "
        + " | ".join(names)
        + " | bound@capacity | bound@cache | sim wall s |"
    )
    print("|---|---|---|" + "---|" * (len(names) + 3))
    results = []
    for kind in traces.split(","):
        for bs in (int(b) for b in args.block_sizes.split(",")):
            for s in (float(x) for x in sparsities.split(",")):
                res = run(kind, bs, s, names, args)
                results.append(res)
                b = res["bounds"]
                capb = b["capacity_s"] / b["unlimited_s"]
                cache = "-" if b["cache_s"] is None else f"{b['cache_s'] / b['unlimited_s']:.3f}"
                sa = res["policies"].get("paper-sa", {}).get("tuned", "")
                print(
                    f"| {kind} | {bs} | {s:g} | "
                    + " | ".join(row(res, names, args.with_plan))
                    + f" | {capb:.3f} | {cache} | {res['wall_s']:.0f} |"
                    + (f" <!-- {sa} -->" if sa else ""),
                    flush=True,
                )
    out = pathlib.Path(args.out or f"bench/results/placement_{args.table}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
