"""JSON Lines: every line of every report and trace as one self-contained record, for tools and for people.

`report_dir` holds, next to each text report, `nanwatch-report[-eval]-rank{R}-batch{N}.jsonl`, and next to each text
trace, `nanwatch-trace-rank{R}.jsonl`. Each line of those files is one JSON object, one per line of the text (a
parameter, an input or an output of one module call), with the fields of `LineRecord` (schema version 1):

- `version`: the schema version, 1. A reader refuses a version it does not know.
- `kind`: "report" (the frames of a detection report) or "trace" (a frame of a traced batch).
- `rank`, `world_size`: the process that wrote it.
- `phase`: "train" or "eval"; `batch`: the micro-batch of that phase the frame belongs to (0-indexed).
- `optimizer_step`, `epoch`: the counters when the record was written, null when nobody counted them.
- `frame`: the frame's index: within the report (0 is its oldest frame), or within the traced batch (call order).
- `module`, `class`: the module's qualified name ("" for the root) and class.
- `label`: "weight", "input[0]", "output.logits", ... (null only for a frame that holds no line at all).
- `dtype`, `shape`: of the tensor, null when there is none (`shape` is also null for a nested tensor).
- `abs_min`, `abs_max`: the numbers of the text line, null when the line has none (a note instead).
- `nan`, `inf`: how many elements are nan and ±inf, or null where that was not measured (see below).
- `note`: what the text shows instead of numbers ("None", "not a tensor", "empty", ...), else null.
- `report_batch`, `report_module`: in report records, the batch and the module where inf/nan was detected; null
  in trace records.
- `report_culprit`: in report records, the report's closing line naming the first culprit (see `core/culprit.py`);
  null in trace records, and absent from files written before it existed.

Numbers: JSON has no literal for infinity or nan, and Python's `Infinity`/`NaN` extension is not JSON, so a
non-finite number is written as one of the strings "inf", "-inf" or "nan"; any other number is a JSON number
(integers stay integers, floats keep every digit), so a record reads back to exactly the value measured.

nan and inf counts cost two extra kernels per tensor, which nanwatch never adds to the untraced forward. They are
exact wherever they are known for free: a finite abs max means the tensor holds no nan and no inf (a max is nan as
soon as one element is), so both counts are 0. A trace is the slow path and still holds the tensors, so a traced
line whose abs max is inf or nan is counted exactly, on the device, only for those lines. A report is built after
the batch, when the tensors are gone: its non-finite lines have null counts (not measured), never a guess.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanwatch.core.frames import ResolvedEntry, ResolvedFrame
from nanwatch.core.report import TABLE_HEADER, Report, format_batch_start, format_frame
from nanwatch.core.stats import FLOAT8_DTYPES
from nanwatch.core.walk import walk
from nanwatch.errors import NanwatchError

__all__ = [
    "SCHEMA_VERSION",
    "KINDS",
    "JsonlError",
    "LineRecord",
    "Block",
    "encode_number",
    "decode_number",
    "report_records",
    "trace_records",
    "count_non_finite",
    "dumps",
    "read_records",
    "split_blocks",
    "parse_source",
    "read_blocks",
]

SCHEMA_VERSION = 1
KINDS = ("report", "trace")
_NON_FINITE_STRINGS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}

Counts = tuple[int | None, int | None]  # (nan, inf)


class JsonlError(NanwatchError, ValueError):
    """A JSON Lines file is not one nanwatch wrote (or not one this version reads); the message names the line."""


def encode_number(value: float | int | None) -> float | int | str | None:
    """A number as the schema writes it: non-finite floats as "inf", "-inf" or "nan", anything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def decode_number(value: object, *, field: str = "number") -> float | int | None:
    """The inverse of `encode_number`.

    Raises:
        ValueError: `value` is neither a JSON number, null, nor one of "inf", "-inf", "nan".
    """
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value in _NON_FINITE_STRINGS:
        return _NON_FINITE_STRINGS[value]
    raise ValueError(f"{field} must be a number, null, or one of {sorted(_NON_FINITE_STRINGS)}, got {value!r}")


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
    abs_min: float | int | None
    abs_max: float | int | None
    nan: int | None
    inf: int | None
    note: str | None
    report_batch: int | None = None
    report_module: str | None = None
    report_culprit: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
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
            "label": self.label,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
            "abs_min": encode_number(self.abs_min),
            "abs_max": encode_number(self.abs_max),
            "nan": self.nan,
            "inf": self.inf,
            "note": self.note,
            "report_batch": self.report_batch,
            "report_module": self.report_module,
            "report_culprit": self.report_culprit,
        }

    @classmethod
    def from_dict(cls, data: object) -> LineRecord:
        """Read a record back, checking every field.

        Raises:
            ValueError: a field is missing or has the wrong type, or the version is not one this nanwatch reads.
        """
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema version {version!r} is not one this nanwatch reads (it reads {SCHEMA_VERSION})")
        kind = _get(data, "kind", str)
        if kind not in KINDS:
            raise ValueError(f"kind can be one of {KINDS}, got {kind!r}")
        shape = _get(data, "shape", list, optional=True)
        if shape is not None and not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise ValueError(f"shape must be a list of whole numbers, got {shape!r}")
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
            class_name=_get(data, "class", str),
            label=_get(data, "label", str, optional=True),
            dtype=_get(data, "dtype", str, optional=True),
            shape=tuple(shape) if shape is not None else None,
            abs_min=decode_number(data.get("abs_min"), field="abs_min"),
            abs_max=decode_number(data.get("abs_max"), field="abs_max"),
            nan=_get(data, "nan", int, optional=True),
            inf=_get(data, "inf", int, optional=True),
            note=_get(data, "note", str, optional=True),
            report_batch=_get(data, "report_batch", int, optional=True),
            report_module=_get(data, "report_module", str, optional=True),
            # Optional and may be absent: files from before the culprit line read as before.
            report_culprit=_get(data, "report_culprit", str, optional=True) if "report_culprit" in data else None,
        )

    @property
    def non_finite(self) -> bool:
        return isinstance(self.abs_max, float) and not math.isfinite(self.abs_max)

    def to_entry(self) -> ResolvedEntry:
        assert self.label is not None, "a frame without lines has no entry"
        return ResolvedEntry(self.label, self.abs_min, self.abs_max, self.dtype, self.shape, self.note)


def _get(data: dict[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
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


def _free_counts(entry: ResolvedEntry) -> Counts:
    # A finite abs max rules out nan and inf (either would make the max nan or inf): exact, and costs nothing.
    if entry.abs_max is None or entry.non_finite:
        return None, None
    return 0, 0


def _frame_records(
    frame: ResolvedFrame,
    *,
    kind: str,
    frame_index: int,
    rank: int,
    world_size: int,
    optimizer_step: int | None,
    epoch: int | None,
    counts: Sequence[Counts] | None,
    report_batch: int | None = None,
    report_module: str | None = None,
    report_culprit: str | None = None,
) -> list[LineRecord]:
    def record(entry: ResolvedEntry | None, nan: int | None, inf: int | None) -> LineRecord:
        return LineRecord(
            kind=kind,
            rank=rank,
            world_size=world_size,
            phase=frame.phase,
            batch=frame.batch_number,
            optimizer_step=optimizer_step,
            epoch=epoch,
            frame=frame_index,
            module=frame.module_name,
            class_name=frame.class_name,
            label=entry.label if entry is not None else None,
            dtype=entry.dtype if entry is not None else None,
            shape=entry.shape if entry is not None else None,
            abs_min=entry.abs_min if entry is not None else None,
            abs_max=entry.abs_max if entry is not None else None,
            nan=nan,
            inf=inf,
            note=entry.note if entry is not None else None,
            report_batch=report_batch,
            report_module=report_module,
            report_culprit=report_culprit,
        )

    if not frame.entries:
        return [record(None, None, None)]  # keeps the module line of a call that had nothing to show
    if counts is None:
        counts = [_free_counts(entry) for entry in frame.entries]
    return [record(entry, nan, inf) for entry, (nan, inf) in zip(frame.entries, counts, strict=True)]


def report_records(report: Report) -> list[LineRecord]:
    """The records of a detection report: every line of every frame, with counts only where they are free."""
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
            counts=None,
            report_batch=report.batch_number,
            report_module=report.module_name,
            report_culprit=None if report.culprit is None else report.culprit.message,
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
    counts: Sequence[Counts] | None = None,
) -> list[LineRecord]:
    """The records of one traced frame; `counts` (one per entry, from `count_non_finite`) or the free ones."""
    return _frame_records(
        frame,
        kind="trace",
        frame_index=frame_index,
        rank=rank,
        world_size=world_size,
        optimizer_step=optimizer_step,
        epoch=epoch,
        counts=counts,
    )


def _labelled_tensors(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> dict[str, torch.Tensor]:
    # The same labels the watcher gives its entries: own parameters, then input[i] (walked), then output (walked).
    found: dict[str, torch.Tensor] = {name: param for name, param in module._parameters.items() if param is not None}
    for label, value in [(f"input[{index}]", value) for index, value in enumerate(args)] + [("output", output)]:
        if isinstance(value, torch.Tensor):
            found[label] = value
        else:
            found.update(
                (leaf_label, leaf) for leaf_label, leaf in walk(value, label) if isinstance(leaf, torch.Tensor)
            )
    return found


def _count_kernels(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    data = tensor.detach()
    if data.is_nested:
        data = torch.cat([part.reshape(-1) for part in data.unbind()])
    if data.is_quantized:
        data = data.dequantize()
    elif data.dtype in FLOAT8_DTYPES:
        data = data.float()  # float8 has no isnan/isinf kernels everywhere; every float8 value is exact in float32
    return torch.isnan(data).sum(), torch.isinf(data).sum()


def count_non_finite(frame: ResolvedFrame, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> list[Counts]:
    """nan and inf counts for each entry of a frame being traced, while its tensors are still alive.

    Only lines whose abs max is inf or nan launch kernels (two each, one host transfer for all); finite lines are 0
    and 0 for free; a line whose tensor cannot be found again (or no longer matches) stays null. That includes the
    lines of frames recorded outside a forward hook (backward frames, labelled `grad ...`): they are traced with no
    inputs or output, and their gradients are not parameters of the module.
    """
    counts = [_free_counts(entry) for entry in frame.entries]
    wanted = [index for index, entry in enumerate(frame.entries) if entry.non_finite]
    if not wanted:
        return counts
    tensors = _labelled_tensors(module, args, output)
    launched: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]] = []
    for index in wanted:
        entry = frame.entries[index]
        tensor = tensors.get(entry.label)
        if tensor is None or str(tensor.dtype).replace("torch.", "") != entry.dtype:
            continue
        if entry.shape is not None and (tensor.is_nested or tuple(tensor.shape) != entry.shape):
            continue
        launched.append((index, _count_kernels(tensor)))
    if launched:
        by_device: dict[torch.device, list[int]] = {}
        for position, (_index, (nan, _inf)) in enumerate(launched):
            by_device.setdefault(nan.device, []).append(position)
        for positions in by_device.values():
            stacked = torch.stack([torch.stack(launched[p][1]) for p in positions]).tolist()
            for position, (nan, inf) in zip(positions, stacked, strict=True):
                counts[launched[position][0]] = (int(nan), int(inf))
    return counts


def dumps(records: Iterable[LineRecord]) -> str:
    """The records as JSON Lines text (each record one line, each line ending in a newline)."""
    # allow_nan=False: a non-finite float that escaped `encode_number` is a bug, never a silent `Infinity`.
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
        raise JsonlError(f"cannot read {str(path)!r}: {error.strerror or error}") from error
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
            last = self.records[-1]
            text = Report(
                batch_number=self.batch,
                phase=self.phase,
                rank=self.rank,
                world_size=self.world_size,
                module_name=self.module,
                frames=frames,
                optimizer_step=last.optimizer_step,
                epoch=last.epoch,
            ).to_text()
            culprit = self.records[0].report_culprit
            # As `Report.to_text` closes it: a blank line, then the culprit line.
            return text if culprit is None else f"{text}\n\n{culprit}"
        lines = [format_batch_start(self.batch, self.rank, self.world_size), TABLE_HEADER]
        lines.extend(format_frame(frame) for frame in frames)
        return "\n".join(lines)


def _frame(records: list[LineRecord]) -> ResolvedFrame:
    first = records[0]
    entries = tuple(record.to_entry() for record in records if record.label is not None)
    return ResolvedFrame(first.module, first.class_name, first.batch, first.phase, entries)


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
