"""`nanwatch show FILE[:BATCH]`: a nanwatch JSON Lines file, rendered as the text nanwatch wrote beside it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nanwatch.core.jsonl import JsonlError, read_blocks

__all__ = ["register", "render"]


def render(spec: str) -> str:
    """The text of every report and traced batch in `spec` (`FILE` or `FILE:BATCH`), in file order.

    A report renders as its .txt report, byte for byte; a trace as the .txt trace, one batch after another.

    Raises:
        JsonlError: the file is not a nanwatch JSON Lines file, or holds no batch BATCH.
    """
    return "".join(block.to_text() + "\n" for block in read_blocks(spec))


def _run(args: argparse.Namespace) -> int:
    try:
        text = render(args.file)
    except JsonlError as error:
        print(f"nanwatch show: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "show",
        help="render a report or trace .jsonl file as text",
        description=(
            "Print a nanwatch JSON Lines file (nanwatch-report-*.jsonl or nanwatch-trace-rank*.jsonl in report_dir) "
            "as text: a report exactly as its .txt report, a trace batch by batch as its .txt trace. "
            "Exit status: 0, or 2 on bad input."
        ),
    )
    parser.add_argument(
        "file", metavar="FILE[:BATCH]", help="a .jsonl file written by nanwatch; with :BATCH, only that batch"
    )
    parser.set_defaults(func=_run)
