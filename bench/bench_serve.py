"""The serving benchmark as a script: runs `jaxkv bench-serve` (`models.bench_serve`, its
options and report; `jaxkv bench-serve --help`) with the arguments given, writing its JSON to
bench/results/bench_serve.json and its figure to bench/results/bench_serve.png unless --json /
--plot say otherwise.

    python bench/bench_serve.py                        # the headline, defaults
    python bench/bench_serve.py --policies lrfu,lru,lfu --multiples 2,4,8,16
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxkv import cli

RESULTS = Path(__file__).resolve().parent / "results"


def argv(args: list[str]) -> list[str]:
    """`jaxkv bench-serve`'s arguments: `args` with the default output paths added."""
    out = ["bench-serve", *args]
    given = {a.split("=")[0] for a in args}
    if "--json" not in given:
        out += ["--json", str(RESULTS / "bench_serve.json")]
    if "--plot" not in given:
        out += ["--plot", str(RESULTS / "bench_serve.png")]
    return out


if __name__ == "__main__":
    sys.exit(cli.main(argv(sys.argv[1:])))
