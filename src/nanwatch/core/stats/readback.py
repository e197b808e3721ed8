"""Reading measurements back to the host, in as few transfers as can be.

The only place that waits for the device: the engine reads once per check that found something (and tracing, per
traced frame). `stack_maxima` and `read_flags` make the batch check one host read per device, however many tensors;
`read_back` gives every number of the frames a report shows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from nanwatch.core.stats.base import Values
from nanwatch.core.stats.measure import Measurement, StackedMeasurement
from nanwatch.core.stats.output_rows import DtypeRows, Rows
from nanwatch.core.stats.pooled import PooledMeasurement
from nanwatch.core.stats.registry import extras, lead

__all__ = ["Folded", "Screened", "fold", "stack_maxima", "read_flags", "holds_non_finite", "ReadBack", "read_back"]


_Owner = TypeVar("_Owner")
# Measurements that are rows of a vector: read with it, whole.
_ROW_MEASUREMENTS = (StackedMeasurement, PooledMeasurement)


def stack_maxima(
    measurements: Iterable[Measurement], whole: Iterable[DtypeRows] = ()
) -> dict[tuple[torch.device, torch.dtype | None], torch.Tensor]:
    """The floating-point abs maxima, each measurement once, stacked by (device, dtype of the measured tensor); and
    every row of the `whole` stacks (rows of tensors of that dtype, each in a frame: not looked for one by one)."""
    groups: dict[tuple[torch.device, torch.dtype | None], list[torch.Tensor]] = {}
    stacked: dict[int, tuple[Rows, torch.dtype | None, list[int]]] = {}
    seen: set[int] = set()
    for measurement in measurements:
        key = id(measurement)
        if key in seen:
            continue
        seen.add(key)
        if isinstance(measurement, _ROW_MEASUREMENTS):  # read with its stack's vector, not one by one
            rows = measurement.rows
            stack = stacked.get(id(rows))
            if stack is None:
                stack = stacked[id(rows)] = (rows, measurement.dtype, [])
            stack[2].append(measurement.row)
            continue
        maximum = measurement.abs_max
        # abs_max is nan when any value is nan, inf when any is inf: it alone says whether a tensor is finite.
        if maximum is None or not maximum.is_floating_point():
            continue
        groups.setdefault((maximum.device, measurement.dtype), []).append(maximum)
    # Each group's vectors, joined by one op at the end (not one per stack).
    vectors: dict[tuple[torch.device, torch.dtype | None], list[torch.Tensor]] = {
        group: [torch.stack(values)] for group, values in groups.items()
    }
    for rows, dtype, used in stacked.values():
        highs = rows.highs
        if len(used) != len(highs):  # some modules did not run: their parameters are not part of these frames
            highs = highs.index_select(0, torch.tensor(used, device=highs.device))
        vectors.setdefault((highs.device, dtype), []).append(highs)
    for rows, dtype in whole:
        highs = rows.highs
        vectors.setdefault((highs.device, dtype), []).append(highs)
    return {group: parts[0] if len(parts) == 1 else torch.cat(parts) for group, parts in vectors.items()}


Screened = torch.Tensor | Sequence[torch.Tensor]
"""What a check screens: a 0-d bool flag (True = fine), or values (a float tensor, or a list of 0-d float tensors)
that are all finite when fine."""


@dataclass(frozen=True, slots=True)
class Folded(Generic[_Owner]):
    """One device's screened parts folded into one float vector (`summary`): a value per group of parts, inf or nan
    where a part of that group tripped. Reading it is the check's one host read on that device."""

    summary: torch.Tensor
    groups: tuple[tuple[tuple[Screened, _Owner], ...], ...]

    def tripped(self, values: Sequence[float]) -> list[_Owner]:
        """The owners of the parts that tripped, given the summary read back: a tripped group of several parts (the
        slow path, once something is inf/nan) reads each part again to tell which."""
        found: list[_Owner] = []
        for value, group in zip(values, self.groups, strict=True):
            if math.isfinite(value):
                continue
            if len(group) == 1:
                found.append(group[0][1])
                continue
            found += [owner for part, owner in group if not _fine(part)]
        return list(dict.fromkeys(found))


def fold(parts: Iterable[tuple[Screened, _Owner]]) -> list[Folded[_Owner]]:
    """The parts of a check folded into as few device ops as the data allows, no host sync: per device, every float
    part of one dtype stacked (the 0-d ones) or concatenated once and summed times zero (0 when every value is finite,
    nan when one is inf or nan: a finite value times zero is zero, so the sum cannot overflow); the bool flags
    stacked and turned into 0 (fine) or nan (tripped). A group's level is 0 or nan, nothing else."""
    by_group: dict[tuple[torch.device, torch.dtype], list[tuple[Screened, _Owner]]] = {}
    for part, owner in parts:
        first = part if isinstance(part, torch.Tensor) else (part[0] if len(part) else None)
        if first is None:
            continue
        by_group.setdefault((first.device, first.dtype), []).append((part, owner))
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[tuple[tuple[Screened, _Owner], ...]]]] = {}
    for (device, dtype), group in by_group.items():
        if dtype is torch.bool:
            flags = [flag for part, _ in group for flag in ((part,) if isinstance(part, torch.Tensor) else part)]
            fine = flags[0] if len(flags) == 1 else torch.stack(flags).all()
            level = fine.float().log().mul_(0)  # log(1) * 0 = 0: fine; log(0) * 0 = -inf * 0 = nan: tripped
        else:
            scalars = [value for part, _ in group if not isinstance(part, torch.Tensor) for value in part]
            vectors = [part.reshape(-1) for part, _ in group if isinstance(part, torch.Tensor)]
            if scalars:
                vectors.insert(0, torch.stack(scalars))
            joined = vectors[0] if len(vectors) == 1 else torch.cat(vectors)
            fresh = len(vectors) > 1 or bool(scalars)  # made here: it may be changed in place
            level = (joined.mul_(0) if fresh else joined.mul(0)).sum()
        levels, groups = by_device.setdefault(device, ([], []))
        levels.append(level)
        groups.append(tuple(group))
    found = []
    for levels, groups in by_device.values():
        summary = levels[0].reshape(1) if len(levels) == 1 else torch.stack([level.float() for level in levels])
        found.append(Folded(summary, tuple(groups)))
    return found


def read_flags(parts: Iterable[tuple[Screened, _Owner]]) -> list[_Owner]:
    """The owners of the parts that tripped (a bool flag False, values holding inf/nan), in order of first trip: one
    host read per device, however many parts (`fold`)."""
    tripped: list[_Owner] = []
    for folded in fold(parts):
        tripped += folded.tripped(folded.summary.tolist())
    return list(dict.fromkeys(tripped))


def _fine(part: Screened) -> bool:
    """One part read on its own (the slow path)."""
    tensor = part if isinstance(part, torch.Tensor) else torch.stack(list(part))
    if tensor.dtype is torch.bool:
        return bool(tensor.all())
    return all(math.isfinite(value) for value in tensor.reshape(-1).tolist())


def holds_non_finite(measurements: Iterable[Measurement]) -> bool:
    """True when any floating-point measurement's abs max is inf or nan (one host read per device)."""
    maxima = stack_maxima(measurements)
    return bool(read_flags((stacked, None) for stacked in maxima.values()))


@dataclass(frozen=True, slots=True)
class ReadBack:
    """One measurement's numbers on the host: the lead statistic's values and the others', by name."""

    range: Values
    extra: dict[str, Values]


def read_back(measurements: Iterable[Measurement]) -> dict[int, ReadBack]:
    """Read every number of `measurements` to the host, keyed by `id(measurement)`: a handful of transfers in all
    (one per device and dtype for the lead statistic, one per device and statistic for the others)."""
    unique: dict[int, Measurement] = {}
    for measurement in measurements:
        if measurement.abs_max is not None:
            unique.setdefault(id(measurement), measurement)
    ranges: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    vectors: dict[tuple[torch.device, str], list[int]] = {}
    for key, measurement in unique.items():
        assert measurement.abs_max is not None
        ranges.setdefault((measurement.abs_max.device, measurement.abs_max.dtype), []).append(key)
        for name, vector in (measurement.extra or {}).items():
            vectors.setdefault((vector.device, name), []).append(key)
    values: dict[int, Values] = {}
    for keys in ranges.values():
        ends = [(unique[key].abs_min, unique[key].abs_max) for key in keys]
        stacked = torch.stack([end for pair in ends for end in pair if end is not None])  # both are, for every key
        numbers = stacked.tolist()
        for index, key in enumerate(keys):
            values[key] = lead().read(numbers[2 * index : 2 * index + 2])
    extra: dict[int, dict[str, Values]] = {key: {} for key in unique}
    by_name = {statistic.name: statistic for statistic in extras()}
    for (_device, name), keys in vectors.items():
        statistic = by_name.get(name)
        if statistic is None:  # unregistered since it was measured
            continue
        rows = _stack_rows([(unique[key].extra or {})[name] for key in keys])  # each key has this vector
        for key, row in zip(keys, rows, strict=True):
            extra[key][name] = statistic.read(row)
    return {key: ReadBack(values[key], extra[key]) for key in unique}


def _stack_rows(vectors: Sequence[torch.Tensor]) -> list[list[int | float]]:
    if all(v.shape == vectors[0].shape for v in vectors):
        return torch.stack(list(vectors)).reshape(len(vectors), -1).tolist()
    return [v.reshape(-1).tolist() for v in vectors]
