"""`nanwatch show FILE[:BATCH]`: a nanwatch JSON Lines file, rendered as the text nanwatch wrote beside it.

With a config (`--config FILE` or the options generated from `WatchConfig`), the report is shown as that config would
have written it: `max_frames_to_save` keeps a report's last N frames, `include_modules` / `exclude_modules` keep the
lines of the modules they select. A field that was not set changes nothing, so `nanwatch show FILE` prints the file's
text byte for byte. `chosen_modules` and `restrict` are shared with `nanwatch diff` and `nanwatch plot`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace
from typing import Any

from nanwatch.cli import COMMANDS
from nanwatch.cli.inputs import read_jsonl_blocks
from nanwatch.cli.options import ToolHelpFormatter, add_config_arguments, fields_epilog, tool_config
from nanwatch.core.formats.jsonl_reader import Block
from nanwatch.core.scope import select_names

__all__ = ["register", "render", "chosen_modules", "restrict", "USED_FIELDS"]

# The WatchConfig fields `nanwatch show` applies, and what each does here (printed by --help).
USED_FIELDS = {
    "max_frames_to_save": "a report shows only its last N frames (its header counts them); a trace is shown whole, "
    "as nanwatch logs every frame of a traced batch",
    "include_modules": "only the lines of modules matching one of these globs are shown (as when watching: `*` "
    "crosses dots, the root is ''); a pattern that matches no module in FILE is an error",
    "exclude_modules": "the lines of modules matching one of these globs are left out",
}


def chosen_modules(
    names: Iterable[str], include: Sequence[str], exclude: Sequence[str], *, source: str
) -> frozenset[str]:
    """The module names that match an `include` pattern (any, when empty) and no `exclude` pattern.

    The patterns mean what they mean when watching (`include_modules`, `exclude_modules`): fnmatch globs, matched
    case-sensitively against the whole qualified name, `*` crossing dots, the root module named "".

    Args:
        names: the module names found in the files.
        include: glob patterns; empty selects every module.
        exclude: glob patterns applied after `include`.
        source: how messages name the files the names come from.

    Raises:
        ConfigError: a pattern matches none of `names` (the message names it and suggests near names), or the
            patterns together leave no module.
    """
    known = list(dict.fromkeys(names))
    return frozenset(select_names(known, include, exclude, among=f"the {len(known)} modules in {source}"))


def restrict(block: Block, modules: Collection[str] | None = None, max_frames: int | None = None) -> Block:
    """`block` with only the lines of `modules` (all when None) and, for a report, only its last `max_frames` frames.

    The result may hold no records (no line of `block` was kept); a caller that renders it must check.
    """
    records = [record for record in block.records if modules is None or record.module in modules]
    if max_frames is not None and block.kind == "report":
        frames = list(dict.fromkeys(record.frame for record in records))
        kept = set(frames[-max_frames:])
        records = [record for record in records if record.frame in kept]
    return replace(block, records=tuple(records))


def render(
    spec: str,
    *,
    max_frames: int | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> str:
    """The text of every report and traced batch in `spec` (`FILE` or `FILE:BATCH`), in file order.

    A report renders as its .txt report, byte for byte; a trace as the .txt trace, one batch after another.

    Args:
        spec: `FILE` or `FILE:BATCH`.
        max_frames: show only the last N frames of each report (traces are shown whole).
        include: glob patterns of modules whose lines are shown (empty: every module).
        exclude: glob patterns of modules whose lines are left out.

    Raises:
        CliError: the file is not a nanwatch JSON Lines file (the message says what it is), or was cut short.
        JsonlError: a line is not a nanwatch record, or the file holds no batch BATCH.
        ConfigError: a module pattern matches no module in the file, or the patterns leave none.
    """
    blocks = _selected_blocks(spec, max_frames=max_frames, include=include, exclude=exclude)
    return "".join(block.to_text() + "\n" for block in blocks)


def _selected_blocks(
    spec: str, *, max_frames: int | None, include: Sequence[str], exclude: Sequence[str]
) -> list[Block]:
    blocks = read_jsonl_blocks(spec, "show")
    modules = None
    if include or exclude:
        names = (record.module for block in blocks for record in block.records)
        modules = chosen_modules(names, include, exclude, source=spec)
    if modules is None and max_frames is None:
        return blocks
    # A block whose every line was left out is not shown at all (an empty report would have no header to give).
    return [kept for kept in (restrict(block, modules, max_frames) for block in blocks) if kept.records]


def _run(args: argparse.Namespace) -> int:
    settings = tool_config(args)
    config, given = settings.config, settings.given
    for flag in settings.unused_options(USED_FIELDS):
        _note(f"{flag} is not used by show (see nanwatch show --help)")
    blocks = _selected_blocks(
        args.file,
        max_frames=config.max_frames_to_save if "max_frames_to_save" in given else None,
        include=config.include_modules,
        exclude=config.exclude_modules,
    )
    if "max_frames_to_save" in settings.from_line and all(block.kind != "report" for block in blocks):
        _note(f"--max-frames-to-save applies to reports, and {args.file} holds traces only: shown whole")
    sys.stdout.write("".join(block.to_text() + "\n" for block in blocks))
    return 0


def _note(message: str) -> None:
    print(f"nanwatch show: note: {message}", file=sys.stderr)


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:8])
    return shown + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "show",
        help=COMMANDS["show"].summary,
        description=(
            "Print a nanwatch JSON Lines file (nanwatch-report-*.jsonl or nanwatch-trace-rank*.jsonl in report_dir) "
            "as text: a report exactly as its .txt report, a trace batch by batch as its .txt trace. Any other file "
            "(the .json or .txt report, a replay capture) is named for what it is, with the .jsonl to give instead; "
            "a .jsonl cut short is refused. Exit status: 0, or 2 on bad input (one line on stderr)."
        ),
        epilog=fields_epilog("show", USED_FIELDS),
        formatter_class=ToolHelpFormatter,
    )
    parser.add_argument(
        "file", metavar="FILE[:BATCH]", help="a .jsonl file written by nanwatch; with :BATCH, only that batch"
    )
    add_config_arguments(parser, used=USED_FIELDS)
    parser.set_defaults(func=_run, parser=parser)
