"""Sensitivity of placement to every knob, set against the seed's tuning guide (issue 23, item 3).

One knob at a time around a base setting (printed), on the recency-low, recency-high, patterns
and real-like synthetic traces (`jaxkv.sim.trace`), judged by `jaxkv.sim.simulate`:
  capacity  the HBM pool, 10-90% of the KV footprint (static, lru, paper-sa[10,1.0], anneal)
  window    anneal's fixed window W (steps between plans and their lookahead, as in the seed and
            the decode loop) against the seed's adaptive `+aw` (start 50, +-10, within [20, 100])
  ec        forecast-error compensation `+ec` off / on, its threshold
            (`pricing.Compensate.threshold`, the seed's 15%) and rollback (its `rollback`, the
            seed's last 5)
  budget    migrations per layer per window (`Anneal.budget`; the decode loop's max_moves)
  chains, t0, cooling, stop   `AnnealConfig.chains`, `.t0_quantile`, `.t_final`, `.patience`
  r         paper-sa's R (`paper-sa[10,R]`) on a fast link (gh200) and a bandwidth-limited one
            (h200-pcie), against the guide's 0.7-0.9 / 0.4-0.6
Compaction is not modeled by the simulator (NOTES): skipped, and said so.

Each knob prints a markdown table (latency / Unlimited and HBM hit rate per trace) and one line
against the guide; the JSON of everything and a PNG (a panel per knob, lines per trace) go to
bench/results/sensitivity.{json,png} (`--quick`: sensitivity_quick.*).

    JAX_PLATFORMS=cpu .venv/bin/python bench/sensitivity.py              # full run, sizes printed
    JAX_PLATFORMS=cpu .venv/bin/python bench/sensitivity.py --quick      # smoke run
    JAX_PLATFORMS=cpu .venv/bin/python bench/sensitivity.py --knobs window,ec,r

Most of the time is XLA compilation: each knob value is a static field of a policy, so one
compile of the simulator's chunk; `--jobs` simulations run at once (threads).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench/ helpers, in-process too

import jax  # noqa: E402
from _progress import tqdm  # noqa: E402  (tqdm, or a stand-in where it is missing)

from jaxkv import cost  # noqa: E402
from jaxkv.config import AnnealConfig, HardwareProfile  # noqa: E402
from jaxkv.sim import simulate as sim  # noqa: E402
from jaxkv.sim import trace as tr  # noqa: E402

TRACES = ("recency-low", "recency-high", "patterns", "real-like")
TOL = 0.02  # a value within 2% of the best latency counts as level with it
SIZES = dict(prompt_len=31_299, steps=512, layers=2, block_size=16, sparsity=0.6, chunk=512)
QUICK_SIZES = dict(prompt_len=1024, steps=24, layers=1, block_size=16, sparsity=0.6, chunk=24)
STEADY_SWAP = 0.2  # a trace swapping less of its read set per step than this is "steady"
NOTES = {
    "modeled": [
        "decode steps under jaxkv.cost's model (per layer and step max(T_hbm, T_link), weights "
        "and the new token's write on the HBM side, migrations charged to their step)",
        "reads: the top (1 - s) blocks by attention mass of seeded synthetic traces",
        "anneal: the online EMA forecast, planning every W steps over a W-step lookahead "
        "(interval 0, discount 1: the seed's window and the decode loop's), 50% link reserve",
        "paper-sa: the paper's heuristic with perfect future knowledge, re-planned every step",
    ],
    "left_out": [
        "compaction: the simulator has no fragmentation (aligned blocks, fungible HBM slots); "
        "the decode loop compacts (PlacementConfig.compact_every -> jaxkv.cache.compact)",
        "the plan's own run time (not charged: time_plans=False)",
        "the seed's dialogue / code workloads: no trace here is either; best W is per trace",
        "the seed's predictor recalibration beyond +ec's blend, and its migration-queue pause",
    ],
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the sweep: what a knob changes, everything else at the base."""

    profile: str = "gh200-paper"
    pool: float = 0.4  # HBM pool blocks per layer, a fraction of the KV footprint
    window: int = 50
    chains: int = 8
    t0: float = 0.1  # AnnealConfig.t0_quantile
    cooling: float = 1e-3  # AnnealConfig.t_final
    patience: int = 20
    budget: int | None = None
    threshold: float = 0.15
    rollback: int = 5

    def anneal_config(self) -> AnnealConfig:
        return AnnealConfig(
            chains=self.chains, t0_quantile=self.t0, t_final=self.cooling, patience=self.patience
        )

    def overrides(self) -> dict:
        """`Anneal` fields `simulate` does not expose, for every anneal policy of a run
        (`simulate(policy_kwargs=)`)."""
        return dict(
            interval=0,  # plan every W steps (the window), as the seed and the decode loop do
            min_window=20,  # +aw: the seed's +-10 within [20, 100] (Anneal's own defaults)
            max_window=100,
            window_step=10,
            budget=self.budget,
            error_threshold=self.threshold,
            rollback=self.rollback,
        )


@dataclasses.dataclass(frozen=True)
class Row:
    """A table row: one policy under one setting, measured on every trace."""

    label: str  # the row's name in the table
    x: str  # its tick on the panel
    policy: str
    setting: Setting
    value: object = None  # the knob's value (JSON)
    group: str = ""  # a series of the panel (a policy or a profile); "" = the only one
    separate: bool = False  # drawn as a lone marker, not joined to the series' line
    plot: bool = True
    cells: dict | None = dataclasses.field(default=None, compare=False)  # {trace: result}


def _rows(field, full, quick_vals, policy="anneal"):
    """Rows of `policy` with the Setting `field` at each value (the quick run's or the full's)."""

    def rows(base, quick):
        out = []
        for v in quick_vals if quick else full:
            name = f"{v:g}" if isinstance(v, float) else str(v)
            name, x = (name, name) if v is not None else ("unbounded", "inf")
            out.append(Row(name, x, policy, dataclasses.replace(base, **{field: v}), v))
        return out

    return rows


def rows_capacity(base, quick):
    rows = []
    for f in (0.2, 0.4) if quick else (0.1, 0.25, 0.4, 0.6, 0.9):
        for p in ("static", "lru-plan", "paper-sa[10,1.0]", "anneal"):
            s = dataclasses.replace(base, pool=f)
            rows.append(
                Row(f"{f:.0%} {p}", f"{f:.0%}", p, s, f, p, plot=p in ("lru-plan", "anneal"))
            )
    return rows


def rows_window(base, quick):
    rows = _rows("window", (5, 10, 20, 35, 50, 80, 120), (base.window,))(base, quick)
    rows = [dataclasses.replace(r, label=f"W={r.value}") for r in rows]
    aw = dataclasses.replace(base, window=50)
    return rows + [Row(AW, "+aw", "anneal+aw", aw, "aw", separate=True)]


def rows_ec(base, quick):
    rows = [Row("off", "off", "anneal", base, "off", separate=True)]
    for th in (0.15,) if quick else (0.05, 0.15, 0.3, 0.6):
        s = dataclasses.replace(base, threshold=th)
        rows.append(Row(f"+ec {th:g}, rollback 5", f"{th:g}", "anneal+ec", s, th))
    if not quick:
        s = dataclasses.replace(base, threshold=0.15, rollback=0)
        rows.append(
            Row("+ec 0.15, rollback 0", "0.15 r0", "anneal+ec", s, "0.15/r0", separate=True)
        )
    return rows


def rows_r(base, quick):
    rows = []
    for p in ("gh200", "h200-pcie"):
        for r in (0.5, 0.8) if quick else (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
            s = dataclasses.replace(base, profile=p)
            rows.append(Row(f"{p} R={r:g}", f"{r:g}", f"paper-sa[10,{r:g}]", s, r, p))
    return rows


@dataclasses.dataclass(frozen=True)
class Knob:
    title: str
    rows: Callable  # (base Setting, quick) -> [Row]
    guide: str  # what the guide (or the seed) says
    in_guide: Callable | None = None  # (row, the trace's swap per step) -> a value it names
    versus: tuple[str, str] | None = None  # two row labels compared per trace


AW = "+aw (50, +-10, [20, 100])"
KNOBS = {
    "capacity": Knob(
        "HBM pool (fraction of the KV footprint)",
        rows_capacity,
        "no HBM size; the seed's table has Static at 62% hits",
    ),
    "window": Knob(
        "anneal window W: fixed vs adaptive (+aw)",
        rows_window,
        "W 30-50 (dialogue) / 80-120 (code), the seed's +aw",
        lambda r, sw: r.value == "aw" or 30 <= r.value <= 50 or 80 <= r.value <= 120,
        (AW, "W=50"),
    ),
    "ec": Knob(
        "forecast-error compensation (+ec): threshold, rollback",
        rows_ec,
        "roll back the last 5 migrations when the forecast is off by > 15%",
        lambda r, sw: r.value == 0.15,
        ("+ec 0.15, rollback 5", "off"),
    ),
    "budget": Knob(
        "migration budget per layer per window",
        _rows("budget", (8, 32, 64, 256, None), (None, 8)),
        "none (the decode loop's max_moves: 64)",
        versus=("64", "unbounded"),
    ),
    "chains": Knob(
        "annealing chains",
        _rows("chains", (1, 2, 8, 32), (8, 2)),
        "none (AnnealConfig: 8; the simulator's 8)",
        versus=("32", "8"),
    ),
    "t0": Knob(
        "schedule: T0 (quantile of the start's uphill move energies)",
        _rows("t0", (0.02, 0.1, 0.3, 0.6), (0.1, 0.3)),
        "the seed's 20% of the energy (~1,000 moves: no longer a setting); ours 0.1",
        lambda r, sw: r.value == 0.1,
    ),
    "cooling": Knob(
        "schedule: final temperature (fraction of T0 at max_iters)",
        _rows("cooling", (1e-4, 1e-3, 1e-2, 0.1), (1e-3, 0.1)),
        "the seed's 0.9 steady / 0.95-0.98 volatile per 100 it: 1e-3 steady / slower volatile",
        lambda r, sw: r.value == 1e-3 if sw < STEADY_SWAP else r.value >= 1e-2,
    ),
    "stop": Knob(
        "schedule: stop rule (patience, iterations gaining <= the tolerance)",
        _rows("patience", (10, 20, 30, 100), (20, 10)),
        "the seed's 30 iterations improving < 0.1%",
        lambda r, sw: r.value == 30,
    ),
    "r": Knob(
        "paper-sa's R (W=10) on a fast vs a bandwidth-limited link",
        rows_r,
        "R 0.7-0.9 on fast links (gh200), 0.4-0.6 bandwidth-limited (h200-pcie)",
        lambda r, sw: 0.7 <= r.value <= 0.9 if r.group == "gh200" else 0.4 <= r.value <= 0.6,
    ),
}
COMPACTION = (
    "compaction: not modeled by jaxkv.sim.simulate (no fragmentation: aligned blocks, fungible "
    "slots), skipped; modeled in the decode loop as PlacementConfig.compact_every "
    "(the guide's every 1,000 tokens = compact_every ~ 1000 / window windows)"
)


def _best_line(rows, traces, in_guide, stats) -> str:
    """Per trace the best row, and the gap of the guide's best value to it; then whether the
    guide agrees: a guide value within TOL of the best on every trace."""
    best, ok, spread, outside_ok = [], 0, 0.0, 0
    for kind in traces:
        rs = {r.label: r.cells[kind]["vs_unlimited"] for r in rows}
        lo = min(rs.values())
        spread = max(spread, max(rs.values()) / lo - 1)
        b = min(rs, key=rs.get)
        if in_guide is None:
            best.append(f"{kind} {b}")
            continue
        inside = [rs[r.label] for r in rows if in_guide(r, stats.get(kind, 0.0))]
        outside = [rs[r.label] for r in rows if not in_guide(r, stats.get(kind, 0.0))]
        ok += bool(inside) and min(inside) <= lo * (1 + TOL)
        outside_ok += bool(outside) and min(outside) <= lo * (1 + TOL)
        gap = f"guide {min(inside) / lo - 1:+.1%}" if inside else "no guide value run"
        best.append(f"{kind} {b} ({gap})")
    line = "best per trace: " + ", ".join(best)
    if spread < TOL:
        return line + f" -> insensitive (all within {spread:.1%})"
    if in_guide is None:
        return line + f" -> spread {spread:.1%}, no guide value"
    n = len(traces)
    word = "agrees" if ok == n else "disagrees" if ok == 0 else "partly agrees"
    also = f", values outside it as good on {outside_ok}/{n}" if outside_ok else ""
    return line + f" -> {word} ({ok}/{n} traces{also})"


def verdict(name, rows, traces, stats) -> str:
    """The knob's one line against the guide."""
    knob = KNOBS[name]
    if name == "capacity":
        return _capacity_line(rows, traces, knob.guide)
    guide = knob.guide
    if name == "cooling":
        cls = lambda k: "steady" if stats[k] < STEADY_SWAP else "volatile"
        guide += f" [{', '.join(f'{k} {cls(k)} ({stats[k]:.0%} swap)' for k in traces)}]"
    groups = list(dict.fromkeys(r.group for r in rows))
    parts = [
        (f"{g}: " if g else "")
        + _best_line([r for r in rows if r.group == g], traces, knob.in_guide, stats)
        for g in groups
    ]
    line = f"{name}: guide {guide}; " + " | ".join(parts)
    by = {r.label: r for r in rows}
    if knob.versus and all(v in by for v in knob.versus):
        a, b = (by[v] for v in knob.versus)
        d = [a.cells[k]["vs_unlimited"] / b.cells[k]["vs_unlimited"] - 1 for k in traces]
        line += f"; {a.label} vs {b.label}: " + " / ".join(f"{x:+.1%}" for x in d)
    if name == "window":
        line += f" (+aw plans: {' / '.join(str(round(by[AW].cells[k]['plans'])) for k in traces)})"
    return line


def _capacity_line(rows, traces, guide) -> str:
    static = [r for r in rows if r.policy == "static"]
    near = [min(static, key=lambda r: abs(r.cells[k]["hbm_hit_rate"] - 0.62)).value for k in traces]
    parts = []
    for pol in ("lru-plan", "paper-sa[10,1.0]", "anneal"):
        fit = []
        for kind in traces:
            ok = [r.value for r in rows if r.policy == pol and r.cells[kind]["vs_unlimited"] <= 1.1]
            fit.append(f"{min(ok):.0%}" if ok else "none")
        parts.append(f"{pol} {'/'.join(fit)}")
    return (
        f"capacity: guide {guide} (nearest here at pool {'/'.join(f'{v:.0%}' for v in near)}); "
        f"smallest pool within 10% of Unlimited: {', '.join(parts)} ({'/'.join(traces)})"
    )


def run_one(kind, setting: Setting, policies, sizes, seed) -> dict:
    """One `simulate` run of `policies` on one trace under `setting`; per-policy results."""
    trace = tr.SyntheticTrace(
        kind, sizes["prompt_len"], sizes["steps"], sizes["layers"], sizes["block_size"], seed
    )
    t = time.perf_counter()
    anneals = [p for p in policies if p.startswith("anneal")]
    res = sim.simulate(
        trace,
        [*policies, "unlimited"],
        profile=HardwareProfile.preset(setting.profile),
        geometry=cost.get_geometry("paper"),
        sparsity=sizes["sparsity"],
        capacity_blocks=max(1, round(setting.pool * trace.num_blocks)),
        chunk=min(sizes["chunk"], sizes["steps"]),
        window=setting.window,
        discount=1.0,
        anneal_config=setting.anneal_config(),
        progress=False,
        time_plans=False,
        seed=seed,
        policy_kwargs={p: setting.overrides() for p in anneals},
    )
    wall = time.perf_counter() - t
    keep = ("latency_s", "vs_unlimited", "hbm_hit_rate", "migrated_bytes", "plans")
    b = res["bounds"]
    return {
        p: {
            **{k: float(res["policies"][p][k]) for k in keep},
            "unlimited_s": b["unlimited_s"],
            "capacity_bound": b["capacity_s"] / b["unlimited_s"],
            "capacity_blocks": res["setup"]["capacity_blocks"],
            "run_wall_s": wall,
        }
        for p in policies
    }


def sweep(knobs, base, traces, sizes, args):
    """Runs every distinct (trace, setting) once with all the policies it needs; fills
    row.cells ({trace: result}) for every knob's rows, which are returned."""
    rows = {k: KNOBS[k].rows(base, args.quick) for k in knobs}
    calls: dict = {}
    for rs in rows.values():
        for r in rs:
            for kind in traces:
                calls.setdefault((kind, r.setting), set()).add(r.policy)
    done = {}
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futs = {
            pool.submit(run_one, kind, s, sorted(p), sizes, args.seed): (kind, s)
            for (kind, s), p in calls.items()
        }
        it = cf.as_completed(futs)
        if not args.quiet:
            it = tqdm(it, total=len(futs), desc="sensitivity", unit="run")
        for f in it:
            done[futs[f]] = f.result()
    out = {
        k: [
            dataclasses.replace(r, cells={t: done[(t, r.setting)][r.policy] for t in traces})
            for r in rs
        ]
        for k, rs in rows.items()
    }
    return out, len(calls)


def table(name, rows, traces) -> str:
    """The knob's markdown table: latency / Unlimited (HBM hit rate) per trace."""
    head = f"| {name} | policy | " + " | ".join(traces) + " |"
    lines = [head, "|---|---|" + "---|" * len(traces)]
    for r in rows:
        cells = " | ".join(
            f"{r.cells[k]['vs_unlimited']:.3f} ({100 * r.cells[k]['hbm_hit_rate']:.0f}%)"
            for k in traces
        )
        lines.append(f"| {r.label} | {r.policy} | {cells} |")
    return "\n".join(lines)


def plot(knobs, measured, traces, path) -> bool:
    """Small multiples: one panel per knob, x its values, y latency / Unlimited, a colour per
    trace, a line style per series (policy or profile). False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return False
    cols = min(3, len(knobs))
    nrows = math.ceil(len(knobs) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.4 * nrows), squeeze=False)
    colors = dict(zip(TRACES, ("tab:blue", "tab:red", "tab:green", "tab:purple"), strict=True))
    styles = ("-", "--", ":", "-.")
    for ax, k in zip(axes.flat, knobs, strict=False):
        rows = [r for r in measured[k] if r.plot]
        ticks = list(dict.fromkeys(r.x for r in rows))
        groups = list(dict.fromkeys(r.group for r in rows))
        for kind in traces:
            for g, style in zip(groups, styles, strict=False):
                line = [r for r in rows if r.group == g and not r.separate]
                ys = [r.cells[kind]["vs_unlimited"] for r in line]
                ax.plot(
                    [ticks.index(r.x) for r in line], ys, style, marker="o", ms=3, c=colors[kind]
                )
                for r in (r for r in rows if r.group == g and r.separate):
                    y = r.cells[kind]["vs_unlimited"]
                    ax.plot([ticks.index(r.x)], [y], "*", ms=9, color=colors[kind])
        if len(groups) > 1:
            ax.legend(
                [Line2D([], [], ls=st, c="k") for st in styles[: len(groups)]], groups, fontsize=7
            )
        ax.set_xticks(range(len(ticks)), ticks, fontsize=8)
        ys = [r.cells[t]["vs_unlimited"] for r in rows for t in traces]
        if max(ys) > 4 * min(ys):  # e.g. two links: a log scale keeps both readable
            ax.set_yscale("log")
            for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "1235" else ""))
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_title(k + ": " + KNOBS[k].title, fontsize=9)
        ax.set_ylabel("latency / Unlimited", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(knobs) :]:
        ax.axis("off")
    handles = [Line2D([], [], c=colors[t], marker="o") for t in traces]
    fig.legend(handles, traces, loc="lower center", ncol=len(traces), fontsize=8)
    fig.suptitle("latency / Unlimited per knob (lower is better; stars: lone settings)", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _fast_cpu_compile() -> None:
    """A smoke run is mostly compiles: XLA:CPU at level 0 (half the time; before any backend
    starts, an explicit XLA_FLAGS level wins, as in bench/bench_decode_bound.py)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" and "optimization_level" not in flags:
        extra = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes"
        os.environ["XLA_FLAGS"] = f"{flags} {extra}".strip()


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 2 values a knob")
    ap.add_argument("--knobs", default=",".join(KNOBS), help=f"a subset of {','.join(KNOBS)}")
    ap.add_argument("--traces", default=None, help="default: all four (--quick: recency-low)")
    for k, v in SIZES.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None)
    ap.add_argument("--jobs", type=int, default=2, help="simulations run at once (threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    knobs = [k for k in args.knobs.split(",") if k]
    bad = [k for k in knobs if k not in KNOBS]
    if bad or not knobs:
        ap.error(f"--knobs: unknown {bad or knobs}; expected some of {','.join(KNOBS)}")
    args.knobs = knobs
    traces = (args.traces or ("recency-low" if args.quick else ",".join(TRACES))).split(",")
    bad = [t for t in traces if t not in TRACES]
    if bad:
        ap.error(f"--traces: unknown {bad}; expected some of {','.join(TRACES)}")
    args.traces = traces
    given = {k: getattr(args, k) for k in SIZES if getattr(args, k) is not None}
    args.sizes = {**(QUICK_SIZES if args.quick else SIZES), **given}
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cmd = sys.argv[1:] if argv is None else list(argv)
    if args.quick:
        _fast_cpu_compile()
    sizes, traces, knobs = args.sizes, args.traces, args.knobs
    base = Setting(window=10) if args.quick else Setting()
    dev = jax.devices()[0]
    load0 = os.getloadavg()
    print(f"# sensitivity: device {dev.platform}:{dev.device_kind}, jax {jax.__version__}")
    print(f"# command: .venv/bin/python bench/sensitivity.py {' '.join(cmd)}".rstrip())
    print(f"# load average before the run: {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f}")
    print(
        f"# sizes: prompt {sizes['prompt_len']}, {sizes['steps']} steps, {sizes['layers']} "
        f"layers, block {sizes['block_size']}, s = {sizes['sparsity']:g}, paper geometry, "
        f"seed {args.seed}; traces {', '.join(traces)}"
    )
    print(
        f"# base: profile {base.profile}, pool {base.pool:.0%} of the KV footprint, anneal "
        f"(EMA forecast) W={base.window} (plans every W steps over W, discount 1), chains "
        f"{base.chains}, T0 quantile {base.t0:g}, final T {base.cooling:g} x T0, patience "
        f"{base.patience}, budget {base.budget or 'unbounded'}, +ec threshold "
        f"{base.threshold:g} rollback {base.rollback}, +aw start {base.window}, +-10 in [20, 100]"
    )
    for what, notes in NOTES.items():
        print(f"# {what.replace('_', ' ')}:")
        for n in notes:
            print(f"#   - {n}")
    stats = {}
    if "cooling" in knobs:  # steady vs volatile, by how much of the read set a step swaps
        for kind in traces:
            t = tr.SyntheticTrace(
                kind, sizes["prompt_len"], sizes["steps"], sizes["layers"], sizes["block_size"]
            )
            stats[kind] = float(tr.read_stats(t, sizes["sparsity"])["swap_per_step"])
    t0, c0 = time.perf_counter(), time.process_time()
    measured, n_runs = sweep(knobs, base, traces, sizes, args)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = report(knobs, measured, traces, stats)
    load = os.getloadavg()
    print(
        f"\n# {n_runs} simulations in {wall:.0f} s wall, {cpu:.0f} s CPU ({args.jobs} at once; "
        f"load average after: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f})"
    )
    stem = "sensitivity_quick" if args.quick else "sensitivity"
    odir = pathlib.Path(args.out_dir)
    odir.mkdir(parents=True, exist_ok=True)
    doc = dict(command=["bench/sensitivity.py", *cmd], device=f"{dev.platform}:{dev.device_kind}")
    doc.update(jax=jax.__version__, load_average_before=load0, load_average_after=load)
    doc.update(sizes=sizes, base=dataclasses.asdict(base), traces=traces, swap_per_step=stats)
    doc.update(tolerance=TOL, knobs=out, skipped={"compaction": COMPACTION}, notes=NOTES)
    doc.update(runs=n_runs, wall_s=wall, cpu_s=cpu)
    jpath = odir / f"{stem}.json"
    jpath.write_text(json.dumps(doc, indent=1))
    print(f"# wrote {jpath}")
    ppath = odir / f"{stem}.png"
    if plot(knobs, measured, traces, ppath):
        print(f"# wrote {ppath}")
    else:
        print("# no PNG: matplotlib is not installed")
    return 0


def report(knobs, measured, traces, stats) -> dict:
    """Prints each knob's table and line against the guide, then all lines; the knobs' JSON."""
    out = {}
    verdicts = []
    for k in knobs:
        rows = measured[k]
        md = table(k, rows, traces)
        line = verdict(k, rows, traces, stats)
        verdicts.append(line)
        print(f"\n### {k}: {KNOBS[k].title}\n(latency / Unlimited (HBM hit rate))\n{md}\n{line}")
        out[k] = dict(
            title=KNOBS[k].title, rows=[dataclasses.asdict(r) for r in rows], table=md, verdict=line
        )
    print("\n## Against the seed's tuning guide (tolerance: within 2% of the best counts as level)")
    for line in [*verdicts, COMPACTION]:
        print(f"- {line}")
    return out


if __name__ == "__main__":
    sys.exit(main())
