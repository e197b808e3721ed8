"""JSON Lines: every line of every report and trace as one self-contained record, for tools and for people.

`report_dir` holds, next to each text report, `nanwatch-report[-eval]-rank{R}-batch{N}.jsonl`, and next to each text
trace, `nanwatch-trace-rank{R}.jsonl`. Each line of those files is one JSON object, one per line of the text (a
parameter, an input or an output of one module call), schema version 2:

- `version`: 2. Version 1 files (before the statistics registry) are still read; newer versions are refused.
- `kind`: "report" (the frames of a detection report) or "trace" (a frame of a traced batch).
- `rank`, `world_size`: the process that wrote it.
- `phase`: "train" or "eval"; `batch`: the micro-batch of that phase the frame belongs to (0-indexed).
- `optimizer_step`, `epoch`: the counters when the record was written, null when nobody counted them.
- `frame`: the frame's index: within the report (0 is its oldest frame), or within the traced batch (call order).
- `module`, `class`: the module's qualified name ("" for the root) and class; `direction`: "forward", "backward" or
  "recompute" (a forward that activation checkpointing ran again during backward, recorded with `watch_gradients`).
- `label`: "weight", "input[0]", "output.logits", "grad output", ... as the text shows it (null only for a frame
  that holds no line at all); `role`: "parameter", "input", "output" or "loss" (in a backward frame: the tensor
  whose gradient the line is).
- `dtype`, `shape`: of the tensor, null when there is none (`shape` is also null for a nested tensor).
- one column per value of every registered statistic (core/stats/registry.py): `abs_min`, `abs_max` (the numbers of
  the text line), `nan`, `inf` (counts: exact where known for free or traced, else null), `subnormal`,
  `target_subnormal`, `target_zero` (with `count_underflow`, else null), and those of any statistic registered since.
- `note`: what the text shows instead of numbers ("None", "not a tensor", "empty", ...), else null.
- report records only (null in trace records): `report_batch`, `report_module` (where inf/nan was detected),
  `report_frames` (how many frames the report has), `report_culprit` (the culprit line) and `report_footer` (all the
  text the report has after its frames: the culprit, the loss scale, ...).

Numbers: JSON has no literal for infinity or nan, so a non-finite number is one of the strings "inf", "-inf" or
"nan"; any other number is a JSON number (integers stay integers, floats keep every digit).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanwatch.core.frames import (
    BACKWARD_SUFFIX,
    GRAD_PREFIX,
    Direction,
    ResolvedEntry,
    ResolvedFrame,
    Role,
    shown_class,
)
from nanwatch.core.report import TABLE_HEADER, Report, format_batch_start, format_frame
from nanwatch.core.stats import registry
from nanwatch.core.stats.base import Number, Values, decode_number
from nanwatch.errors import JsonlError

__all__ = [
    "SCHEMA_VERSION",
    "KINDS",
    "JsonlError",
    "LineRecord",
    "Block",
    "report_records",
    "trace_records",
    "dumps",
    "read_records",
    "split_blocks",
    "parse_source",
    "read_blocks",
]

SCHEMA_VERSION = 2
_READS = (1, 2)
KINDS = ("report", "trace")


@dataclass(frozen=True, slots=True)
class LineRecord:
    """One line of a report or a trace: the schema, defined once (see the module docstring for each field)."""

    kind: str
    rank: int
    world_size: int
    phase: str
    batch: int
    optimizer_step: int | None
    epoch: int | None
    frame: int
    module: str
    class_name: str
    label: str | None
    dtype: str | None
    shape: tuple[int, ...] | None
    abs_min: Number | None
    abs_max: Number | None
    note: str | None
    direction: Direction = Direction.FORWARD
    role: Role | None = None
    stats: Mapping[str, Values] = field(default_factory=dict)
    report_batch: int | None = None
    report_module: str | None = None
    report_frames: int | None = None
    report_culprit: str | None = None
    report_footer: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": SCHEMA_VERSION,
            "kind": self.kind,
            "rank": self.rank,
            "world_size": self.world_size,
            "phase": self.phase,
            "batch": self.batch,
            "optimizer_step": self.optimizer_step,
            "epoch": self.epoch,
            "frame": self.frame,
            "module": self.module,
            "class": self.class_name,
            "direction": self.direction.value,
            "label": self.label,
            "role": None if self.role is None else self.role.value,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
        }
        data.update(registry.lead().to_columns(self.range))
        for statistic in registry.extras():
            data.update(statistic.to_columns(self.stats.get(statistic.name)))
        data.update(
            note=self.note,
            report_batch=self.report_batch,
            report_module=self.report_module,
            report_frames=self.report_frames,
            report_culprit=self.report_culprit,
            report_footer=self.report_footer,
        )
        return data

    @classmethod
    def from_dict(cls, data: object) -> LineRecord:
        """Read a record back (version 1 or 2), checking every field.

        Raises:
            ValueError: a field is missing or has the wrong type, or the version is not one this nanwatch reads.
        """
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version not in _READS or isinstance(version, bool):
            raise ValueError(f"schema version {version!r} is not one this nanwatch reads (it reads {list(_READS)})")
        kind = _get(data, "kind", str)
        if kind not in KINDS:
            raise ValueError(f"kind can be one of {KINDS}, got {kind!r}")
        shape = _get(data, "shape", list, optional=True)
        if shape is not None and not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise ValueError(f"shape must be a list of whole numbers, got {shape!r}")
        class_name = _get(data, "class", str)
        label = _get(data, "label", str, optional=True)
        if version == 1:
            direction, class_name, role = _v1_meaning(class_name, label)
        else:
            direction = _enum(Direction, _get(data, "direction", str), "direction")
            role_name = _get(data, "role", str, optional=True)
            role = None if role_name is None else _enum(Role, role_name, "role")
        stats: dict[str, Values] = {}
        for statistic in registry.extras():
            values = statistic.from_columns(data)
            if values is not None:
                stats[statistic.name] = values
        optional = {key: _get(data, key, int, optional=True) if key in data else None for key in _OPTIONAL_INTS}
        return cls(
            kind=kind,
            rank=_get(data, "rank", int),
            world_size=_get(data, "world_size", int),
            phase=_get(data, "phase", str),
            batch=_get(data, "batch", int),
            optimizer_step=_get(data, "optimizer_step", int, optional=True),
            epoch=_get(data, "epoch", int, optional=True),
            frame=_get(data, "frame", int),
            module=_get(data, "module", str),
            class_name=class_name,
            label=label,
            dtype=_get(data, "dtype", str, optional=True),
            shape=tuple(shape) if shape is not None else None,
            abs_min=_number(data, "abs_min"),
            abs_max=_number(data, "abs_max"),
            note=_get(data, "note", str, optional=True),
            direction=direction,
            role=role,
            stats=stats,
            report_batch=optional["report_batch"],
            report_module=_get(data, "report_module", str, optional=True) if "report_module" in data else None,
            report_frames=optional["report_frames"],
            # Absent from files written before they existed: those read as before.
            report_culprit=_get(data, "report_culprit", str, optional=True) if "report_culprit" in data else None,
            report_footer=_get(data, "report_footer", str, optional=True) if "report_footer" in data else None,
        )

    @property
    def non_finite(self) -> bool:
        return isinstance(self.abs_max, float) and not math.isfinite(self.abs_max)

    @property
    def range(self) -> Values | None:
        return None if self.abs_max is None else (self.abs_min, self.abs_max)

    @property
    def shown_class(self) -> str:
        return shown_class(self.class_name, self.direction)

    def column(self, name: str) -> Number | None:
        """The value of one statistic column (`"nan"`, `"subnormal"`, ...), None where it is null."""
        if name in ("abs_min", "abs_max"):
            return self.abs_min if name == "abs_min" else self.abs_max
        for statistic in registry.extras():
            for index, column in enumerate(statistic.columns):
                if column.name == name:
                    values = self.stats.get(statistic.name)
                    return None if values is None else values[index]
        raise KeyError(f"no statistic has a column named {name!r}")

    def to_entry(self) -> ResolvedEntry:
        assert self.label is not None, "a frame without lines has no entry"
        role = self.role if self.role is not None else Role.OUTPUT
        return ResolvedEntry(
            self.label, role, self.abs_min, self.abs_max, self.dtype, self.shape, self.note, dict(self.stats)
        )


_OPTIONAL_INTS = ("report_batch", "report_frames")


def _v1_meaning(class_name: str, label: str | None) -> tuple[Direction, str, Role | None]:
    # Version 1 kept meaning in the display strings only; this is the one place that reads it back, for old files.
    direction = Direction.FORWARD
    if class_name.endswith(BACKWARD_SUFFIX):
        direction, class_name = Direction.BACKWARD, class_name.removesuffix(BACKWARD_SUFFIX)
    if label is None:
        return direction, class_name, None
    bare = label.removeprefix(GRAD_PREFIX) if direction is Direction.BACKWARD else label
    if bare == "loss" and class_name == "Tensor":
        role = Role.LOSS
    elif bare.startswith(("input[", "input.")) or bare == "input":
        role = Role.INPUT
    elif bare == "output" or bare.startswith(("output[", "output.")):
        role = Role.OUTPUT
    else:
        role = Role.PARAMETER
    return direction, class_name, role


def _enum(kind: type[Direction] | type[Role], value: str, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} can be one of {[member.value for member in kind]}, got {value!r}") from None


def _number(data: Mapping[str, Any], key: str) -> Number | None:
    return decode_number(data.get(key), field=key)


def _get(data: Mapping[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
    if key not in data:
        raise ValueError(f"field {key!r} is missing")
    value = data[key]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = f"{kind.__name__} or null" if optional else kind.__name__
        raise ValueError(f"field {key!r} must be {expected}, got {value!r}")
    return value


# ------------------------------------------------------------------------------------------------- writing


def _frame_records(
    frame: ResolvedFrame,
    *,
    kind: str,
    frame_index: int,
    rank: int,
    world_size: int,
    optimizer_step: int | None,
    epoch: int | None,
    report: Report | None = None,
) -> list[LineRecord]:
    footer = culprit = None
    if report is not None:
        footer = report.footer()
        culprit = report.culprit
    shared: dict[str, Any] = {
        "kind": kind,
        "rank": rank,
        "world_size": world_size,
        "phase": frame.phase,
        "batch": frame.batch_number,
        "optimizer_step": optimizer_step,
        "epoch": epoch,
        "frame": frame_index,
        "module": frame.module_name,
        "class_name": frame.class_name,
        "direction": frame.direction,
        "report_batch": None if report is None else report.batch_number,
        "report_module": None if report is None else report.module_name,
        "report_frames": None if report is None else len(report.frames),
        "report_culprit": None if culprit is None else str(culprit),
        "report_footer": footer,
    }
    if not frame.entries:  # keeps the module line of a call that had nothing to show
        return [LineRecord(label=None, dtype=None, shape=None, abs_min=None, abs_max=None, note=None, **shared)]
    return [
        LineRecord(
            label=entry.label,
            role=entry.role,
            dtype=entry.dtype,
            shape=entry.shape,
            abs_min=entry.abs_min,
            abs_max=entry.abs_max,
            note=entry.note,
            stats=dict(entry.stats),
            **shared,
        )
        for entry in frame.entries
    ]


def report_records(report: Report) -> list[LineRecord]:
    """The records of a detection report: every line of every frame."""
    records: list[LineRecord] = []
    for index, frame in enumerate(report.frames):
        records += _frame_records(
            frame,
            kind="report",
            frame_index=index,
            rank=report.rank,
            world_size=report.world_size,
            optimizer_step=report.optimizer_step,
            epoch=report.epoch,
            report=report,
        )
    return records


def trace_records(
    frame: ResolvedFrame,
    *,
    frame_index: int,
    rank: int,
    world_size: int,
    optimizer_step: int | None = None,
    epoch: int | None = None,
) -> list[LineRecord]:
    """The records of one traced frame."""
    return _frame_records(
        frame,
        kind="trace",
        frame_index=frame_index,
        rank=rank,
        world_size=world_size,
        optimizer_step=optimizer_step,
        epoch=epoch,
    )


def dumps(records: Iterable[LineRecord]) -> str:
    """The records as JSON Lines text (each record one line, each line ending in a newline)."""
    # allow_nan=False: a non-finite float that escaped the encoding is a bug, never a silent `Infinity`.
    return "".join(json.dumps(r.to_dict(), allow_nan=False, separators=(",", ":")) + "\n" for r in records)


# ------------------------------------------------------------------------------------------------- reading


def read_records(path: str | Path) -> list[LineRecord]:
    """Read a nanwatch JSON Lines file.

    Raises:
        JsonlError: the file cannot be read, or a line is not a record of this schema (the message names it).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise JsonlError(f"cannot read {str(path)!r}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise JsonlError(
            f"{path} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x}); expected a .jsonl "
            "file written by nanwatch (nanwatch-report-*.jsonl or nanwatch-trace-*.jsonl in report_dir)"
        ) from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            raise JsonlError(
                f"{path}:{number} is not JSON ({error.msg}); expected a .jsonl file written by nanwatch "
                "(nanwatch-report-*.jsonl or nanwatch-trace-*.jsonl in report_dir)"
            ) from None
        try:
            records.append(LineRecord.from_dict(data))
        except ValueError as error:
            raise JsonlError(f"{path}:{number} is not a nanwatch record: {error}") from None
    if not records:
        raise JsonlError(f"{path} holds no records")
    return records


@dataclass(frozen=True)
class Block:
    """The records of one report, or of one traced batch, in the order they were written."""

    kind: str
    rank: int
    world_size: int
    phase: str
    batch: int  # the traced batch, or the batch in which the report detected inf/nan
    records: tuple[LineRecord, ...]

    @property
    def module(self) -> str | None:
        """Where the report detected inf/nan (None for a trace)."""
        return self.records[0].report_module

    def frames(self) -> list[ResolvedFrame]:
        frames: list[ResolvedFrame] = []
        group: list[LineRecord] = []
        for record in self.records:
            if group and record.frame != group[0].frame:
                frames.append(_frame(group))
                group = []
            group.append(record)
        if group:
            frames.append(_frame(group))
        return frames

    def to_text(self) -> str:
        """The text nanwatch wrote for this block (the .txt report, or this batch of the .txt trace)."""
        frames = self.frames()
        if self.kind == "report":
            first = self.records[0]
            text = Report(
                batch_number=self.batch,
                phase=self.phase,
                rank=self.rank,
                world_size=self.world_size,
                module_name=self.module,
                frames=frames,
                optimizer_step=first.optimizer_step,
                epoch=first.epoch,
            ).frames_text()
            if first.report_footer is not None:
                return text + first.report_footer
            culprit = first.report_culprit  # version 1: the culprit line was all there was after the frames
            return text if culprit is None else f"{text}\n\n{culprit}"
        lines = [format_batch_start(self.batch, self.rank, self.world_size), TABLE_HEADER]
        lines.extend(format_frame(frame) for frame in frames)
        return "\n".join(lines)


def _frame(records: list[LineRecord]) -> ResolvedFrame:
    first = records[0]
    entries = tuple(record.to_entry() for record in records if record.label is not None)
    return ResolvedFrame(first.module, first.class_name, first.batch, first.phase, entries, first.direction)


def _block_key(record: LineRecord) -> tuple[object, ...]:
    batch = record.report_batch if record.kind == "report" else record.batch
    return record.kind, record.rank, record.phase, batch


def split_blocks(records: Sequence[LineRecord]) -> list[Block]:
    """Cut records into reports and traced batches: a new block where the kind, rank, phase or batch changes, or
    where the frame index starts again (a second report, or a run appended to the same trace file)."""
    blocks: list[Block] = []
    current: list[LineRecord] = []

    def close() -> None:
        if current:
            first = current[0]
            batch = first.report_batch if first.kind == "report" and first.report_batch is not None else first.batch
            blocks.append(Block(first.kind, first.rank, first.world_size, first.phase, batch, tuple(current)))

    for record in records:
        if current and (_block_key(record) != _block_key(current[-1]) or record.frame < current[-1].frame):
            close()
            current = []
        current.append(record)
    close()
    return blocks


def parse_source(spec: str) -> tuple[Path, int | None]:
    """Split `FILE` or `FILE:BATCH` (an existing file whose name ends in `:N` is taken whole)."""
    path = Path(spec)
    head, separator, tail = spec.rpartition(":")
    if not path.exists() and separator and head and tail.isdigit():
        return Path(head), int(tail)
    return path, None


def read_blocks(spec: str) -> list[Block]:
    """The reports and traced batches of `FILE`, or only those of batch N for `FILE:N`.

    Raises:
        JsonlError: the file cannot be read or is not a nanwatch JSON Lines file, or holds no batch N.
    """
    path, batch = parse_source(spec)
    blocks = split_blocks(read_records(path))
    if batch is None:
        return blocks
    chosen = [block for block in blocks if block.batch == batch]
    if not chosen:
        held = ", ".join(sorted({str(block.batch) for block in blocks}, key=int))
        raise JsonlError(f"{path} holds no batch {batch}; it holds batch {held}")
    return chosen
