"""The `jaxkv` command.

Subcommands are plugins: a module exposing `add_cli(subparsers)`, which adds its parser and sets
`func(args) -> int`. The library's own (`simulate`) are listed here; commands that need a model
(`demo`, `generate`, `trace`) live in the `models` package and register through the
`jaxkv.commands` entry-point group in pyproject.toml, so the library never imports `models`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

_BUILTIN = {"simulate": "jaxkv.sim.cli"}


def _plugins() -> dict[str, str]:
    """name -> module path of every subcommand (entry points override nothing built in)."""
    found = {ep.name: ep.value.split(":")[0] for ep in entry_points(group="jaxkv.commands")}
    return {**found, **_BUILTIN}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxkv", description="Tiered HBM + host KV cache placement for JAX decoding."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for _, module in sorted(_plugins().items()):
        importlib.import_module(module).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"jaxkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
