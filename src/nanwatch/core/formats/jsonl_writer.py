"""Writing JSON Lines: a report's or a traced frame's lines as records (`jsonl_schema.LineRecord`), and as text.

The engine's side of the format: the publisher writes report records (`files.py`), the trace feature appends the
records of each traced frame. The fields are those of the schema, filled from the resolved frames.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from nanwatch.core.formats.jsonl_schema import LineRecord
from nanwatch.core.frames import ResolvedFrame
from nanwatch.core.report import Report

__all__ = ["report_records", "trace_records", "dumps"]


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
