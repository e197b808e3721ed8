"""Frames (one per module call, forward or backward), their entries, and the ring that keeps the last few.

Meaning lives in types: a frame's `direction` says forward or backward, an entry's `role` says parameter, input,
output or loss. The text labels (`input[0]`, `grad output`) are made once, where an entry is recorded, and only ever
shown; nothing reads meaning back from them.

No torch at import: the tools that read reports (`nanwatch show`, `diff`, `plot`) use the resolved side only.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanwatch.core.stats.base import Values

if TYPE_CHECKING:
    from nanwatch.core.stats.measure import Measurement

__all__ = [
    "BACKWARD_SUFFIX",
    "RECOMPUTE_SUFFIX",
    "Direction",
    "Entry",
    "Frame",
    "FrameRing",
    "RecordedFrame",
    "GRAD_PREFIX",
    "ResolvedEntry",
    "ResolvedFrame",
    "Role",
    "resolve",
    "counter_name",
    "shown_class",
]

# How a backward frame's class and lines are shown: `Linear (backward)`, `grad output`, `grad weight`; and a forward
# that activation checkpointing runs again during backward: `Linear (recompute)`.
BACKWARD_SUFFIX = " (backward)"
RECOMPUTE_SUFFIX = " (recompute)"
GRAD_PREFIX = "grad "


def counter_name(phase: str) -> str:
    """How reports, errors and logs name a phase's micro-batch counter: `batch_number` for training (the name
    transformers' tool uses), `eval_batch_number` for evaluation."""
    return "batch_number" if phase == "train" else f"{phase}_batch_number"


class Direction(enum.Enum):
    """When a frame was recorded: as a module's forward returned, as autograd produced its gradients, or as a forward
    ran again during backward to recompute what activation checkpointing did not keep."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"


class Role(enum.Enum):
    """What an entry is to its module call. In a backward frame it is the gradient w.r.t. that tensor."""

    PARAMETER = "parameter"  # the module's own parameter (`weight`, `bias`, ...)
    INPUT = "input"  # a positional or keyword input (`input[0]`, `input.attention_mask`)
    OUTPUT = "output"  # what the call returned (`output`, `output[0]`, `output.logits`)
    LOSS = "loss"  # a loss given to `watch_loss`, computed outside the watched modules


@dataclass(slots=True)
class Entry:
    """One line of a frame: a parameter, an input or an output, with its measurement or a note instead."""

    label: str
    role: Role
    measurement: Measurement | None = None
    note: str | None = None  # set instead of a measurement: "None", "not a tensor", "nested too deep", ...


class Frame:
    """What one call of one module saw: its own parameters, its inputs and its outputs (or their gradients).

    What every reader of a frame may read. Two kinds hold it: a `RecordedFrame` holds its lines as they were made at the
    call; a deferred call's frame (core/engine/recording/deferred_frames.py) makes them when first read.
    """

    __slots__ = ()

    @property
    def module_name(self) -> str:
        raise NotImplementedError

    @property
    def class_name(self) -> str:
        raise NotImplementedError

    @property
    def batch_number(self) -> int:
        raise NotImplementedError

    @property
    def phase(self) -> str:
        raise NotImplementedError

    @property
    def entries(self) -> list[Entry]:
        raise NotImplementedError

    @property
    def direction(self) -> Direction:
        raise NotImplementedError


@dataclass(slots=True)
class RecordedFrame(Frame):
    """A frame whose lines were made as its call returned (or as its gradients were produced)."""

    module_name: str
    class_name: str
    batch_number: int
    phase: str = "train"
    entries: list[Entry] = field(default_factory=list)
    direction: Direction = Direction.FORWARD


@dataclass(slots=True, frozen=True)
class ResolvedEntry:
    """An entry whose numbers have been read back from the device.

    Attributes:
        abs_min, abs_max: the lead statistic; None when the line has a note instead.
        note: without numbers, why there are none ("None", "empty", "meta: not measured"); with them, what they were
            taken from where that is not every element as the tensor holds it ("sparse_coo: values"), else None.
        stats: the other statistics' values by statistic name (measured, or known for free), where there are any.
    """

    label: str
    role: Role
    abs_min: float | int | None
    abs_max: float | int | None
    dtype: str | None
    shape: tuple[int, ...] | None
    note: str | None
    stats: Mapping[str, Values] = field(default_factory=dict)

    @property
    def non_finite(self) -> bool:
        return isinstance(self.abs_max, float) and not math.isfinite(self.abs_max)

    @property
    def range(self) -> Values | None:
        """The lead statistic's values, or None for a line without numbers."""
        return None if self.abs_max is None else (self.abs_min, self.abs_max)


@dataclass(slots=True, frozen=True)
class ResolvedFrame:
    module_name: str
    class_name: str
    batch_number: int
    phase: str
    entries: tuple[ResolvedEntry, ...]
    direction: Direction = Direction.FORWARD

    @property
    def non_finite(self) -> bool:
        return any(entry.non_finite for entry in self.entries)

    @property
    def is_backward(self) -> bool:
        return self.direction is Direction.BACKWARD

    @property
    def shown_class(self) -> str:
        """The class as the text shows it: `Linear`, `Linear (backward)` or `Linear (recompute)`."""
        return shown_class(self.class_name, self.direction)


class FrameRing:
    """The last `size` frames of batches already checked clean.

    A bounded deque that is only ever appended to and cleared, never reassigned, so it can never grow without bound.
    """

    def __init__(self, size: int) -> None:
        self._frames: deque[Frame] = deque(maxlen=size)

    @property
    def size(self) -> int:
        return self._frames.maxlen or 0

    def extend(self, frames: Iterable[Frame]) -> None:
        if isinstance(frames, list) and len(frames) > self.size:
            frames = frames[-self.size :]  # the rest would be pushed out at once (a batch of thousands of calls)
        self._frames.extend(frames)

    def clear(self) -> None:
        self._frames.clear()

    def frames(self) -> list[Frame]:
        return list(self._frames)

    def last(self, count: int) -> list[Frame]:
        """The `count` most recent frames (fewer when the ring holds fewer), oldest first."""
        if count <= 0:
            return []
        frames = self._frames
        start = max(0, len(frames) - count)
        return [frames[index] for index in range(start, len(frames))]

    def __len__(self) -> int:
        return len(self._frames)


def shown_class(class_name: str, direction: Direction) -> str:
    """A frame's class as the text shows it, marked by when the frame was recorded."""
    if direction is Direction.BACKWARD:
        return class_name + BACKWARD_SUFFIX
    if direction is Direction.RECOMPUTE:
        return class_name + RECOMPUTE_SUFFIX
    return class_name


def resolve(frames: Sequence[Frame]) -> list[ResolvedFrame]:
    """Read every number in `frames` back to the host, a handful of transfers in all rather than one per tensor."""
    # torch only here: the reading side of the package is imported by tools that never load it.
    from nanwatch.core.stats.readback import read_back
    from nanwatch.core.stats.registry import extras

    numbers = read_back(entry.measurement for frame in frames for entry in frame.entries if entry.measurement)
    derivable = extras()
    resolved = []
    for frame in frames:
        entries = []
        for entry in frame.entries:
            m = entry.measurement
            if m is None:
                entries.append(ResolvedEntry(entry.label, entry.role, None, None, None, None, entry.note))
                continue
            dtype = str(m.dtype).replace("torch.", "") if m.dtype is not None else None
            found = numbers.get(id(m))
            if found is None:
                entries.append(ResolvedEntry(entry.label, entry.role, None, None, dtype, m.shape, m.skipped))
                continue
            abs_min, abs_max = found.range
            stats = dict(found.extra)
            for statistic in derivable:
                if statistic.name not in stats:
                    free = statistic.derive(abs_min, abs_max)
                    if free is not None:
                        stats[statistic.name] = free
            entries.append(ResolvedEntry(entry.label, entry.role, abs_min, abs_max, dtype, m.shape, m.note, stats))
        resolved.append(
            ResolvedFrame(
                frame.module_name, frame.class_name, frame.batch_number, frame.phase, tuple(entries), frame.direction
            )
        )
    return resolved
