"""Reading the headroom monitor's numbers back to the host: only after a flag tripped, few transfers, each tensor once.

Apart from the monitor because this is the one place its slow path syncs with the device: how many transfers a
review costs is decided here, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from nanwatch.core.frames import Frame
from nanwatch.core.stats.measure import Measurement

__all__ = ["read_counts", "read_floats", "unique_measurements"]


def unique_measurements(frames: Sequence[Frame]) -> Iterable[Measurement]:
    """Each measured tensor once (an output is usually the next module's input: one measurement, two lines)."""
    seen: set[int] = set()
    for frame in frames:
        for entry in frame.entries:
            measurement = entry.measurement
            if measurement is None or measurement.abs_max is None or id(measurement) in seen:
                continue
            seen.add(id(measurement))
            yield measurement


def read_floats(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Read 0-d tensors back as Python floats: one transfer per (device, dtype) group."""
    out: list[float] = [0.0] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for indices in groups.values():
        for index, value in zip(indices, torch.stack([tensors[i] for i in indices]).tolist(), strict=True):
            out[index] = float(value)
    return out


def read_counts(vectors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Read int64 count vectors back: one transfer per device."""
    out: list[list[int]] = [[] for _ in vectors]
    groups: dict[torch.device, list[int]] = {}
    for index, vector in enumerate(vectors):
        groups.setdefault(vector.device, []).append(index)
    for indices in groups.values():
        for index, row in zip(indices, torch.stack([vectors[i] for i in indices]).tolist(), strict=True):
            out[index] = [int(v) for v in row]
    return out
