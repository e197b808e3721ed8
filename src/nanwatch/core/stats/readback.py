"""Reading measurements back to the host, in as few transfers as can be.

The only place that waits for the device: the engine reads once per check that found something (and tracing, per
traced frame). `stack_maxima` and `read_flags` make the batch check one host read per device, however many tensors;
`read_back` gives every number of the frames a report shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from nanwatch.core.stats.base import Values
from nanwatch.core.stats.measure import Measurement, StackedMeasurement
from nanwatch.core.stats.output_rows import DtypeRows, Rows
from nanwatch.core.stats.registry import extras, lead

__all__ = ["stack_maxima", "read_flags", "holds_non_finite", "ReadBack", "read_back"]


_Owner = TypeVar("_Owner")


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
        if type(measurement) is StackedMeasurement:  # read with its stack's vector, not one by one
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
    found = {group: torch.stack(values) for group, values in groups.items()}
    for rows, dtype, used in stacked.values():
        highs = rows.highs
        if len(used) != len(highs):  # some modules did not run: their parameters are not part of these frames
            highs = highs.index_select(0, torch.tensor(used, device=highs.device))
        group = (highs.device, dtype)
        found[group] = highs if group not in found else torch.cat([found[group], highs])
    for rows, dtype in whole:
        highs = rows.highs
        group = (highs.device, dtype)
        found[group] = highs if group not in found else torch.cat([found[group], highs])
    return found


def read_flags(flags: Iterable[tuple[torch.Tensor, _Owner]]) -> list[_Owner]:
    """The owners of the 0-d bool flags that are False, in order: one host read per device, however many flags."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, _Owner]]] = {}
    for flag, owner in flags:
        by_device.setdefault(flag.device, []).append((flag, owner))
    tripped = []
    for device_flags in by_device.values():
        values = torch.stack([flag for flag, _ in device_flags]).tolist()
        tripped += [owner for fine, (_, owner) in zip(values, device_flags, strict=True) if not fine]
    return tripped


def holds_non_finite(measurements: Iterable[Measurement]) -> bool:
    """True when any floating-point measurement's abs max is inf or nan (one host read per device)."""
    maxima = stack_maxima(measurements)
    return bool(read_flags((torch.isfinite(stacked).all(), None) for stacked in maxima.values()))


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
