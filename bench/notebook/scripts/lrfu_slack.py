"""Lab script (2026-12-07, issue 45): lrfu with and without `slack` (admissions capped at the
promotions whose HBM writes the step's link time hides), beside the field's two best rules
(LFU with aging, W-TinyLFU) and Belady's priced schedule, replayed on the committed SmolLM2
traces in the decode loop's accounting (the cases of bench/loop_traces.py). About 3 min.

    python bench/notebook/scripts/lrfu_slack.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/

from loop_traces import CASES  # noqa: E402

from jaxkv.cost import GEOMETRIES  # noqa: E402
from jaxkv.sim import loop, loop_trace  # noqa: E402
from jaxkv.sim import trace as tr  # noqa: E402

RUNS = {
    "lfu": ("lfu", {}),
    "tinylfu": ("tinylfu", {}),
    "lrfu, no slack": ("lrfu", {"slack": False}),
    "lrfu": ("lrfu", {}),
}


def main():
    for name in ("gpl3", "doctest"):
        t = tr.load(f"bench/traces/smollm2_{name}.npz")
        for case, (_label, batch, frac, geo) in CASES.items():
            geometry = None if geo is None else GEOMETRIES[geo]
            pool = max(1, int(round(frac * t.num_blocks)))
            kw = dict(hbm_blocks=pool, steps=512, batch=batch, window=16, geometry=geometry)
            setups = {
                n: loop_trace.trace_setup(t, p, policy_kwargs=k, **kw) for n, (p, k) in RUNS.items()
            }
            rec = loop_trace.trace_record(t, setups["lfu"], 0.8)
            ms = {
                n: 1e3 * loop.replay(s, rec).summary()["modeled_seconds"] for n, s in setups.items()
            }
            ms["belady"] = 1e3 * loop.limit(setups["lfu"], rec).summary()["modeled_seconds"]
            best = min(ms["lfu"], ms["tinylfu"])
            print(
                f"{name:<8} {case:<11}",
                "  ".join(f"{n} {v:.2f} ({best / v:.4f}x)" for n, v in ms.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
