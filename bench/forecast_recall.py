"""How much of the next window's reads each forecaster would keep in HBM, against the oracle.

At every window boundary t0 (every W steps, after the first window) of a trace, each forecaster
scores the sealed blocks by their expected reads over the window [t0, t0 + W) from the reads
before t0 alone; the C highest-scored blocks of each layer (C = the HBM budget, a fraction of
the sealed blocks) are "in HBM". Its recall is the share of the window's block reads (step,
block pairs at sparsity s, the simulator's read rule) that land on those blocks. The oracle
chooses the C blocks read most in the window: no forecaster of a fixed set does better.

Forecasters: `ema` (jaxkv.placement.forecasts.EMA), `reuse` (jaxkv.placement.forecasts.Reuse, the
re-read law learned online), `learned` (jaxkv.sim.learned's logistic model, trained on the windows
of the OTHER traces given, or on the first half of the trace's windows when it is the only one, and
scored on the rest), `recent` (most recently read first: what LRU keeps), and the oracle.
Figures are trace statistics: no cost model, no migration.

    python bench/forecast_recall.py bench/traces/smollm2_gpl3.npz bench/traces/smollm2_code.npz \\
        --sparsity 0.8 --budget 0.25 --window 16 --json bench/results/forecast_recall.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.placement import statistics as imp
from jaxkv.sim import learned as lrn
from jaxkv.sim import trace as tr

FORECASTERS = ("ema", "reuse", "learned", "recent", "oracle")


def _windows(trace, sparsity: float, window: int):
    """Yields (t0, stats before t0, valid [L, N], reads [W, L, N] bool) for t0 = W, 2W, ..."""
    stats = imp.init_stats(trace.num_layers, trace.num_blocks)
    for t0 in range(0, trace.steps - window + 1, window):
        mass = trace.mass(t0, window)
        reads = tr.read_mask(mass, trace.prompt_len, trace.block_size, sparsity, t0)
        if t0 > 0:
            yield t0, stats, lrn.sealed_mask(trace, t0), reads
        stats = lrn._fold(stats, reads, mass, jnp.int32(t0))


def _scores(name, stats, valid, t0, window, trace, params):
    """[L, N] expected reads over the window under forecaster `name` (-inf: not placeable)."""
    step = jnp.int32(t0)
    if name == "ema":
        p = imp.ema_forecast(stats.read_ema, stats.last_read, step, valid, window)
    elif name == "reuse":
        p = imp.reuse_forecast(
            stats.since_seen,
            stats.since_read,
            stats.last_read,
            step,
            valid,
            window,
            read_ema=stats.read_ema,
            streak=stats.streak,
        )
    elif name == "learned":
        f = lrn.features(stats, step, valid, trace.prompt_len, trace.block_size)
        p = lrn.learned_forecast(params, f, valid, window)
    elif name == "recent":
        p = stats.last_read.astype(jnp.float32)[None]
    else:
        raise ValueError(f"forecaster {name!r}: expected one of {FORECASTERS}")
    return jnp.where(valid, jnp.sum(p, axis=0), -jnp.inf)


def _recall(scores, counts, valid, budget: float):
    """(reads served by each layer's top-C blocks by `scores`, all reads) over valid blocks."""
    sealed = int(np.asarray(valid[0]).sum())
    c = max(1, int(round(budget * sealed)))
    _, top = jax.lax.top_k(scores, c)  # [L, C]
    served = jnp.take_along_axis(jnp.where(valid, counts, 0.0), top, axis=1).sum()
    return float(served), float(jnp.where(valid, counts, 0.0).sum())


def _train(traces, sparsity, window):
    xs, ys = zip(*(lrn.collect_examples(t, sparsity, window) for t in traces), strict=True)
    return lrn.train_learned(np.concatenate(xs), np.concatenate(ys))


def recall_table(traces: dict, *, sparsity: float, budget: float, window: int) -> dict:
    """{trace name: {forecaster: recall, ..., "oracle": recall, "windows": n}}."""
    out = {}
    for name, trace in traces.items():
        others = [t for n, t in traces.items() if n != name]
        wins = list(_windows(trace, sparsity, window))
        if not wins:
            raise ValueError(
                f"trace {name!r} has {trace.steps} steps: expected at least {2 * window}"
            )
        first = 0
        if others:
            params = _train(others, sparsity, window)
            trained_on = "the other traces"
        else:  # train on the first half of the windows, score the rest
            first = len(wins) // 2
            x, y = lrn.collect_examples(trace, sparsity, window, max_steps=(first + 1) * window)
            params = lrn.train_learned(x, y)
            trained_on = f"this trace's first {first + 1} windows"
        served = {f: 0.0 for f in FORECASTERS}
        total = 0.0
        for t0, stats, valid, reads in wins[first:]:
            counts = jnp.sum(reads.astype(jnp.float32), axis=0)  # [L, N]
            for f in FORECASTERS:
                s = (
                    jnp.where(valid, counts, -jnp.inf)
                    if f == "oracle"
                    else _scores(f, stats, valid, t0, window, trace, params)
                )
                got, all_reads = _recall(s, counts, valid, budget)
                served[f] += got
            total += all_reads
        row = {f: served[f] / max(total, 1.0) for f in FORECASTERS}
        row.update(windows=len(wins) - first, learned_trained_on=trained_on)
        out[name] = row
    return out


def format_table(table: dict, args) -> str:
    head = (
        f"forecast recall: share of the next window's reads on each layer's top {args.budget:.0%} "
        f"of sealed blocks; sparsity {args.sparsity}, window {args.window}; jax {jax.__version__} "
        f"on {jax.devices()[0].device_kind}"
    )
    cols = FORECASTERS
    lines = [head, "", "trace".ljust(32) + "".join(f"{c:>10}" for c in cols) + "  /oracle (reuse)"]
    for name, r in table.items():
        ratio = r["reuse"] / r["oracle"] if r["oracle"] else float("nan")
        lines.append(
            name[:31].ljust(32) + "".join(f"{r[c]:>10.1%}" for c in cols) + f"  {ratio:>8.3f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help=".npz traces or synthetic:KIND")
    p.add_argument("--sparsity", type=float, default=0.8)
    p.add_argument("--budget", type=float, default=0.25, help="HBM blocks, share of sealed")
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--steps", type=int, default=512, help="synthetic traces only")
    p.add_argument("--prompt-len", type=int, default=2048, help="synthetic traces only")
    p.add_argument("--layers", type=int, default=4, help="synthetic traces only")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not 0.0 <= args.sparsity < 1.0:
        p.error(f"--sparsity={args.sparsity}: expected a number in [0, 1)")
    if not 0.0 < args.budget < 1.0:
        p.error(f"--budget={args.budget}: expected a fraction in (0, 1)")
    if args.window < 1:
        p.error(f"--window={args.window}: expected an integer >= 1")
    traces = {}
    for spec in args.traces:
        if not spec.startswith("synthetic:") and not Path(spec).is_file():
            p.error(f"{spec!r}: not a file (expected a .npz trace or synthetic:KIND)")
        t = tr.parse_spec(
            spec,
            prompt_len=args.prompt_len,
            steps=args.steps,
            num_layers=args.layers,
            block_size=16,
        )
        # keyed by the file (two traces of one text by two models share a name)
        key = spec if spec.startswith("synthetic:") else Path(spec).name
        if key in traces:
            p.error(f"{spec!r}: given twice")
        traces[key] = t
    table = recall_table(traces, sparsity=args.sparsity, budget=args.budget, window=args.window)
    print(format_table(table, args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "recall": table}, indent=2
            )
        )
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
