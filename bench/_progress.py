"""tqdm, or a stand-in with the same calls the benchmarks use where tqdm is not installed (the
lent GPU machine installs jaxkv without dependencies and has no network)."""

from __future__ import annotations

import sys

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - exercised only where tqdm is missing

    class tqdm:  # noqa: N801 - tqdm's own name
        """Iterates like tqdm and prints `desc: i/n` lines to stderr instead of a bar."""

        def __init__(self, iterable=None, desc="", file=None, total=None, **_):
            self.iterable, self.desc, self.file = iterable, desc, file or sys.stderr
            self.total = total if total is not None else len(iterable or ())

        def __iter__(self):
            for i, x in enumerate(self.iterable):
                print(f"{self.desc}: {i + 1}/{self.total}", file=self.file, flush=True)
                yield x

        @staticmethod
        def write(s, file=None):
            print(s, file=file or sys.stdout, flush=True)
