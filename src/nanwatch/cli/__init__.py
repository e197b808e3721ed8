"""The `nanwatch` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]

# Modules that define `register(subparsers)`; each adds one subcommand whose handler is stored as `func`.
# Imported lazily, so `nanwatch --help` stays fast and never imports an optional framework.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "nanwatch.cli.demo",
    "nanwatch.cli.doctor",
    "nanwatch.cli.replay",
    "nanwatch.cli.show",
    "nanwatch.cli.diff",
    "nanwatch.cli.plot",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanwatch",
        description="Find where a PyTorch run goes inf/nan, and show the numbers that led there.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
