"""The seed article's Figures 1 and 2 from an attention trace: how block importance moves.

For every prompt block (present from the first decode step on) of every layer it takes the
per-step attention mass of the trace and the read set at a sparsity s (the simulator's rule: the
top ceil((1 - s) x sealed) blocks by mass), and measures

- re-read within 50 steps: of the (step, block) reads, the fraction read again in the next 50
  steps (jaxkv.sim.trace.read_stats, the seed's "about 60%");
- swing ratio: per block, the 95th over the 5th percentile of its mass over the steps (mass
  floored at 1e-6 of a step's total), and the largest step-to-step ratio; the seed claims swings
  over 10x;
- a class per block: steady-hot (read in >= 80% of steps), late-long-tail (read in >= 30% of the
  last third of the steps and in at most half as many of the first third), intermittent-burst
  (read in 10-80% of steps in >= 2 separate runs), else cold.

Figure (one PNG, three panels): (a) mass over decode steps of the heaviest block of each class in
one layer; (b) the layer's blocks x steps mass heat map, blocks grouped by class; (c) the swing
ratio distribution over all layers. The numbers are printed (and written with --json).

    python bench/plot_importance.py bench/traces/X.npz --out bench/results/importance.png
    python bench/plot_importance.py synthetic:patterns --steps 600 --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

CLASSES = ("steady-hot", "intermittent-burst", "late-long-tail", "cold")


def _runs(mask: np.ndarray) -> np.ndarray:
    """[steps, blocks] bool -> [blocks] number of separate True runs along steps."""
    starts = mask[0].astype(np.int64) + (mask[1:] & ~mask[:-1]).sum(0)
    return starts


def classify(reads: np.ndarray) -> np.ndarray:
    """reads [steps, blocks] bool -> [blocks] class index into CLASSES."""
    steps = reads.shape[0]
    frac = reads.mean(0)
    third = max(1, steps // 3)
    early, late = reads[:third].mean(0), reads[-third:].mean(0)
    runs = _runs(reads)
    cls = np.full(reads.shape[1], CLASSES.index("cold"))
    burst = (frac >= 0.1) & (frac < 0.8) & (runs >= 2)
    cls[burst] = CLASSES.index("intermittent-burst")
    tail = (late >= 0.3) & (early <= 0.5 * late) & (frac < 0.8)
    cls[tail] = CLASSES.index("late-long-tail")
    cls[frac >= 0.8] = CLASSES.index("steady-hot")
    return cls


def swings(mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mass [steps, blocks] (shares of each step's total) -> per block (p95 / p5 ratio,
    largest step-to-step ratio), with mass floored at 1e-6."""
    m = np.maximum(mass, 1e-6)
    pct = np.percentile(m, 95, axis=0) / np.percentile(m, 5, axis=0)
    step = (
        np.exp(np.abs(np.diff(np.log(m), axis=0)).max(0)) if m.shape[0] > 1 else np.ones(m.shape[1])
    )
    return pct, step


def analyse(trace, sparsity: float, steps: int | None = None) -> dict:
    """All the figures' numbers, plus the arrays the plot needs (keys starting with '_')."""
    from jaxkv.sim.trace import read_mask, read_stats

    n = min(steps or trace.steps, trace.steps)
    dense = np.asarray(trace.mass(0, n))  # [n, layers, N]
    reads = np.asarray(read_mask(dense, trace.prompt_len, trace.block_size, sparsity, 0))
    nb = max(1, trace.prompt_len // trace.block_size)  # sealed prompt blocks: present at step 0
    total = np.maximum(dense.sum(-1, keepdims=True), 1e-30)
    share = (dense / total)[:, :, :nb]  # [n, layers, nb]
    reads = reads[:, :, :nb]
    counts = np.zeros(len(CLASSES), np.int64)
    pct_all, step_all, classes = [], [], []
    for layer in range(dense.shape[1]):
        cls = classify(reads[:, layer])
        counts += np.bincount(cls, minlength=len(CLASSES))
        pct, stp = swings(share[:, layer])
        pct_all.append(pct)
        step_all.append(stp)
        classes.append(cls)
    pct_all, step_all = np.concatenate(pct_all), np.concatenate(step_all)
    stats = read_stats(trace, sparsity, n)
    return {
        "trace": trace.name,
        "steps": int(n),
        "layers": int(dense.shape[1]),
        "prompt_blocks": int(nb),
        "block_size": int(trace.block_size),
        "sparsity": sparsity,
        "reread_within_50": stats["reread_within_50"],
        "read_set_swap_per_step": stats["swap_per_step"],
        "swing_p95_p5_median": float(np.median(pct_all)),
        "blocks_swing_over_10x": float((pct_all > 10).mean()),
        "blocks_step_to_step_over_10x": float((step_all > 10).mean()),
        "class_fractions": {c: float(counts[i] / counts.sum()) for i, c in enumerate(CLASSES)},
        "_share": share,
        "_classes": classes,
        "_swing": pct_all,
    }


def plot(res: dict, layer: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = res["_share"][:, layer]  # [steps, nb]
    cls = res["_classes"][layer]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, c in enumerate(CLASSES[:3]):
        idx = np.flatnonzero(cls == i)
        if idx.size:
            b = idx[np.argmax(share[:, idx].mean(0))]
            ax[0].plot(share[:, b], label=f"{c} (block {b})", lw=1)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("decode step")
    ax[0].set_ylabel("attention mass share")
    ax[0].set_title(f"(a) example blocks, layer {layer}")
    ax[0].legend(fontsize=8)
    order = np.argsort(cls, kind="stable")
    img = np.log10(np.maximum(share[:, order].T, 1e-6))
    ax[1].imshow(img, aspect="auto", interpolation="nearest", cmap="magma")
    edges = np.cumsum(np.bincount(cls, minlength=len(CLASSES)))[:-1]
    for e in edges:
        ax[1].axhline(e - 0.5, color="cyan", lw=0.6)
    ax[1].set_xlabel("decode step")
    ax[1].set_ylabel("prompt block (grouped: " + " / ".join(CLASSES) + ")", fontsize=7)
    ax[1].set_title("(b) log10 mass share")
    ax[2].hist(np.log10(res["_swing"]), bins=40)
    ax[2].axvline(1.0, color="red", lw=1, label="10x")
    ax[2].set_xlabel("log10 swing (p95 / p5 of a block's mass)")
    ax[2].set_ylabel("blocks (all layers)")
    ax[2].set_title(f"(c) {100 * res['blocks_swing_over_10x']:.0f}% of blocks swing > 10x")
    ax[2].legend()
    fig.suptitle(
        f"{res['trace']}: {res['steps']} steps, re-read within 50 steps "
        f"{100 * res['reread_within_50']:.0f}% at sparsity {res['sparsity']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Block-importance dynamics of an attention trace.")
    p.add_argument("trace", help="trace .npz, or synthetic:KIND")
    p.add_argument("--sparsity", type=float, default=0.8)
    p.add_argument("--steps", type=int, default=None, help="first N steps (default: all)")
    p.add_argument("--layer", type=int, default=0, help="layer shown in panels (a) and (b)")
    p.add_argument("--out", type=Path, default=Path("bench/results/importance.png"))
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--prompt-len", type=int, default=2048, help="synthetic traces only")
    p.add_argument("--layers", type=int, default=4, help="synthetic traces only")
    p.add_argument("--block-size", type=int, default=16, help="synthetic traces only")
    args = p.parse_args(argv)
    from jaxkv.sim.trace import parse_spec

    trace = parse_spec(
        args.trace,
        prompt_len=args.prompt_len,
        steps=args.steps or 600,
        num_layers=args.layers,
        block_size=args.block_size,
    )
    if not 0 <= args.layer < trace.num_layers:
        raise ValueError(f"--layer {args.layer}: expected 0 <= layer < {trace.num_layers}")
    res = analyse(trace, args.sparsity, args.steps)
    plot(res, args.layer, args.out)
    numbers = {k: v for k, v in res.items() if not k.startswith("_")}
    print(
        f"trace {numbers['trace']}: {numbers['steps']} steps x {numbers['layers']} layers, "
        f"{numbers['prompt_blocks']} prompt blocks of {numbers['block_size']} tokens, "
        f"sparsity {numbers['sparsity']}"
    )
    print(
        f"  re-read within 50 steps      {100 * numbers['reread_within_50']:.1f}%  "
        "(seed: about 60%)"
    )
    print(f"  read set replaced per step   {100 * numbers['read_set_swap_per_step']:.1f}%")
    print(f"  median swing p95/p5          {numbers['swing_p95_p5_median']:.1f}x")
    print(
        f"  blocks swinging > 10x        {100 * numbers['blocks_swing_over_10x']:.1f}%  "
        "(seed: swings over 10x)"
    )
    print(f"  step-to-step jump > 10x      {100 * numbers['blocks_step_to_step_over_10x']:.1f}%")
    print(
        "  classes: "
        + ", ".join(f"{c} {100 * f:.1f}%" for c, f in numbers["class_fractions"].items())
    )
    print(f"  figure: {args.out}")
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=1) + "\n")
    return numbers


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
