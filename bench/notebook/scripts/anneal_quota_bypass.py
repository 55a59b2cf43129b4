"""Lab script (2026-12-07, issue 47 item 4): where anneal-quota loses on the slow link. Runs
bench-serve's workload (`--profile h200-pcie`) for the all-HBM engine at 2 requests and
anneal-quota at 8 and 16, either as built (a request holding no block of a layer bypasses a
full pool until the next plan) or, with `variant`, letting such a request's miss evict the
pool's least recently read block (the rest of the rule as built). About 4 min on 2 cores.

    python bench/notebook/scripts/anneal_quota_bypass.py variant
    python bench/notebook/scripts/anneal_quota_bypass.py built
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: models/

import jax.numpy as jnp  # noqa: E402

import models.bench_serve as bs  # noqa: E402
from jaxkv.placement.policies.anneal_quota import AnnealQuotaRule  # noqa: E402
from models.bench_serve_report import format_report  # noqa: E402


def variant_quota(self, held, full):
    """The blocks the reader may hold: one more while a slot is free or while it holds none."""
    return held + ((~full) | (held == 0)).astype(jnp.int32)


def main(which: str) -> None:
    if which not in ("built", "variant"):
        raise SystemExit(f"anneal_quota_bypass.py {which!r}: expected 'built' or 'variant'")
    if which == "variant":
        AnnealQuotaRule.quota_for = variant_quota
    bs.runs_of = lambda o: [("all-hbm", 2, True), (bs.ANNEAL_QUOTA, 8, False),
                            (bs.ANNEAL_QUOTA, 16, False)]  # fmt: skip
    t0 = time.perf_counter()
    report = bs.bench_serve(bs.Options(profile="h200-pcie", quota=True), progress=False)
    report["wall_s"] = time.perf_counter() - t0
    print(f"anneal-quota, {which}:")
    print(format_report(report))
    print(f"took {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "built")
