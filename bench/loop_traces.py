"""Recorded traces replayed in the decode loop's accounting (`jaxkv.sim.loop_trace`): per trace
and case, each policy's modeled decode time, as a Decoder with a tiered cache would charge it
(write-through host tier, a plan at the end of every W-th step, the in-step rule inside the
steps): the field's rules (LRU hot buffer, ARC, SLRU, LFU with aging, W-TinyLFU: every
promotion rides the step's read, as lrfu's), the live policy, the plan-every-W LRU and the
annealer, Belady's MIN with bypass priced by the cost model (the attainable limit of a
per-layer pool; `belady:shared` one pool for all layers), and the lower bounds of
`jaxkv.sim.loop.bounds`. "gap to Belady" is the share of the gap between the best field rule
and Belady's priced schedule that a policy closes (negative: slower than the best field rule;
"-" where Belady's schedule is no faster than the best rule: steps bound by HBM reads, where
its promotions' HBM writes cost more than the host reads they save); "gap to bound" the same
toward the best lower bound, which no placement beats.

Planning is not charged here (no decode runs, so there is no wall step to charge it against:
the demo and bench_decode charge it); "plan ms" is one plan's CPU time on this machine.

    python bench/loop_traces.py bench/traces/smollm2_gpl3.npz bench/traces/smollm2_doctest.npz \
        --json bench/results/loop_traces.json

A policy may carry knobs after colons: `lrfu:lookahead` is `Lrfu(lookahead=True)` (a trace's
next step is known, so layer 0's next reads are what the decode loop's lookahead would know),
`lrfu:steady_queries=256` sets a value (`jaxkv.placement.presets.LRFU_KNOBS`, `KNOBS`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import numpy as np
from _progress import tqdm  # tqdm, or a stand-in where it is missing

from jaxkv.cost import GEOMETRIES
from jaxkv.placement.policies import plans
from jaxkv.sim import loop, loop_trace
from jaxkv.sim import trace as tr

FIELD = ("lru", "arc", "slru", "lfu", "tinylfu")  # the field's rules, in the step
LIMIT = "belady"  # the attainable limit the gap is measured to
POLICIES = (
    "static",
    "lru-plan",
    *FIELD,
    "anneal",
    "anneal+reuse+follow",
    "lrfu",
    LIMIT,
    "belady:shared",
)
# (label, modeled batch, HBM pool as a fraction of the blocks, geometry: None = the trace's)
CASES = {
    "b1": ("batch 1", 1, 0.1, None),
    "b16": ("batch 16", 16, 0.1, None),
    "b16-pool30": ("batch 16, pool 30%", 16, 0.3, None),
    "paper": ("paper geometry", 1, 0.1, "paper"),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help=".npz traces recorded with `jaxkv trace`")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--sparsity", type=float, default=0.8)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--profile", default="gh200-paper")
    ap.add_argument("--host-tier", default="write-through", choices=("write-through", "exclusive"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.case_list = [c for c in args.cases.split(",") if c]
    bad = [c for c in args.case_list if c not in CASES]
    if bad:
        ap.error(f"--cases {bad}: expected some of {list(CASES)}")
    args.policy_list = [p for p in args.policies.split(",") if p]
    for p in args.policy_list:
        try:
            policy_spec(p)
        except ValueError as e:
            ap.error(f"--policies {p!r}: {e}")
    for p in args.traces:
        if not os.path.isfile(p):
            ap.error(f"trace {p!r} is not a file")
    if args.json:
        from models.record import check_writable

        check_writable(args.json, "--json")
    return args


def policy_spec(spec: str) -> tuple[str, dict]:
    """("lrfu", {"lookahead": True}) from "lrfu:lookahead"; "k=v" parses v as JSON."""
    name, *items = spec.split(":")
    knobs = {}
    for item in items:
        k, eq, v = item.partition("=")
        try:
            knobs[k] = json.loads(v) if eq else True
        except json.JSONDecodeError:
            raise ValueError(f"knob {item!r}: expected name or name=value (JSON)") from None
    return name, knobs


def run_case(trace, case: str, args) -> dict:
    label, batch, frac, geo = CASES[case]
    geometry = None if geo is None else GEOMETRIES[geo]
    steps = min(args.steps, trace.steps)
    pool = max(1, int(round(frac * trace.num_blocks)))
    kw = dict(
        hbm_blocks=pool,
        steps=steps,
        batch=batch,
        window=args.window,
        profile=args.profile,
        host_tier=args.host_tier,
        geometry=geometry,
    )
    setups = {}
    for p in args.policy_list:
        name, knobs = policy_spec(p)
        setups[p] = loop_trace.trace_setup(trace, name, policy_kwargs=knobs, **kw)
    rec = loop_trace.trace_record(trace, next(iter(setups.values())), args.sparsity)
    b = loop.bounds(next(iter(setups.values())), rec)
    tails = tail_reads(next(iter(setups.values())), rec)  # always HBM: no policy's hits
    rows = {}
    for p, s in setups.items():
        t0 = time.perf_counter()
        r = loop.replay(s, rec)
        sm = r.summary()
        rows[p] = dict(
            modeled_ms=1e3 * sm["modeled_seconds"],
            hbm_hit_rate=sm["hbm_hit_rate"],
            sealed_hits=int(np.sum(r.metrics.hbm_reads)) - tails,
            sealed_reads=int(np.sum(r.metrics.reads)) - tails,
            migrated_blocks=sm["migrated_blocks"],
            plans=r.plans,
            replay_s=time.perf_counter() - t0,
            plan_ms=1e3 * plan_seconds(s, rec) if r.plans and plans(s.policy) else 0.0,
        )
    field = {p: rows[p]["modeled_ms"] for p in FIELD if p in rows}
    best_rule = min(field, key=field.get) if field else None
    limit = rows[LIMIT]["modeled_ms"] if LIMIT in rows else None
    bound = 1e3 * b["best"]
    for r in rows.values():
        base = field.get(best_rule)
        r["vs_best_rule"] = base / r["modeled_ms"] if base else None
        gap = None if base is None or limit is None or base <= limit else base - limit
        r["gap_closed"] = (base - r["modeled_ms"]) / gap if gap else None
        # to the lower bound (no placement is faster), where Belady's schedule is not a limit
        r["bound_gap_closed"] = (base - r["modeled_ms"]) / (base - bound) if base else None
    return dict(
        trace=trace.name,
        case=case,
        label=label,
        batch=batch,
        pool_blocks=pool,
        blocks=trace.num_blocks,
        steps=steps,
        bounds_ms={k: 1e3 * b[k] for k in ("unlimited", "capacity", "cache", "best")},
        best_rule=best_rule,
        policies=rows,
    )


def tail_reads(setup, rec) -> int:
    """Reads of the record's unsealed tail blocks (served from HBM under every placement)."""
    c = setup.cache_config
    T = rec.reads.shape[0]
    lengths = np.asarray(rec.start.lengths)[None] + np.arange(T)[:, None]  # [T, B]
    sealed = np.arange(c.max_blocks)[None, None] < (lengths // c.block_size)[:, :, None]
    return int(np.sum(np.asarray(rec.reads) & ~sealed[:, None]))


def plan_seconds(setup, rec, repeats: int = 2) -> float:
    """One compiled plan's seconds at the record's start (best of `repeats`)."""
    from jaxkv.placement.observation import observe

    c, st = setup.cache_config, rec.start
    sealed = np.arange(c.max_blocks)[None] < (np.asarray(st.lengths) // c.block_size)[:, None]
    sealed = np.broadcast_to(sealed, np.shape(st.in_hbm))
    obs = observe(st.in_hbm, sealed, st.lengths, st.stats, st.step, c, None)
    fn = jax.jit(lambda p, o: setup.policy.plan(p, o, setup.env))
    pstate = setup.policy.init(c.num_layers, c.batch * c.max_blocks)
    jax.block_until_ready(fn(pstate, obs))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(pstate, obs))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = jax.devices()[0]
    print(
        f"loop_traces: {dev.platform} {dev.device_kind}, jax {jax.__version__}; s = "
        f"{args.sparsity}, {args.steps} steps, W {args.window}, {args.profile}, host tier "
        f"{args.host_tier}; modeled ms of the steps in the decode loop's accounting, planning "
        "not charged"
    )
    out = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=f"{dev.platform} {dev.device_kind}",
        jax=jax.__version__,
        args={k: v for k, v in vars(args).items()},
        cases=[],
    )
    jobs = [(path, case) for path in args.traces for case in args.case_list]
    traces = {}
    for path, case in tqdm(jobs, desc="loop_traces", file=sys.stderr):
        trace = traces.setdefault(path, tr.load(path))
        r = run_case(trace, case, args)
        out["cases"].append(r)
        tqdm.write(format_case(r), file=sys.stdout)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2, default=str)
    return 0


def format_case(r: dict) -> str:
    head = (
        f"\n{r['trace']}, {r['label']}: pool {r['pool_blocks']} of {r['blocks']} blocks per "
        f"layer, {r['steps']} steps; bounds (ms): "
        + ", ".join(f"{k} {v:.2f}" for k, v in r["bounds_ms"].items())
        + f"; best field rule: {r['best_rule']}"
    )
    lines = [
        head,
        f"{'policy':<22} {'ms':>9} {'vs best rule':>12} {'gap to Belady':>13} "
        f"{'gap to bound':>12} {'sealed-block hits':>20} {'moved':>8} {'plan ms (CPU)':>13}",
    ]
    for p, x in r["policies"].items():
        vs = f"{x['vs_best_rule']:.3f}x" if x["vs_best_rule"] else "-"
        gap = f"{100 * x['gap_closed']:.0f}%" if x["gap_closed"] is not None else "-"
        bgap = x.get("bound_gap_closed")
        bgap = f"{100 * bgap:.0f}%" if bgap is not None else "-"
        hits = f"{x['sealed_hits']:,} ({100 * x['sealed_hits'] / x['sealed_reads']:.1f}%)"
        lines.append(
            f"{p:<22} {x['modeled_ms']:9.2f} {vs:>12} {gap:>13} {bgap:>12} {hits:>20} "
            f"{x['migrated_blocks']:8d} {x['plan_ms']:13.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
