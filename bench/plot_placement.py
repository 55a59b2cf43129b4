"""Figure of the placement tables: latency / Unlimited per policy, one panel per trace.

Reads one or more JSON files written by `bench/bench_simulate.py beyond|paper-shape ... --out F`
and merges their cells (trace, block size, sparsity). A policy measured in a later file replaces
the same policy from an earlier one, so a table and a rerun of one of its columns make one
figure; files whose runs differ in anything but the policies (steps, layers, pool, profile,
geometry, prompt, keep-fetched, demotion cost) are refused, since their ratios do not compare.

Each panel: one group of bars per sparsity, one bar per policy (latency / Unlimited; a log
scale above, the band up to --zoom below), the cell's lower bound (the larger of bound@capacity
and bound@cache, `jaxkv.sim.bounds`) as a black tick over the group, and the 1.03 / 1.10 lines of
issue 3's targets. The merged table is printed as markdown (best policy of a row in bold), so
the figure's numbers can be read.

    .venv/bin/python bench/plot_placement.py \
        bench/results/placement_beyond_4l_2048_v8_cpu.json \
        bench/results/beyond_spread_2048.json --out bench/results/placement_beyond.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# what two runs must share for their latency / Unlimited ratios to compare
SETUP_KEYS = (
    "steps",
    "prompt_len",
    "layers",
    "capacity_blocks",
    "profile",
    "geometry",
    "demote_cost",
    "keep_fetched",
)


def load(paths: list[Path]) -> tuple[dict, dict, list[str]]:
    """Merges the runs: ({(trace, block, sparsity): {"policies": {name: ratio}, "bound": x}},
    the shared setup, policy names in first-seen order). Raises ValueError naming the file and
    field on malformed input or on runs that do not compare."""
    cells: dict = {}
    setup: dict | None = None
    names: list[str] = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            msg = f"{path}: no such file (expected a bench_simulate.py --out JSON)"
            raise ValueError(msg) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
            raise ValueError(f"{path}: expected a 'results' list (bench_simulate.py --out JSON)")
        for i, cell in enumerate(doc["results"]):
            where = f"{path}: results[{i}]"
            for field in ("policies", "bounds", "setup"):
                if not isinstance(cell.get(field), dict):
                    raise ValueError(f"{where}: missing field {field!r}")
            st = cell["setup"]
            missing = [k for k in SETUP_KEYS + ("trace", "block_size", "sparsity") if k not in st]
            if missing:
                raise ValueError(f"{where}: setup lacks {missing}")
            mine = {k: st[k] for k in SETUP_KEYS}
            if setup is None:
                setup = mine
            elif mine != setup:
                diff = {k: (setup[k], mine[k]) for k in SETUP_KEYS if setup[k] != mine[k]}
                raise ValueError(f"{where}: its run differs from the first file's in {diff}")
            key = (st["trace"], int(st["block_size"]), float(st["sparsity"]))
            b = cell["bounds"]
            unl = b.get("unlimited_s")
            if not unl:
                raise ValueError(f"{where}: bounds lacks 'unlimited_s'")
            bound = max(b.get("capacity_s") or unl, b.get("cache_s") or unl) / unl
            slot = cells.setdefault(key, {"policies": {}, "bound": bound})
            for name, v in cell["policies"].items():
                if "vs_unlimited" not in v:
                    raise ValueError(f"{where}: policy {name!r} lacks 'vs_unlimited'")
                slot["policies"][name] = float(v["vs_unlimited"])
                if name not in names:
                    names.append(name)
    if not cells:
        raise ValueError(f"no cells in {[str(p) for p in paths]}")
    return cells, setup, names


def table(cells: dict, names: list[str]) -> str:
    """Markdown: a row per cell, a column per policy, the row's best placing policy in bold."""
    placing = [n for n in names if n != "unlimited"]
    lines = [
        "| trace | block | s | " + " | ".join(placing) + " | bound |",
        "|---|---|---|" + "---|" * (len(placing) + 1),
    ]
    for (trace, block, s), c in sorted(cells.items()):
        got = {n: c["policies"][n] for n in placing if n in c["policies"]}
        best = min(got.values()) if got else None
        row = []
        for n in placing:
            v = got.get(n)
            row.append("" if v is None else f"**{v:.3f}**" if v == best else f"{v:.3f}")
        trace = trace.removeprefix("synthetic:")
        lines.append(f"| {trace} | {block} | {s:g} | " + " | ".join(row) + f" | {c['bound']:.3f} |")
    return "\n".join(lines)


def plot(cells: dict, setup: dict, names: list[str], path: Path, zoom: float = 1.2) -> None:
    """Two rows of panels (one per trace and block size): every ratio on a log scale, then the
    band [0.99, zoom] on a linear one, where the policies near the bound differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    placing = [n for n in names if n != "unlimited"]
    panels = sorted({(t, b) for t, b, _ in cells})
    fig, axes = plt.subplots(
        2, len(panels), figsize=(5.5 * len(panels), 8.0), squeeze=False, sharey="row"
    )
    colors = plt.get_cmap("tab10" if len(placing) <= 10 else "tab20")
    top = 1.0
    for col, (trace, block) in enumerate(panels):
        sps = sorted(s for t, b, s in cells if (t, b) == (trace, block))
        width = 0.8 / max(len(placing), 1)
        for row in (0, 1):
            ax = axes[row][col]
            for j, n in enumerate(placing):
                xs, ys = [], []
                for i, s in enumerate(sps):
                    v = cells[(trace, block, s)]["policies"].get(n)
                    if v is not None:
                        xs.append(i - 0.4 + (j + 0.5) * width)
                        ys.append(v)
                        top = max(top, v)
                ax.bar(xs, [y - 1.0 for y in ys], width, bottom=1.0, color=colors(j), label=n)
            for i, s in enumerate(sps):
                bound = cells[(trace, block, s)]["bound"]
                ax.hlines(bound, i - 0.42, i + 0.42, color="k", lw=2)
            for y, style in ((1.03, ":"), (1.10, "--")):
                ax.axhline(y, color="grey", ls=style, lw=0.8)
            ax.set_xticks(np.arange(len(sps)), [f"s = {s:g}" for s in sps])
        axes[0][col].set_title(f"{trace.removeprefix('synthetic:')}, block {block}")
        axes[0][col].set_yscale("log")
        for fmt in (axes[0][col].yaxis.set_major_formatter, axes[0][col].yaxis.set_minor_formatter):
            fmt(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[0][0].set_ylim(0.98, top * 1.1)
    axes[1][0].set_ylim(0.99, zoom)
    axes[0][0].set_ylabel("latency / Unlimited (log)")
    axes[1][0].set_ylabel(f"latency / Unlimited, up to {zoom:g}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(placing), 6), fontsize=8)
    fig.suptitle(
        f"{setup['steps']} steps, {setup['layers']} layers, pool {setup['capacity_blocks']} "
        f"blocks, {setup['profile']}, geometry {setup['geometry']}; black: the cell's lower "
        "bound; grey: 1.03 (dotted), 1.10 (dashed)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description="Plot bench_simulate.py tables (latency / Unlimited).")
    p.add_argument("json", nargs="+", type=Path, help="bench_simulate.py --out files, merged")
    p.add_argument("--policies", default=None, help="comma list: which policies, in this order")
    p.add_argument("--out", type=Path, default=Path("bench/results/placement.png"))
    p.add_argument("--zoom", type=float, default=1.2, help="top of the lower row's linear band")
    args = p.parse_args(argv)
    cells, setup, names = load(args.json)
    if args.policies:
        want = args.policies.split(",")
        unknown = [n for n in want if n not in names]
        if unknown:
            raise ValueError(f"--policies {unknown} not in the files; they hold {names}")
        names = want
    md = table(cells, names)
    if not args.zoom > 1.0:
        raise ValueError(f"--zoom must be > 1, got {args.zoom}")
    plot(cells, setup, names, args.out, args.zoom)
    print(md)
    print(f"figure: {args.out}")
    return md


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"plot_placement: {e}")
