"""Reading JSON Lines back: a file's records, cut into reports and traced batches (`Block`), each of which gives back
exactly the text nanwatch wrote.

The tools' side of the format (`nanwatch show`, `diff`, `plot`): it imports no torch, so they start without it.
A file that is not one nanwatch wrote is a `JsonlError` that names the line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nanwatch.core.formats.jsonl_schema import LineRecord
from nanwatch.core.frames import ResolvedFrame
from nanwatch.core.report import TABLE_HEADER, Report, format_batch_start, format_frame
from nanwatch.errors import JsonlError

__all__ = ["Block", "read_records", "split_blocks", "parse_source", "read_blocks"]


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
