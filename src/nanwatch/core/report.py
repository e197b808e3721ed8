"""The report: transformers' text format, its sections, and the same frames as JSON.

The frames print exactly as transformers prints them. What nanwatch adds comes after them, in sections that features
attach (the first culprit, the loss scale's history, ...): each a few lines of text and a JSON object under its own
key. Every number of a line comes from the statistics' declarations (core/stats): the lead statistic makes the two
number columns, another statistic may add text after the label.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nanwatch.core.frames import Direction, ResolvedEntry, ResolvedFrame, counter_name
from nanwatch.core.stats import registry

__all__ = [
    "MODULE_INDENT",
    "TABLE_HEADER",
    "STANDARD_SECTIONS",
    "Report",
    "ReportSection",
    "entry_to_dict",
    "format_batch_start",
    "format_entry",
    "format_frame",
    "format_module_line",
    "format_note_line",
    "frame_to_dict",
    "trailing_text",
]

# transformers writes a module line as a 17-space prefix, a space, then the name: the name starts in column 19.
MODULE_INDENT = " " * 17
TABLE_HEADER = f"{'abs min':8} {'abs max':8} metadata"
# Sections whose key the JSON report always holds (null when the section is absent), in this order.
STANDARD_SECTIONS = ("loss_scale", "culprit")


def format_batch_start(batch_number: int, rank: int, world_size: int) -> str:
    """The line that opens each traced batch (with the rank when there is more than one process)."""
    where = f" on rank {rank}" if world_size > 1 else ""
    return f"{MODULE_INDENT} *** Starting batch number={batch_number}{where} ***"


def format_module_line(module_name: str, class_name: str) -> str:
    return f"{MODULE_INDENT} {module_name} {class_name}"


def format_note_line(note: str, label: str) -> str:
    return f"{note:>17} {label}"


def trailing_text(stats: Mapping[str, Any]) -> str:
    """What the other statistics print after a line's label (nothing for the built-in ones)."""
    parts = []
    for statistic in registry.extras():
        values = stats.get(statistic.name)
        if values is not None:
            text = statistic.format(values)
            if text:
                parts.append(text)
    return "".join(f"  {part}" for part in parts)


def format_entry(entry: ResolvedEntry) -> str:
    lead = registry.lead().format(entry.range) if entry.range is not None else None
    if lead is None:
        return format_note_line(entry.note or "not a tensor", entry.label)
    # A note beside the numbers says what they were taken from: `output (sparse_coo: values)`.
    label = entry.label if entry.note is None else f"{entry.label} ({entry.note})"
    return f"{lead} {label}{trailing_text(entry.stats) if entry.stats else ''}"


def format_frame(frame: ResolvedFrame) -> str:
    lines = [format_module_line(frame.module_name, frame.shown_class)]
    lines.extend(format_entry(entry) for entry in frame.entries)
    return "\n".join(lines)


def entry_to_dict(entry: ResolvedEntry) -> dict[str, Any]:
    """An entry as the JSON report writes it: label, the lead statistic, metadata, then the other statistics."""
    data: dict[str, Any] = {"label": entry.label, **registry.lead().to_report_json(entry.range)}
    data.update(
        dtype=entry.dtype,
        shape=list(entry.shape) if entry.shape is not None else None,
        non_finite=entry.non_finite,
        note=entry.note,
    )
    for statistic in registry.extras():
        if statistic.in_report_json:
            data.update(statistic.to_report_json(entry.stats.get(statistic.name)))
    return data


def frame_to_dict(frame: ResolvedFrame) -> dict[str, Any]:
    return {
        "module": frame.module_name,
        "class": frame.shown_class,
        "batch_number": frame.batch_number,
        "phase": frame.phase,
        "entries": [entry_to_dict(entry) for entry in frame.entries],
    }


@dataclass(frozen=True)
class ReportSection:
    """What a feature adds to a report after its frames.

    Attributes:
        key: the section's key in the JSON report ("culprit", "loss_scale", ...); one section per key.
        order: sections print in ascending order.
        lines: its text, after the frames and a blank line.
        data: its JSON object.
        payload: the object behind it, for code (the `Culprit`, the `LossScaleHistory`).
        headline: for a detection no frame holds, which this section made (the guard's gradients): where the error
            message says inf/nan was found (" in the gradients about to be applied (first: 'fc.weight')").
    """

    key: str
    order: int
    lines: tuple[str, ...]
    data: Any
    payload: Any = None
    headline: str | None = None


@dataclass(frozen=True)
class Report:
    """A detection report: where inf/nan was first seen, the frames that led there, and the features' sections."""

    batch_number: int
    phase: str
    rank: int
    world_size: int
    module_name: str | None
    frames: Sequence[ResolvedFrame]
    optimizer_step: int | None = None
    epoch: int | None = None
    sections: tuple[ReportSection, ...] = field(default=())

    @property
    def header(self) -> str:
        counter = counter_name(self.phase)
        where = f" on rank {self.rank}" if self.world_size > 1 else ""
        return f"Detected inf/nan during {counter}={self.batch_number}{where}"

    def section(self, key: str) -> ReportSection | None:
        return next((section for section in self.sections if section.key == key), None)

    def with_section(self, section: ReportSection) -> Report:
        """This report with `section` added (replacing one with the same key)."""
        kept = tuple(s for s in self.sections if s.key != section.key)
        return replace(self, sections=tuple(sorted((*kept, section), key=lambda s: s.order)))

    def without_section(self, key: str) -> Report:
        """This report without the section `key` (itself when it has none)."""
        if self.section(key) is None:
            return self
        return replace(self, sections=tuple(s for s in self.sections if s.key != key))

    def with_sections(self, sections: Sequence[ReportSection]) -> Report:
        report = self
        for section in sections:
            report = report.with_section(section)
        return report

    @property
    def culprit(self) -> Any:
        """The first culprit (`nanwatch.core.features.culprit.Culprit`), when the culprit section is there."""
        found = self.section("culprit")
        return None if found is None else found.payload

    @property
    def cause(self) -> Any:
        """Why it went non-finite (`nanwatch.core.features.cause.Cause`), when the cause section is there."""
        found = self.section("cause")
        return None if found is None else found.payload

    @property
    def capsule(self) -> str | None:
        """The path of the repro capsule written for this detection, or None."""
        found = self.section("cause")
        path = found.data.get("capsule") if found is not None and isinstance(found.data, dict) else None
        return path if isinstance(path, str) else None

    @property
    def loss_scale(self) -> Any:
        """The loss scale's history (`nanwatch.core.features.loss_scale.LossScaleHistory`), under a GradScaler."""
        found = self.section("loss_scale")
        return None if found is None else found.payload

    def frames_text(self) -> str:
        """The header and the frames: exactly what transformers prints (without its surrounding blank lines)."""
        kind = "forward and backward" if any(f.direction is Direction.BACKWARD for f in self.frames) else "forward"
        lines = [self.header, f"Last {len(self.frames)} {kind} frames:", TABLE_HEADER]
        lines.extend(format_frame(frame) for frame in self.frames)
        return "\n".join(lines)

    def footer(self) -> str:
        """What follows the frames: a blank line, then each section's lines; "" without sections."""
        lines = [line for section in self.sections for line in section.lines]
        return "" if not lines else "\n\n" + "\n".join(lines)

    def to_text(self) -> str:
        """The report as transformers prints it, then nanwatch's sections after a blank line."""
        return self.frames_text() + self.footer()

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "batch_number": self.batch_number,
            "phase": self.phase,
            "rank": self.rank,
            "world_size": self.world_size,
            "optimizer_step": self.optimizer_step,
            "epoch": self.epoch,
            "module_name": self.module_name,
            "frames": [frame_to_dict(frame) for frame in self.frames],
        }
        for key in STANDARD_SECTIONS:
            found = self.section(key)
            data[key] = None if found is None else found.data
        data.update((s.key, s.data) for s in self.sections if s.key not in STANDARD_SECTIONS)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
