"""The paper's latency table and variation study, measured here beside its published figures.

Decode latency against sparsity (40-90%) for Static, Reactive (LRU), Page, paper-sa (the
paper's SA heuristic, its two knobs tuned with perfect knowledge), our two deployable online
policies (`anneal+reuse`: a plan between steps from the re-read law; `anneal+reuse+follow`:
what the decode loop runs), our oracle (`anneal-oracle`) and Unlimited, under the `paper`
geometry and the `gh200-paper` profile on a paper-sized synthetic trace (`real-like`, 31,299
prompt tokens, the pool of the 32-layer paper setting per layer); then the variation study:
recency-low / real-like / recency-high at 60%, normalised to Unlimited (Unlimited / latency).
The paper's published figures (docs/paper.md) are printed beside ours with our ratio to theirs, and
each online policy's ratio to the paper's oracle SA in every cell.

    JAX_PLATFORMS=cpu .venv/bin/python bench/paper_table.py   # 8 layers x 384 steps, ~10 CPU min
    JAX_PLATFORMS=cpu .venv/bin/python bench/paper_table.py --quick   # smoke run
    JAX_PLATFORMS=cpu .venv/bin/python bench/paper_table.py --with-plan   # plan time charged

`--quick` runs a 512-token prompt, 12 steps, 1 layer, 2 sparsities and the variation study:
its simulations take under a second, compiling them about 45 s of CPU (20 s with one annealer:
`--policies static,lru-plan,page,paper-sa,anneal+reuse,unlimited`, as the test runs it).

The paper ran 10,239 steps x 32 layers; the default here runs fewer (printed). Our seconds at
the paper's length are an extrapolation: the measured latency / Unlimited of the run times the
Unlimited bound of the paper's full workload (`jaxkv.cost.paper_unlimited_seconds`), labelled
"scaled". Writes bench/results/paper_table.json and .png (`--quick`: paper_table_quick.*).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench/ helpers, in-process too

import jax  # noqa: E402
from _progress import tqdm  # noqa: E402  (tqdm, or a stand-in where it is missing)
from bench_simulate import row  # noqa: E402  (its cell: latency (/ Unlimited, hit rate))

from jaxkv import cost  # noqa: E402
from jaxkv.sim import simulate as sim  # noqa: E402
from jaxkv.sim import trace as tr  # noqa: E402
from jaxkv.sim.cli import (  # noqa: E402
    DEFAULT_HBM_GB,
    add_simulation_args,
    simulation_kwargs,
)

SPARSITIES = (0.4, 0.5, 0.6, 0.8, 0.85, 0.9)
MAIN_TRACE = "real-like"  # calibrated to a recorded trace (jaxkv.sim.trace): the paper's real trace
VARIATION = ("recency-low", "real-like", "recency-high")  # the paper's low / real / high
VARIATION_S = 0.6
PAPER_COLS = ("static", "lru-plan", "page", "paper-sa", "unlimited")
ONLINE = ("anneal+reuse", "anneal+reuse+follow")
POLICIES = ("static", "lru-plan", "page", "paper-sa", *ONLINE, "anneal-oracle", "unlimited")
LABEL = {"static": "Static", "lru-plan": "Reactive", "page": "Page", "unlimited": "Unlimited"}

# docs/paper.md: decode latency (s) for 10,239 steps x 32 layers, LLaMA-3.1-8B, NarrativeQA, GH200
PAPER_LATENCY = {
    0.4: (189.70, 147.86, 95.91, 40.31, 31.91),
    0.5: (166.80, 117.07, 69.84, 34.25, 28.25),
    0.6: (140.01, 85.95, 47.73, 25.70, 24.60),
    0.8: (76.15, 31.04, 19.62, 17.35, 16.89),
    0.85: (58.19, 21.43, 16.20, 15.48, 14.86),
    0.9: (39.51, 15.72, 13.77, 13.64, 13.43),
}
PAPER_HIT_60 = {"static": 0.583, "lru-plan": 0.755, "page": 0.887, "paper-sa": 0.913}
# docs/paper.md: Unlimited / latency at 60% (Static / Reactive / Page / SA), per trace
PAPER_VARIATION = {
    "recency-low": (0.149, 0.276, 0.978, 0.986),
    "real-like": (0.176, 0.286, 0.515, 0.957),
    "recency-high": (0.201, 0.245, 0.378, 0.469),
}
PAPER_STEPS, PAPER_LAYERS = 10_239, 32

# Default sizes, so that the full run (8 cells, every policy) takes about 10 min of CPU time on
# 2 cores: about 60 s compiling the policies' simulations, then about 60 s per cell (measured:
# 10 s per cell at 2 layers x 256 steps, 40 s at 8 x 256, linear in steps and layers). Layers
# over steps: each layer draws its own recency scale, and the per-layer mix moved the ratios by
# up to 10% between 2 and 8 layers, where 512 against 2,048 steps moved them by under 2%.
DEFAULTS = dict(steps=384, layers=8, chunk=128)
QUICK = dict(
    prompt_len=512,
    steps=12,
    layers=1,
    chunk=6,
    capacity_blocks=15,
    chains=2,
    sparsities="0.6,0.9",
    sa_grid="2:0.5",  # one pair: each compiles its own simulation
)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes (docstring)")
    ap.add_argument("--sparsities", default=",".join(f"{s:g}" for s in SPARSITIES))
    ap.add_argument("--trace", default=MAIN_TRACE, help="synthetic kind of the latency table")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--no-variation", action="store_true", help="skip the variation study")
    ap.add_argument(
        "--sa-grid",
        default=":".join(",".join(f"{x:g}" for x in g) for g in sim.PAPER_SA_GRID),
        help="paper-sa's oracle grid, lookaheads W : fractions R (each pair compiles once)",
    )
    ap.add_argument(
        "--with-plan",
        action="store_true",
        help="time each policy's compiled plan on this device and report latency with the plan "
        "time charged serially (vs_unlimited_with_plan); off: planning is not charged",
    )
    ap.add_argument("--out-dir", default="bench/results", help="where the JSON and PNG go")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_simulation_args(ap, geometry="paper", chunk=DEFAULTS["chunk"])
    ap.set_defaults(steps=DEFAULTS["steps"], layers=DEFAULTS["layers"])
    args = ap.parse_args(argv)
    if args.quick:  # tiny sizes, except where an option was given
        for k, v in QUICK.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    names = args.policies.split(",")
    missing = [n for n in PAPER_COLS if n not in names]
    if missing or not any(n in names for n in ONLINE):
        raise SystemExit(
            f"paper_table: --policies={args.policies!r} lacks {missing or 'an online policy'}: "
            f"expected the paper's {list(PAPER_COLS)} and one of {list(ONLINE)}"
        )
    return args


def pool_blocks(args) -> int:
    """HBM pool blocks per layer: --capacity-blocks, else the pool of the geometry's full depth
    (32 layers for `paper`: (24 GB - 16 GB) / (32 x 16 KiB) tokens, less the tail block), so a
    run on fewer layers keeps the paper's per-layer pool."""
    if args.capacity_blocks is not None:
        return args.capacity_blocks
    geometry = cost.get_geometry(args.geometry)
    budget = (DEFAULT_HBM_GB if args.hbm_gb is None else args.hbm_gb) * 1e9
    return cost.pool_capacity(geometry, budget, geometry.num_layers, args.block_size)[1]


def sa_grid(text: str):
    """`W,W,...:R,R,...` -> (lookaheads, fractions), as `jaxkv.sim.simulate.PAPER_SA_GRID`."""
    w, r = text.split(":")
    return tuple(int(x) for x in w.split(",")), tuple(float(x) for x in r.split(","))


def cell(kind, s, names, args, paper_unlimited):
    """One simulate() run (bench_simulate.run's, with plan timing only under --with-plan: it
    compiles every policy's plan again per cell), with latency per step and scaled seconds."""
    trace = tr.SyntheticTrace(
        kind, args.prompt_len, args.steps, args.layers, args.block_size, args.seed
    )
    t, c = time.perf_counter(), time.process_time()
    res = sim.simulate(
        trace,
        names,
        sparsity=s,
        progress=False,  # one bar over the cells (simulate's own needs tqdm itself)
        time_plans=args.with_plan,
        paper_sa_grid=sa_grid(args.sa_grid),
        **simulation_kwargs(args),
    )
    res["wall_s"] = time.perf_counter() - t
    res["cpu_s"] = time.process_time() - c  # this process's CPU seconds (all threads)
    steps, layers = res["setup"]["steps"], res["setup"]["layers"]
    for v in res["policies"].values():
        v["ms_per_step"] = 1e3 * v["latency_s"] / steps  # summed over the run's layers
        v["scaled_s"] = v["vs_unlimited"] * paper_unlimited  # at the paper's length (see doc)
        v["scaled_by_steps_s"] = v["latency_s"] * PAPER_STEPS * PAPER_LAYERS / (steps * layers)
    return res


def ratio(a, b):
    """a / b, None where either is missing."""
    return a / b if a is not None and b else None


def fmt(x, spec=".3f"):
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def ordering(p: dict) -> dict:
    """The paper's order at one cell: Static > Reactive > Page > paper-sa >= Unlimited, with
    each neighbour's latency ratio (> 1 where the order holds)."""
    chain = ["static", "lru-plan", "page", "paper-sa", "unlimited"]
    pairs = []
    for a, b in zip(chain, chain[1:], strict=False):
        r = p[a]["latency_s"] / p[b]["latency_s"]
        ok = r >= 1.0 - 1e-9 if b == "unlimited" else r > 1.0
        pairs.append(dict(slower=a, faster=b, ratio=r, holds=bool(ok)))
    return dict(holds=all(x["holds"] for x in pairs), pairs=pairs)


def describe_order(o: dict) -> str:
    parts = []
    for x in o["pairs"]:
        a, b = LABEL.get(x["slower"], x["slower"]), LABEL.get(x["faster"], x["faster"])
        op = ">=" if x["faster"] == "unlimited" else ">"
        tag = "" if x["holds"] else f" FAILS: {b} is {100 * (1 / x['ratio'] - 1):.1f}% slower"
        parts.append(f"{a} {op} {b} ({x['ratio']:.3f}x{tag})")
    return ("holds: " if o["holds"] else "does not hold: ") + "; ".join(parts)


def latency_tables(rows, names, args):
    """Markdown: measured ratios; scaled seconds beside the paper's; online vs paper-sa."""
    pol = [n for n in names if n != "unlimited"] + ["unlimited"]
    steps, layers = rows[0]["result"]["setup"]["steps"], rows[0]["result"]["setup"]["layers"]
    plan = " / with the plan time charged" if args.with_plan else ""
    out = [
        "",
        f"## Measured on {args.trace}, {steps} steps x {layers} layers: latency s (latency / "
        f"Unlimited{plan}, HBM hit rate{', plan ms per step' if args.with_plan else ''})",
        "| s | " + " | ".join(pol) + " | Unlimited ms per step |",
        "|---|" + "---|" * (len(pol) + 1),
    ]
    for r in rows:
        cells = row(r["result"], pol, args.with_plan)
        ms = r["policies"]["unlimited"]["ms_per_step"]
        out.append(f"| {r['sparsity']:g} | " + " | ".join(cells) + f" | {ms:.3f} |")
    out += [
        "",
        f"## Scaled to the paper's {PAPER_STEPS:,} steps x {PAPER_LAYERS} layers: ours s / paper's "
        "s = ours / theirs",
        "(ours = measured latency / Unlimited x the paper-length Unlimited; where the paper has "
        "no column, the cell is ours s (ours / the paper's SA x SA))",
        "| s | " + " | ".join(pol) + " |",
        "|---|" + "---|" * len(pol),
    ]
    for r in rows:
        p, s = r["policies"], r["sparsity"]
        cells = []
        for n in pol:
            ours, theirs = p[n]["scaled_s"], r["paper"].get(n)
            if n in PAPER_COLS:
                cells.append(f"{ours:.2f} / {fmt(theirs, '.2f')} = {fmt(ratio(ours, theirs))}")
            else:  # no column of the paper's: against its SA
                cells.append(f"{ours:.2f} ({fmt(ratio(ours, r['paper'].get('paper-sa')))} x SA)")
        out.append(f"| {s:g} | " + " | ".join(cells) + " |")
    out += [
        "",
        "## Our online policies against the paper's oracle SA (latency ratio, < 1: ours faster)",
        "| s | "
        + " | ".join(f"{n} / paper-sa (ours) | {n} / SA (paper's, scaled)" for n in r["online"])
        + " | anneal-oracle / paper-sa (ours) |",
        "|---|" + "---|" * (2 * len(rows[0]["online"]) + 1),
    ]
    for r in rows:
        cells = []
        for n in r["online"]:
            o = r["online"][n]
            cells += [fmt(o["vs_paper_sa"]), fmt(o["vs_paper_published_sa"])]
        orc = r["policies"].get("anneal-oracle")
        sa = r["policies"]["paper-sa"]["latency_s"]
        cells.append(fmt(ratio(orc["latency_s"], sa)) if orc else "-")
        out.append(f"| {r['sparsity']:g} | " + " | ".join(cells) + " |")
    return out


def variation_table(var):
    names = list(var[0]["ours"])
    out = [
        "",
        f"## Variation study: Unlimited / latency at {VARIATION_S:.0%} (ours / paper's = ratio)",
        "| trace | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for v in var:
        cells = []
        for n in names:
            ours = v["ours"][n]
            theirs = v["paper"].get(n)
            cells.append(
                f"{ours:.3f}"
                if theirs is None
                else f"{ours:.3f} / {theirs:.3f} = {ours / theirs:.2f}"
            )
        out.append(f"| {v['trace']} | " + " | ".join(cells) + " |")
    return out


def plot(path: pathlib.Path, rows, var, names, title) -> str | None:
    """The paper's figure style: grouped bars of latency per sparsity (log scale, ours scaled,
    the paper's published values as black ticks), and the variation study's normalised bars."""
    try:
        import matplotlib
    except ImportError:  # the lent GPU machine may lack it; everything else still runs
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    pol = [n for n in names if n != "unlimited"] + ["unlimited"]
    fig, axes = plt.subplots(
        1, 2 if var else 1, figsize=(15 if var else 10, 4.8), squeeze=False,
        gridspec_kw=dict(width_ratios=[2, 1] if var else [1]),
    )  # fmt: skip
    colors = plt.get_cmap("tab10")
    ax = axes[0][0]
    w = 0.8 / len(pol)
    for j, n in enumerate(pol):
        xs = [i - 0.4 + (j + 0.5) * w for i in range(len(rows))]
        ax.bar(xs, [r["policies"][n]["scaled_s"] for r in rows], w, color=colors(j), label=n)
        paper = [(x, r["paper"][n]) for x, r in zip(xs, rows, strict=True) if n in r["paper"]]
        if paper:
            ax.scatter(*zip(*paper, strict=True), marker="_", s=120, color="k", zorder=3)
    ax.scatter([], [], marker="_", s=120, color="k", label="paper (published)")
    ax.set_yscale("log")
    for fmt_ in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        fmt_(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_title("decode latency against sparsity", fontsize=10)
    ax.set_xticks(range(len(rows)), [f"{r['sparsity']:.0%}" for r in rows])
    ax.set_xlabel("sparsity")
    ax.set_ylabel(f"decode latency, s (scaled to {PAPER_STEPS:,} steps x {PAPER_LAYERS} layers)")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    if var:
        ax = axes[0][1]
        vn = list(var[0]["ours"])
        w = 0.8 / len(vn)
        for j, n in enumerate(vn):
            xs = [i - 0.4 + (j + 0.5) * w for i in range(len(var))]
            ax.bar(xs, [v["ours"][n] for v in var], w, color=colors(pol.index(n)), label=n)
            paper = [(x, v["paper"][n]) for x, v in zip(xs, var, strict=True) if n in v["paper"]]
            if paper:
                ax.scatter(*zip(*paper, strict=True), marker="_", s=120, color="k", zorder=3)
        ax.set_xticks(range(len(var)), [v["trace"] for v in var])
        ax.set_ylabel(f"Unlimited / latency at {VARIATION_S:.0%}")
        ax.set_title("variation study (low / real-like / high)", fontsize=10)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def header(args, names, online) -> list[str]:
    """What ran, on which device, how it scales, what is modeled and what is left out."""
    dev = jax.devices()[0]
    blocks = -(-(args.prompt_len + args.steps) // args.block_size)
    return [
        f"# paper_table: device {dev.platform}:{dev.device_kind}, jax {jax.__version__}",
        f"# command: .venv/bin/python bench/paper_table.py {' '.join(args.argv)}".rstrip(),
        f"# ran: synthetic {args.trace} (variation: {', '.join(VARIATION)} at {VARIATION_S:g}), "
        f"prompt {args.prompt_len:,} tokens, {args.steps:,} decode steps x {args.layers} layers "
        f"(the paper: {PAPER_STEPS:,} x {PAPER_LAYERS}), block {args.block_size} tokens (the "
        f"paper: 1), HBM pool {args.capacity_blocks} blocks per layer of {blocks:,} at the end, "
        f"geometry {args.geometry}, profile {args.profile}, seed {args.seed}, anneal chains "
        f"{args.chains}, chunk {args.chunk}",
        "# scaled seconds = measured latency / Unlimited x the Unlimited bound of the paper's full "
        f"workload ({PAPER_STEPS:,} steps x {PAPER_LAYERS} layers, token-level reads: "
        "jaxkv.cost.paper_unlimited_seconds); the JSON also has ms_per_step (this run's layers) "
        f"and scaled_by_steps_s (latency x {PAPER_STEPS:,} / steps x {PAPER_LAYERS} / layers, "
        "which leaves out the context's growth past this run's steps)",
        "# modeled: the decode phase only, per (step, layer) max(T_hbm, T_link) with the layer's "
        "weights and the new token's write on the HBM side (PAPER.md); migrations charged to the "
        "step that makes them, a promotion riding on a host read costs the HBM write alone, "
        "demotions free (host keeps a copy). Left out: prefill (write-order placement after it), "
        "compute, the attention kernel itself, and "
        + (
            "nothing else: the plan time measured on this device is charged serially "
            "(vs_unlimited_with_plan; the follow rule's own per-step time, rule_seconds, is not)"
            if args.with_plan
            else "planning time (not charged; --with-plan charges the plan time measured here)"
        ),
        f"# policies: {', '.join(names)}; paper-sa = best of (W, R) in "
        f"{list(sa_grid(args.sa_grid)[0])} x {list(sa_grid(args.sa_grid)[1])} with perfect "
        "knowledge (the "
        "paper's oracle); online (deployable, no future knowledge): "
        f"{', '.join(online)}; anneal-oracle sees the true future",
    ]


def latency_rows(results, args, sparsities, online) -> list[dict]:
    """Per sparsity of the main trace: the policies, the paper's figures, our ratios."""
    rows = []
    for s in sparsities:
        res = results[(args.trace, s)]
        p = res["policies"]
        paper = dict(zip(PAPER_COLS, PAPER_LATENCY[s], strict=True)) if s in PAPER_LATENCY else {}
        for n, v in p.items():
            v["paper_s"] = paper.get(n)
            v["ratio_to_paper"] = ratio(v["scaled_s"], paper.get(n))
        on = {
            n: dict(
                vs_paper_sa=p[n]["latency_s"] / p["paper-sa"]["latency_s"],
                vs_paper_published_sa=ratio(p[n]["scaled_s"], paper.get("paper-sa")),
            )
            for n in online
        }
        rows.append(
            dict(sparsity=s, policies=p, paper=paper, online=on, ordering=ordering(p), result=res)
        )
    return rows


def variation_rows(results, names, kinds) -> list[dict]:
    """Per trace at VARIATION_S: Unlimited / latency per policy beside the paper's."""
    var = []
    for k in kinds:
        p = results[(k, VARIATION_S)]["policies"]
        unl = p["unlimited"]["latency_s"]
        ours = {n: unl / p[n]["latency_s"] for n in names if n != "unlimited"}
        paper = dict(zip(PAPER_COLS[:4], PAPER_VARIATION[k], strict=True))
        var.append(
            dict(
                trace=k,
                ours=ours,
                paper=paper,
                ratio_to_paper={n: ours[n] / paper[n] for n in paper},
                ordering=ordering(p),
                hbm_hit_rate={n: v["hbm_hit_rate"] for n, v in p.items()},
            )
        )
    return var


def best_online(rows, online) -> tuple[str, dict]:
    """The online policy with the lowest geometric mean of latency / paper-sa over the rows,
    and per policy that mean and the rows it is the faster one in."""
    stats = {}
    for n in online:
        logs = [math.log(r["online"][n]["vs_paper_sa"]) for r in rows]
        won = sum(
            r["online"][n]["vs_paper_sa"] <= min(r["online"][m]["vs_paper_sa"] for m in online)
            for r in rows
        )
        stats[n] = dict(geomean_vs_paper_sa=math.exp(sum(logs) / len(logs)), rows_won=won)
    return min(stats, key=lambda n: stats[n]["geomean_vs_paper_sa"]), stats


def summary(rows, var, args, best, stats) -> list[str]:
    """The ordering verdicts, the hit rates at 60% beside the paper's, the best online policy."""
    md = ["", "## The paper's ordering (Static > Reactive > Page > paper-sa >= Unlimited)"]
    first = [r for r in rows if r["sparsity"] == VARIATION_S]
    rest = [r for r in rows if r["sparsity"] != VARIATION_S]
    for r in first:
        md.append(f"- {args.trace}, s = {VARIATION_S:g} (the paper's claim): ")
        md[-1] += describe_order(r["ordering"])
    for v in var:
        if v["trace"] != args.trace:
            md.append(f"- {v['trace']}, s = {VARIATION_S:g}: " + describe_order(v["ordering"]))
    for r in rest:
        md.append(f"- {args.trace}, s = {r['sparsity']:g}: " + describe_order(r["ordering"]))
    for r in first:
        hits = ", ".join(
            f"{LABEL.get(n, n)} {100 * r['policies'][n]['hbm_hit_rate']:.1f}% "
            f"(paper {100 * h:.1f}%)"
            for n, h in PAPER_HIT_60.items()
        )
        md.append(f"- HBM hit rate at {VARIATION_S:.0%}, {args.trace}: {hits}")
    md.append(
        f"- best online policy in this table: {best} (geometric mean of latency / paper-sa over "
        f"the {len(rows)} sparsities, and rows where it is the faster online policy: "
        + ", ".join(
            f"{n} {v['geomean_vs_paper_sa']:.3f}, {v['rows_won']}" for n, v in stats.items()
        )
        + ")"
    )
    return md


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    names = args.policies.split(",")
    sparsities = [float(x) for x in args.sparsities.split(",")]
    args.capacity_blocks = pool_blocks(args)
    online = [n for n in ONLINE if n in names]
    print("\n".join(header(args, names, online)), flush=True)
    var_kinds = [] if args.no_variation else list(VARIATION)
    cells = [(args.trace, s) for s in sparsities]
    cells += [(k, VARIATION_S) for k in var_kinds if (k, VARIATION_S) not in cells]
    results = {}
    bar = cells if args.quiet else tqdm(cells, desc="paper_table cells", file=sys.stderr)
    for kind, s in bar:
        res = cell(kind, s, names, args, cost.paper_unlimited_seconds(s))
        results[(kind, s)] = res
        if not args.quiet:
            tqdm.write(
                f"  {kind} s={s:g}: {res['wall_s']:.0f} s wall, {res['cpu_s']:.0f} s CPU; "
                + ", ".join(f"{n} {v['vs_unlimited']:.3f}" for n, v in res["policies"].items()),
                file=sys.stderr,
            )
    rows = latency_rows(results, args, sparsities, online)
    var = variation_rows(results, names, var_kinds)
    best, stats = best_online(rows, online)
    md = latency_tables(rows, names, args)
    md += variation_table(var) if var else []
    md += summary(rows, var, args, best, stats)
    print("\n".join(md))

    out_dir = pathlib.Path(args.out_dir)
    stem = "paper_table_quick" if args.quick else "paper_table"
    dev = jax.devices()[0]
    title = (
        f"{args.trace}, {args.steps} steps x {args.layers} layers scaled to {PAPER_STEPS:,} x "
        f"{PAPER_LAYERS}; pool {args.capacity_blocks} blocks of {args.block_size}; "
        f"{args.geometry}, {args.profile}; {dev.platform}, jax {jax.__version__}; black ticks: "
        "the paper's figures"
    )
    fig = plot(out_dir / f"{stem}.png", rows, var, names, title)
    print(f"# figure: {fig}" if fig else "# figure: skipped, matplotlib is not installed")
    wall = time.perf_counter() - t_start
    doc = dict(
        args=vars(args),
        device=f"{dev.platform}:{dev.device_kind}",
        jax=jax.__version__,
        setup=dict(
            trace=args.trace,
            prompt_len=args.prompt_len,
            steps=args.steps,
            layers=args.layers,
            block_size=args.block_size,
            capacity_blocks=args.capacity_blocks,
            geometry=args.geometry,
            profile=args.profile,
            paper_steps=PAPER_STEPS,
            paper_layers=PAPER_LAYERS,
            planning_charged=bool(args.with_plan),
        ),
        online=online,
        best_online=best,
        online_stats=stats,
        latency=[
            {k: v for k, v in r.items() if k != "result"}
            | {k: r["result"][k] for k in ("bounds", "setup", "wall_s", "cpu_s")}
            for r in rows
        ],
        variation=var,
        wall_s=wall,
        figure=fig,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(f"# wrote {path}; wall {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
