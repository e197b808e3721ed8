"""Frames (one per module call) and the ring that keeps the last few of them."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from nanwatch.core.stats import Measurement

__all__ = ["Entry", "Frame", "FrameRing", "ResolvedEntry", "ResolvedFrame", "resolve", "find_non_finite"]


@dataclass(slots=True)
class Entry:
    """One line of a frame: a parameter, an input or an output."""

    label: str
    measurement: Measurement | None = None
    note: str | None = None  # set instead of a measurement: "None", "not a tensor", "nested too deep", ...


@dataclass(slots=True)
class Frame:
    """What one call of one module saw: its own parameters, its inputs and its outputs."""

    module_name: str
    class_name: str
    batch_number: int
    phase: str = "train"
    entries: list[Entry] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class ResolvedEntry:
    """An entry whose numbers have been read back from the device."""

    label: str
    abs_min: float | int | None
    abs_max: float | int | None
    dtype: str | None
    shape: tuple[int, ...] | None
    note: str | None
    # With count_underflow: (subnormal, target_subnormal, target_zero), -1 where no target applies; see headroom.py.
    underflow: tuple[int, ...] | None = None

    @property
    def non_finite(self) -> bool:
        return isinstance(self.abs_max, float) and not math.isfinite(self.abs_max)


@dataclass(slots=True, frozen=True)
class ResolvedFrame:
    module_name: str
    class_name: str
    batch_number: int
    phase: str
    entries: tuple[ResolvedEntry, ...]

    @property
    def non_finite(self) -> bool:
        return any(entry.non_finite for entry in self.entries)


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
        self._frames.extend(frames)

    def clear(self) -> None:
        self._frames.clear()

    def frames(self) -> list[Frame]:
        return list(self._frames)

    def __len__(self) -> int:
        return len(self._frames)


def _measurements(frames: Sequence[Frame]) -> Iterable[Measurement]:
    for frame in frames:
        for entry in frame.entries:
            if entry.measurement is not None and entry.measurement.abs_max is not None:
                yield entry.measurement


def find_non_finite(frames: Sequence[Frame]) -> bool:
    """True when any float measurement in `frames` is inf or nan. One host sync per device, however many tensors.

    Runs once per batch over every entry recorded in it, so it is kept lean: a measurement shared by several entries
    (an output that is the next module's input) is looked at once, and the groups are keyed by dtype and device.
    """
    by_group: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for frame in frames:
        for entry in frame.entries:
            measurement = entry.measurement
            if measurement is None:
                continue
            maximum = measurement.abs_max
            # abs_max is nan when any value is nan, inf when any is inf: it alone decides.
            if maximum is None or not maximum.is_floating_point() or id(measurement) in seen:
                continue
            seen.add(id(measurement))
            key = (maximum.dtype, maximum.device)
            group = by_group.get(key)
            if group is None:
                by_group[key] = [maximum]
            else:
                group.append(maximum)
    if not by_group:
        return False
    finite_per_device: dict[torch.device, list[torch.Tensor]] = {}
    for (_dtype, device), maxima in by_group.items():
        finite_per_device.setdefault(device, []).append(torch.isfinite(torch.stack(maxima)).all())
    return any(not bool(torch.stack(flags).all()) for flags in finite_per_device.values())


def resolve(frames: Sequence[Frame]) -> list[ResolvedFrame]:
    """Read every number in `frames` back to the host, a handful of transfers in all rather than one per tensor."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    slots: dict[int, tuple[tuple[torch.device, torch.dtype], int]] = {}
    for measurement in _measurements(frames):
        assert measurement.abs_min is not None
        assert measurement.abs_max is not None
        key = (measurement.abs_max.device, measurement.abs_max.dtype)
        group = groups.setdefault(key, [])
        slots[id(measurement)] = (key, len(group))
        group.append(measurement.abs_min)
        group.append(measurement.abs_max)
    values = {key: torch.stack(tensors).tolist() for key, tensors in groups.items()}
    underflow = _read_underflow(frames)

    resolved = []
    for frame in frames:
        entries = []
        for entry in frame.entries:
            m = entry.measurement
            if m is None:
                entries.append(ResolvedEntry(entry.label, None, None, None, None, entry.note))
                continue
            dtype = str(m.dtype).replace("torch.", "") if m.dtype is not None else None
            if m.abs_max is None:
                entries.append(ResolvedEntry(entry.label, None, None, dtype, m.shape, m.skipped))
                continue
            key, index = slots[id(m)]
            abs_min, abs_max = values[key][index], values[key][index + 1]
            counts = underflow.get(id(m)) if underflow else None
            entries.append(ResolvedEntry(entry.label, abs_min, abs_max, dtype, m.shape, None, counts))
        resolved.append(
            ResolvedFrame(frame.module_name, frame.class_name, frame.batch_number, frame.phase, tuple(entries))
        )
    return resolved


def _read_underflow(frames: Sequence[Frame]) -> dict[int, tuple[int, ...]]:
    """The underflow counts (only with count_underflow) by measurement id: one transfer per device."""
    by_device: dict[torch.device, dict[int, torch.Tensor]] = {}
    for measurement in _measurements(frames):
        if measurement.underflow is not None:
            by_device.setdefault(measurement.underflow.device, {})[id(measurement)] = measurement.underflow
    counts: dict[int, tuple[int, ...]] = {}
    for vectors in by_device.values():
        rows = torch.stack(list(vectors.values()))[:, :3].tolist()
        counts.update((key, tuple(row)) for key, row in zip(vectors, rows, strict=True))
    return counts
