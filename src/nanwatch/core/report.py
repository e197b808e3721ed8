"""The report: transformers' text format, and the same frames as structured data."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanwatch.core.culprit import Culprit
from nanwatch.core.frames import ResolvedEntry, ResolvedFrame
from nanwatch.core.gradients import is_backward_frame
from nanwatch.core.headroom import underflow_to_dict

if TYPE_CHECKING:
    from nanwatch.core.amp import LossScaleHistory  # amp builds reports: imported for the annotation only

__all__ = [
    "MODULE_INDENT",
    "TABLE_HEADER",
    "Report",
    "format_batch_start",
    "format_entry",
    "format_frame",
    "format_module_line",
    "format_value_line",
    "format_note_line",
]

# transformers writes a module line as a 17-space prefix, a space, then the name: the name starts in column 19.
MODULE_INDENT = " " * 17
TABLE_HEADER = f"{'abs min':8} {'abs max':8} metadata"


def format_batch_start(batch_number: int, rank: int, world_size: int) -> str:
    """The line that opens each traced batch (with the rank when there is more than one process)."""
    where = f" on rank {rank}" if world_size > 1 else ""
    return f"{MODULE_INDENT} *** Starting batch number={batch_number}{where} ***"


def format_module_line(module_name: str, class_name: str) -> str:
    return f"{MODULE_INDENT} {module_name} {class_name}"


def format_value_line(abs_min: float | int, abs_max: float | int, label: str) -> str:
    return f"{abs_min:8.2e} {abs_max:8.2e} {label}"


def format_note_line(note: str, label: str) -> str:
    return f"{note:>17} {label}"


def format_entry(entry: ResolvedEntry) -> str:
    if entry.abs_min is None or entry.abs_max is None:
        return format_note_line(entry.note or "not a tensor", entry.label)
    return format_value_line(entry.abs_min, entry.abs_max, entry.label)


def format_frame(frame: ResolvedFrame) -> str:
    lines = [format_module_line(frame.module_name, frame.class_name)]
    lines.extend(format_entry(entry) for entry in frame.entries)
    return "\n".join(lines)


def _json_number(value: float | int | None) -> float | int | str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf": JSON has no literal for them
    return value


@dataclass(frozen=True)
class Report:
    """A detection report: where inf/nan was first seen and the frames that led there."""

    batch_number: int
    phase: str
    rank: int
    world_size: int
    module_name: str | None
    frames: Sequence[ResolvedFrame]
    optimizer_step: int | None = None
    epoch: int | None = None
    loss_scale: LossScaleHistory | None = None  # under a GradScaler: the scale over the run
    culprit: Culprit | None = None  # the module that made the first inf/nan (core/culprit.py)

    @property
    def header(self) -> str:
        counter = "batch_number" if self.phase == "train" else f"{self.phase}_batch_number"
        where = f" on rank {self.rank}" if self.world_size > 1 else ""
        return f"Detected inf/nan during {counter}={self.batch_number}{where}"

    def to_text(self) -> str:
        """The report as transformers prints it (without its surrounding blank lines)."""
        kind = "forward and backward" if any(is_backward_frame(frame) for frame in self.frames) else "forward"
        lines = [self.header, f"Last {len(self.frames)} {kind} frames:", TABLE_HEADER]
        lines.extend(format_frame(frame) for frame in self.frames)
        if self.culprit is not None:
            # After a blank line, so the frames above stay exactly transformers' format.
            lines += ["", self.culprit.message]
        if self.loss_scale is not None:
            lines += ([] if self.culprit is not None else [""]) + [self.loss_scale.to_text()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_number": self.batch_number,
            "phase": self.phase,
            "rank": self.rank,
            "world_size": self.world_size,
            "optimizer_step": self.optimizer_step,
            "epoch": self.epoch,
            "module_name": self.module_name,
            "frames": [
                {
                    "module": frame.module_name,
                    "class": frame.class_name,
                    "batch_number": frame.batch_number,
                    "phase": frame.phase,
                    "entries": [
                        {
                            "label": entry.label,
                            "abs_min": _json_number(entry.abs_min),
                            "abs_max": _json_number(entry.abs_max),
                            "dtype": entry.dtype,
                            "shape": list(entry.shape) if entry.shape is not None else None,
                            "non_finite": entry.non_finite,
                            "note": entry.note,
                            # Only with count_underflow, so reports without it keep their exact shape.
                            **({} if entry.underflow is None else {"underflow": underflow_to_dict(entry.underflow)}),
                        }
                        for entry in frame.entries
                    ],
                }
                for frame in self.frames
            ],
            "loss_scale": None if self.loss_scale is None else self.loss_scale.to_dict(),
            "culprit": None if self.culprit is None else self.culprit.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
