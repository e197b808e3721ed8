"""`nanwatch diff A B`: line two traced batches (or reports) up and show where they first diverge.

Lines are matched by (module, call index within the batch, label): the k-th call of `encoder.block.0.ff` in A is
compared with its k-th call in B, whatever else ran in between, so batch 149 can be compared with batch 150 of the
same run, or a bfloat16 run with a float32 run of the same model. Each registered statistic (core/stats) judges its
own values (`Statistic.diverges`), the abs range first. Two matched lines diverge when

- exactly one of their abs max is inf or nan, or both are non-finite but not the same (nan against inf), or
- both are finite and `|a - b| > atol + rtol * max(|a|, |b|)` (a relative tolerance on the abs max), or
- one has numbers and the other none (a tensor against None), or
- their abs max agree and another statistic measured on both sides differs (by default: a count that is not the
  same, a float beyond the same tolerances), or
- a line has no partner in the other file (the two ran different modules or returned different outputs).

The first divergence is the first such line in A's order (lines only in B are placed where B has them). What a
statistic prints after the label in the text report is shown after the label here too, once when A and B agree.

With a config (`--config FILE` or the options generated from `WatchConfig`), `include_modules` / `exclude_modules`
choose the modules compared, matched against the module names of A and B together.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanwatch.cli import COMMANDS
from nanwatch.cli.inputs import read_jsonl_blocks
from nanwatch.cli.options import ToolHelpFormatter, add_config_arguments, fields_epilog, tool_config
from nanwatch.cli.show import chosen_modules, restrict
from nanwatch.cli.validators import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT
from nanwatch.core.formats.jsonl_reader import Block, parse_source
from nanwatch.core.formats.jsonl_schema import LineRecord
from nanwatch.core.report import trailing_text
from nanwatch.core.stats import registry
from nanwatch.core.stats.abs_range import relative_difference
from nanwatch.errors import JsonlError

__all__ = ["register", "Row", "DiffResult", "compare", "diff_text", "load_block", "run_diff", "USED_FIELDS"]

Key = tuple[str, int, str]  # (module, call index of that module within the block, label)

_GAP = "   "
_SIDE_WIDTH = 17  # "1.23e-04 5.67e+01": the two numbers of a text-report line
_LABEL_COLUMN = 2 + _SIDE_WIDTH + len(_GAP) + _SIDE_WIDTH + 2

# The WatchConfig fields `nanwatch diff` applies, and what each does here (printed by --help).
USED_FIELDS = {
    "include_modules": "only the lines of modules matching one of these globs are compared (as when watching: `*` "
    "crosses dots, the root is ''); a pattern that matches no module of A or B is an error",
    "exclude_modules": "the lines of modules matching one of these globs are not compared",
}


@dataclass(frozen=True)
class Row:
    """A line of A and its partner in B (either may be missing), and why they diverge (None when they agree)."""

    key: Key
    a: LineRecord | None
    b: LineRecord | None
    reason: str | None


@dataclass(frozen=True)
class DiffResult:
    rows: list[Row]
    rtol: float
    atol: float

    @property
    def first(self) -> int | None:
        """Index in `rows` of the first divergence, None when the two are equivalent."""
        return next((index for index, row in enumerate(self.rows) if row.reason is not None), None)

    @property
    def diverging(self) -> int:
        return sum(1 for row in self.rows if row.reason is not None)

    def first_non_finite(self, side: str) -> int | None:
        for index, row in enumerate(self.rows):
            record = row.a if side == "A" else row.b
            if record is not None and record.non_finite:
                return index
        return None

    def largest_relative_difference(self) -> tuple[float, int | None]:
        largest, where = 0.0, None
        for index, row in enumerate(self.rows):
            pair = _finite_pair(row.a, row.b)
            if pair is not None:
                difference = relative_difference(*pair)
                if difference > largest:
                    largest, where = difference, index
        return largest, where


def _keyed(block: Block) -> list[tuple[Key, LineRecord]]:
    calls: dict[str, int] = {}
    lines: list[tuple[Key, LineRecord]] = []
    previous_frame: int | None = None
    call = 0
    for record in block.records:
        if record.frame != previous_frame:
            previous_frame = record.frame
            call = calls.get(record.module, 0)
            calls[record.module] = call + 1
        if record.label is not None:
            lines.append(((record.module, call, record.label), record))
    return lines


def _finite_pair(a: LineRecord | None, b: LineRecord | None) -> tuple[float, float] | None:
    if a is None or b is None or a.abs_max is None or b.abs_max is None:
        return None
    first, second = float(a.abs_max), float(b.abs_max)
    return (first, second) if math.isfinite(first) and math.isfinite(second) else None


def _word(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def divergence(a: LineRecord | None, b: LineRecord | None, *, rtol: float, atol: float = 0.0) -> str | None:
    """Why two matched lines diverge (see the module docstring), or None when they agree: each registered statistic
    judges its own values (core/stats), the abs range first."""
    if a is None:
        return "only in B"
    if b is None:
        return "only in A"
    reason = registry.lead().diverges(a.range, b.range, rtol=rtol, atol=atol)
    if reason is not None:
        return reason
    for statistic in registry.extras():
        reason = statistic.diverges(a.stats.get(statistic.name), b.stats.get(statistic.name), rtol=rtol, atol=atol)
        if reason is not None:
            return reason
    return None


def compare(a: Block, b: Block, *, rtol: float = 1e-3, atol: float = 0.0) -> DiffResult:
    """Match the lines of `a` and `b` by (module, call index, label) and judge each pair."""
    a_lines, b_lines = _keyed(a), _keyed(b)
    a_keys = {key for key, _ in a_lines}
    b_position = {key: index for index, (key, _) in enumerate(b_lines)}
    rows: list[Row] = []
    flushed = 0  # B's lines before this position are placed already

    def flush_b_only(until: int) -> None:
        nonlocal flushed
        for key, record in b_lines[flushed:until]:
            if key not in a_keys:
                rows.append(Row(key, None, record, divergence(None, record, rtol=rtol, atol=atol)))
        flushed = max(flushed, until)

    for key, record in a_lines:
        position = b_position.get(key)
        if position is None:
            rows.append(Row(key, record, None, divergence(record, None, rtol=rtol, atol=atol)))
            continue
        flush_b_only(position)
        flushed = max(flushed, position + 1)
        partner = b_lines[position][1]
        rows.append(Row(key, record, partner, divergence(record, partner, rtol=rtol, atol=atol)))
    flush_b_only(len(b_lines))
    return DiffResult(rows, rtol, atol)


# ---------------------------------------------------------------------------------------------------- text


def _others(row: Row) -> str:
    """What the other statistics print after the label (core/stats): once when A and B agree, else both."""
    a = trailing_text(row.a.stats).strip() if row.a is not None else ""
    b = trailing_text(row.b.stats).strip() if row.b is not None else ""
    if a == b:
        return f"  {a}" if a else ""
    return f"  A: {a or '-'}  B: {b or '-'}"


def _side(record: LineRecord | None) -> str:
    if record is None:
        return f"{'(absent)':>{_SIDE_WIDTH}}"
    if record.abs_min is None or record.abs_max is None:
        return f"{record.note or 'not a tensor':>{_SIDE_WIDTH}}"
    return f"{record.abs_min:8.2e} {record.abs_max:8.2e}"


def _value(record: LineRecord | None) -> str:
    if record is None:
        return "(absent)"
    if record.abs_max is None:
        return record.note or "not a tensor"
    return f"{record.abs_max:.2e}" if math.isfinite(record.abs_max) else _word(float(record.abs_max))


def _describe_row(row: Row) -> str:
    module, call, label = row.key
    record = row.a if row.a is not None else row.b
    assert record is not None
    name = f"{module!r} ({record.class_name})" + (f" call {call}" if call else "")
    return f"{name} {label}"


def _describe_block(spec: str, block: Block) -> str:
    frames = len({record.frame for record in block.records})
    lines = sum(1 for record in block.records if record.label is not None)
    dtypes = sorted({r.dtype for r in block.records if r.dtype is not None and "float" in r.dtype})
    where = f" on rank {block.rank}" if block.world_size > 1 else ""
    kinds = f", {'/'.join(dtypes)}" if dtypes else ""
    return f"{spec} ({block.kind} of {block.phase} batch {block.batch}{where}, {frames} frames, {lines} lines{kinds})"


def diff_text(result: DiffResult, *, a_name: str, b_name: str, a: Block, b: Block, context: int = 3) -> str:
    """The report `nanwatch diff` prints: the two inputs, the first divergence, and the lines around it."""
    lines = [f"A: {_describe_block(a_name, a)}", f"B: {_describe_block(b_name, b)}"]
    rows = result.rows
    first = result.first
    tolerance = f"rtol={result.rtol:g}" + (f", atol={result.atol:g}" if result.atol else "")
    if first is None:
        largest, where = result.largest_relative_difference()
        at = f" at {_describe_row(rows[where])}" if where is not None else ""
        lines.append(
            f"equivalent: {len(rows)} lines match within {tolerance} (largest relative difference {largest:.2e}{at})"
        )
        return "\n".join(lines) + "\n"
    row = rows[first]
    values = f"abs max {_value(row.a)} in A, {_value(row.b)} in B"
    lines.append(f"first divergence at line {first + 1} of {len(rows)}: {_describe_row(row)}: {values} ({row.reason})")
    for side in ("A", "B"):
        index = result.first_non_finite(side)
        found = f"line {index + 1}, {_describe_row(rows[index])}" if index is not None else "none"
        lines.append(f"first non-finite in {side}: {found}")
    lines.append(f"{result.diverging} of {len(rows)} lines diverge ({tolerance})")
    lines.append("")
    lines.append(f"  {'A':<{_SIDE_WIDTH}}{_GAP}B")
    header = f"{'abs min':8} {'abs max':8}"
    lines.append(f"  {header}{_GAP}{header}  metadata")
    start, stop = max(0, first - context), min(len(rows), first + context + 1)
    if start > 0:
        lines.append(f"  ... {start} lines before")
    shown_module: tuple[str, int] | None = None
    for index in range(start, stop):
        current = rows[index]
        module, call, label = current.key
        if (module, call) != shown_module:
            shown_module = (module, call)
            record = current.a if current.a is not None else current.b
            assert record is not None
            suffix = f" (call {call})" if call else ""
            lines.append(f"{' ' * _LABEL_COLUMN}{module} {record.class_name}{suffix}")
        mark = ">" if index == first else ("!" if current.reason is not None else " ")
        note = f"   <- {current.reason}" if current.reason is not None else ""
        lines.append(f"{mark} {_side(current.a)}{_GAP}{_side(current.b)}  {label}{_others(current)}{note}")
    if stop < len(rows):
        lines.append(f"  ... {len(rows) - stop} lines after")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- CLI


def load_block(spec: str) -> tuple[Block, str | None]:
    """The one report or traced batch `spec` names, and a note when the file held that batch more than once.

    Raises:
        CliError: the file is not a nanwatch JSON Lines file (the message says what it is), or was cut short.
        JsonlError: a line is not a nanwatch record, the file holds no such batch, or it holds several batches and
            `spec` names none.
    """
    blocks = read_jsonl_blocks(spec, "diff")
    path, batch = parse_source(spec)
    if batch is None and len({(block.kind, block.batch) for block in blocks}) > 1:
        held = ", ".join(f"{block.kind} of batch {block.batch}" for block in blocks)
        raise JsonlError(f"{path} holds more than one batch ({held}); name one as {path}:BATCH")
    note = None
    if len(blocks) > 1:
        note = f"{spec} holds batch {blocks[-1].batch} {len(blocks)} times (report_dir reused?); comparing the last"
    return blocks[-1], note


def run_diff(
    a_spec: str,
    b_spec: str,
    *,
    rtol: float,
    atol: float,
    context: int,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> tuple[int, str, list[str]]:
    """Compare two specs; return (exit status, report text, notes for stderr).

    Args:
        a_spec: `FILE[:BATCH]` of A.
        b_spec: `FILE[:BATCH]` of B.
        rtol: relative tolerance on abs max.
        atol: absolute tolerance on abs max.
        context: lines shown on each side of the first divergence.
        include: glob patterns of the modules compared (empty: every module).
        exclude: glob patterns of modules left out of the comparison.

    Raises:
        CliError: a spec's file is not a whole nanwatch JSON Lines file.
        JsonlError: a spec does not name one report or traced batch of a nanwatch JSON Lines file.
        ConfigError: a module pattern matches no module of A or B, or the patterns leave none.
    """
    a, a_note = load_block(a_spec)
    b, b_note = load_block(b_spec)
    if include or exclude:
        names = [record.module for block in (a, b) for record in block.records]
        modules = chosen_modules(names, include, exclude, source=f"{a_spec} and {b_spec}")
        a, b = restrict(a, modules), restrict(b, modules)
    result = compare(a, b, rtol=rtol, atol=atol)
    text = diff_text(result, a_name=a_spec, b_name=b_spec, a=a, b=b, context=context)
    notes: Sequence[str | None] = (a_note, b_note)
    return (0 if result.first is None else 1), text, [note for note in notes if note is not None]


def _run(args: argparse.Namespace) -> int:
    settings = tool_config(args)
    for flag in settings.unused_options(USED_FIELDS):
        print(f"nanwatch diff: note: {flag} is not used by diff (see nanwatch diff --help)", file=sys.stderr)
    status, text, notes = run_diff(
        args.a,
        args.b,
        rtol=args.rtol,
        atol=args.atol,
        context=args.context,
        include=settings.config.include_modules,
        exclude=settings.config.exclude_modules,
    )
    for note in notes:
        print(f"nanwatch diff: note: {note}", file=sys.stderr)
    sys.stdout.write(text)
    return status


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diff",
        help=COMMANDS["diff"].summary,
        description=(
            "Line up two traced batches by (module, call index, label), e.g. trace.jsonl:149 against "
            "trace.jsonl:150, or a bfloat16 trace against a float32 trace of the same model, and show the first "
            "line where they diverge: one abs max non-finite and the other not, the two further apart than "
            "atol + rtol * max(|a|, |b|), or another statistic measured on both sides different (nan/inf counts, "
            "underflow counts). Exit status: 0 when equivalent, 1 when they diverge, 2 on bad input (one line on "
            "stderr)."
        ),
        epilog=fields_epilog("diff", USED_FIELDS),
        formatter_class=ToolHelpFormatter,
    )
    parser.add_argument("a", metavar="A", help="FILE[:BATCH]: a .jsonl trace or report written by nanwatch")
    parser.add_argument("b", metavar="B", help="FILE[:BATCH]: the one to compare with A")
    parser.add_argument(
        "--rtol", type=NON_NEGATIVE_FLOAT, default=1e-3, help="relative tolerance on abs max (default: 1e-3)"
    )
    parser.add_argument(
        "--atol", type=NON_NEGATIVE_FLOAT, default=0.0, help="absolute tolerance on abs max (default: 0)"
    )
    parser.add_argument(
        "--context",
        type=NON_NEGATIVE_INT,
        default=3,
        help="lines shown on each side of the first divergence (default: 3)",
    )
    add_config_arguments(parser, used=USED_FIELDS)
    parser.set_defaults(func=_run, parser=parser)
