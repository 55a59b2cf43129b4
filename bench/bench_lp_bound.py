"""The LP lower bound (jaxkv.sim.lp.bound) against the simulator's bounds and best policies.

    .venv/bin/python bench/bench_lp_bound.py                 # 4 layers, 512 steps, 952 blocks
    .venv/bin/python bench/bench_lp_bound.py --layers 1 --steps 128 --sparsities 0.6
    # the exact LP (HiGHS) per 128-step window in place of the Lagrangian dual: much slower
    .venv/bin/python bench/bench_lp_bound.py --solver highs --lp-window 128

For every trace and sparsity it runs `jaxkv.sim.simulate.simulate` (anneal-oracle, paper-sa,
unlimited by default) and `jaxkv.sim.lp.bound.lp_bound_seconds` on the same instance and prints a
markdown table of latency / Unlimited: bound@cache (Belady's fewest link crossings), the LP bound
(which counts promotions' HBM writes), and the policies.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

from jaxkv import cost
from jaxkv.cache.quant import fp8_block_bytes
from jaxkv.sim import lp as lpb
from jaxkv.sim import simulate as sim
from jaxkv.sim import sizing
from jaxkv.sim import trace as tr
from jaxkv.sim.cli import add_simulation_args, simulation_kwargs


def run(spec: str, sparsity: float, names, args) -> dict:
    """Simulates one trace and sparsity and computes its LP bound; returns both and timings."""
    trace = tr.parse_spec(
        spec if spec.endswith(".npz") else f"synthetic:{spec}",
        prompt_len=args.prompt_len,
        steps=args.steps,
        num_layers=args.layers,
        block_size=args.block_size,
        seed=args.seed,
    )
    kw = simulation_kwargs(args)
    t = time.perf_counter()
    res = sim.simulate(trace, names, sparsity=sparsity, progress=not args.quiet, **kw)
    res["wall_s"] = time.perf_counter() - t
    # the geometry, batch and pool simulate costed the trace in (jaxkv.sim.sizing)
    g = cost.batched(sizing.resolve_geometry(trace, kw["geometry"])[0], kw["batch"])
    profile, bs = kw["profile"], trace.block_size
    if args.fp8 == "host":  # the LP prices blocks at bf16 bytes over the FP8 link's bandwidth
        fp8_bytes = fp8_block_bytes(bs, g.kv_heads, g.head_dim) * g.batch
        profile = cost.link_profile(profile, g.token_bytes * bs, fp8_bytes)
    lp = lpb.lp_bound_seconds(
        trace,
        sparsity,
        geometry=g,
        profile=profile,
        capacity_blocks=res["setup"]["capacity_blocks"],
        hbm_budget=kw["hbm_budget"],
        steps=args.steps,
        solver=args.solver,
        window=args.lp_window or None,
        iters=args.iters,
        demote_cost=args.demote_cost,
        keep_fetched=args.keep_fetched,
        time_limit=args.time_limit,
        progress=not args.quiet,
    )
    return dict(simulate=res, lp=lp)


def row(spec: str, sparsity: float, out: dict, names) -> str:
    res, lp = out["simulate"], out["lp"]
    b, p = res["bounds"], res["policies"]
    unl = b["unlimited_s"]
    cache = "-" if b["cache_s"] is None else f"{b['cache_s'] / unl:.3f}"
    ok = all(s in ("optimal", "lagrangian") for s in lp["status"])
    cells = [f"{p[n]['latency_s'] / unl:.3f}" if n in p else "-" for n in names]
    return (
        f"| {spec} | {sparsity:g} | {unl:.4f} | {cache} | {lp['total_s'] / unl:.3f}"
        + ("" if ok else "*")
        + " | "
        + " | ".join(cells)
        + f" | {lp['wall_s']:.0f} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="real-like,recency-low,patterns")
    ap.add_argument("--sparsities", default="0.5,0.6,0.8")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--policies", default="anneal-oracle,paper-sa,unlimited")
    ap.add_argument("--solver", default="lagrangian", choices=lpb.SOLVERS)
    ap.add_argument(
        "--lp-window", type=int, default=0, help="steps per sub-horizon (0: the whole horizon)"
    )
    ap.add_argument("--iters", type=int, default=lpb.DEFAULT_ITERS, help="lagrangian: L-BFGS-B")
    ap.add_argument("--time-limit", type=float, default=None, help="highs: s per window LP")
    add_simulation_args(ap, geometry="paper", chunk=128)
    ap.set_defaults(layers=4, steps=512, capacity_blocks=952)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--out", default=None, help="write the full results as JSON here")
    args = ap.parse_args(argv)
    if args.fp8 == "age":  # the LP's HBM terms would price FP8 blocks at bf16 bytes
        ap.error("--fp8 age: the LP bound prices HBM blocks at full precision; use off or host")
    names = args.policies.split(",")
    shown = [n for n in names if n != "unlimited"]
    dev = jax.devices()[0]
    print(f"# lp bound: device {dev.platform}:{dev.device_kind}, jax {jax.__version__}")
    print(f"# command: .venv/bin/python bench/bench_lp_bound.py {' '.join(sys.argv[1:])}")
    horizon = f"{args.lp_window}-step windows" if args.lp_window else "whole horizon"
    print(
        f"# prompt {args.prompt_len}, {args.steps} steps, {args.layers} layers, block "
        f"{args.block_size}, pool {args.capacity_blocks} blocks, geometry {args.geometry}, "
        f"profile {args.profile}, LP bound {args.solver} ({horizon}), anneal-oracle "
        f"W={args.oracle_window} chains={args.chains}"
    )
    print(
        "# columns after 'unlimited s': latency / Unlimited; bound@cache: jaxkv.sim.bounds; LP "
        "bound: jaxkv.sim.lp.bound (* = a window LP not solved)"
    )
    print(
        "| trace | s | unlimited s | bound@cache | LP bound | "
        + " | ".join(shown)
        + " | LP wall s |"
    )
    print("|---|---|---|---|---|" + "---|" * len(shown) + "---|")
    results, sizes = [], []
    for spec in args.traces.split(","):
        for s in (float(x) for x in args.sparsities.split(",")):
            out = run(spec, s, names, args)
            results.append(dict(trace=spec, sparsity=s, **out))
            sizes.append(out["lp"]["size"])
            print(row(spec, s, out, shown), flush=True)
    big = max(sizes, key=lambda z: z["steps"] * z["blocks"])
    walls = [w for r in results for w in r["lp"]["layer_wall_s"]]
    extra = "".join(f", {big[k]} {k}" for k in ("y", "p", "d", "rows", "nonzeros") if k in big)
    print(
        f"# largest window: {big['steps']} steps x {big['blocks']} blocks read{extra}; "
        f"bound per layer {min(walls):.0f}-{max(walls):.0f} s (mean "
        f"{sum(walls) / len(walls):.0f} s)"
    )
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
