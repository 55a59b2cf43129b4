"""The seed article's claims about attention dynamics, measured side by side on several traces.

For each trace (a recorded .npz, or synthetic:KIND) it runs bench/plot_importance.py's analysis
at one sparsity s (the read set: the top ceil((1 - s) x sealed) blocks of a layer by mass) and
prints one markdown column per trace: re-read within 50 steps, read set replaced per step, the
median swing (p95 / p5 of a block's mass), blocks swinging over 10x, the four classes, and two
figures of where the mass sits: the first block's median share of a layer's mass (an attention
sink holds a large one) and the share of a layer's blocks that holds 90% of its mass (median
over steps; the layer mean, and the first and the last layer apart).

    .venv/bin/python bench/seed_stats.py bench/traces/smollm2_gpl3.npz \\
        bench/traces/default_gpl3.npz synthetic:real-like synthetic:patterns \\
        --json bench/results/seed_stats.json

Synthetic traces get --prompt-len, --steps and --layers (default: the first recorded trace's
prompt length and steps, 4 layers).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from plot_importance import CLASSES, analyse  # noqa: E402


def concentration(trace, steps: int) -> dict:
    """Where the mass sits: block 0's median share, and the share of a layer's live blocks
    holding 90% of its mass (median over steps), per layer."""
    dense = np.asarray(trace.mass(0, steps), np.float64)  # [n, layers, N]
    total = np.maximum(dense.sum(-1, keepdims=True), 1e-30)
    share = dense / total
    live = (dense > 0).sum(-1)  # [n, layers] blocks with any mass
    srt = -np.sort(-share, axis=-1)
    need = (np.cumsum(srt, -1) < 0.9 - 1e-9).sum(-1) + 1  # blocks for 90% of the mass
    frac90 = np.median(need / np.maximum(live, 1), axis=0)  # [layers]
    return dict(
        sink_share_median=float(np.median(share[:, :, 0])),
        blocks_for_90pct=float(frac90.mean()),
        blocks_for_90pct_first_layer=float(frac90[0]),
        blocks_for_90pct_last_layer=float(frac90[-1]),
        blocks_for_90pct_by_layer=[float(x) for x in frac90],
    )


ROWS = (
    ("context (prompt tokens) x steps x layers", None),
    ("re-read within 50 steps (seed: about 60%)", "reread_within_50"),
    ("read set replaced per step", "read_set_swap_per_step"),
    ("median swing, p95 / p5 of a block's mass (seed: over 10x)", "swing_p95_p5_median"),
    ("blocks swinging > 10x", "blocks_swing_over_10x"),
    *((f"class: {c}", c) for c in CLASSES),
    ("block 0's median share of a layer's mass", "sink_share_median"),
    ("blocks holding 90% of the mass: layer mean", "blocks_for_90pct"),
    ("... first layer / last layer", "first_last"),
)


def cell(r: dict, key) -> str:
    if key is None:
        return f"{r['prompt_len']:,} x {r['steps']} x {r['layers']}"
    if key == "first_last":
        return f"{r['blocks_for_90pct_first_layer']:.1%} / {r['blocks_for_90pct_last_layer']:.1%}"
    if key == "swing_p95_p5_median":
        return f"{r[key]:.1f}x"
    v = r["class_fractions"][key] if key in CLASSES else r[key]
    return f"{v:.1%}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("traces", nargs="+", help="trace .npz files and/or synthetic:KIND")
    p.add_argument("--sparsity", type=float, default=0.8)
    p.add_argument("--steps", type=int, default=None, help="first N steps (default: all)")
    p.add_argument("--prompt-len", type=int, default=None, help="synthetic traces only")
    p.add_argument("--layers", type=int, default=4, help="synthetic traces only")
    p.add_argument("--json", type=pathlib.Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    from jaxkv.config import check_number
    from jaxkv.sim.trace import load, parse_spec

    check_number("--sparsity", args.sparsity, low=0.0, high=1.0, high_open=True)
    files = [t for t in args.traces if not t.startswith("synthetic:")]
    first = load(files[0]) if files else None
    prompt_len = args.prompt_len or (first.prompt_len if first else 2048)
    steps = args.steps or (first.steps if first else 512)
    results = []
    for spec in args.traces:
        trace = parse_spec(
            spec, prompt_len=prompt_len, steps=steps, num_layers=args.layers, block_size=16
        )
        n = min(steps, trace.steps)
        res = {k: v for k, v in analyse(trace, args.sparsity, n).items() if not k.startswith("_")}
        res.update(concentration(trace, n), spec=spec, prompt_len=int(trace.prompt_len))
        results.append(res)
        print(f"analysed {spec}", file=sys.stderr)
    print(f"Attention dynamics at sparsity {args.sparsity} (the top {1 - args.sparsity:.0%} of "
          "blocks by mass are read), blocks of 16 tokens\n")  # fmt: skip
    print("| | " + " | ".join(r["spec"].split("/")[-1] for r in results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for label, key in ROWS:
        print(f"| {label} | " + " | ".join(cell(r, key) for r in results) + " |")
    if args.json:
        args.json.write_text(json.dumps(dict(sparsity=args.sparsity, traces=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
