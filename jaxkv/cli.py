"""The `jaxkv` command. Each subcommand lives in the module that implements it.

A module plugs in with `add_cli(subparsers)`: it adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand module, in jaxkv.*) - imported lazily so `jaxkv --help` stays fast.
_COMMANDS = ["demo", "simulate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxkv", description="Tiered HBM + host KV cache placement for JAX decoding."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"jaxkv.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"jaxkv.{name}":
                raise
            continue
        module.add_cli(sub)
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
