"""A module's parameter lines, made once per batch and handed out again at every later call of that batch."""

from __future__ import annotations

from collections.abc import Mapping
from operator import is_
from typing import NamedTuple

import torch

from nanwatch.core.frames import Entry, Role
from nanwatch.core.stats.cache import StatsCache, TrackedBatch

__all__ = ["ParameterLines", "ParameterRow", "ParameterSlot"]

_PARAMETER = Role.PARAMETER
_PLAIN_PARAMETERS = (torch.nn.Parameter, torch.Tensor)


class ParameterRow(NamedTuple):
    """A module's parameter, by name, and its row in the parameters' batch measurement."""

    name: str
    row: int


class ParameterSlot(NamedTuple):
    """An item of a module's parameter dict: the tensor (None for a None), and its row in the parameters' batch
    measurement (-1 for a None)."""

    tensor: torch.Tensor | None
    row: int


class ParameterLines:
    """One module's parameter lines. Made once per batch from the parameters' batch measurements, and used again at
    every later call of the batch; asked of the cache one by one only when a parameter is not tracked, or was changed
    (version counter, storage) or replaced since it was measured. Each call then costs a check of the parameters'
    fingerprints, not a lookup per parameter, and the calls of a batch share the line objects (fewer objects for the
    garbage collector to walk)."""

    __slots__ = ("batch", "entries", "slots", "named", "remade", "tensors")

    def __init__(self) -> None:
        self.batch: TrackedBatch | None = None  # the batch whose measurements `entries` hold
        self.entries: list[Entry] = []
        # Per item of the module's parameter dict, the tensor and its row; None until made, or when not every
        # parameter is tracked.
        self.slots: list[ParameterSlot] | None = None
        self.named: list[ParameterRow] = []
        # A parameter was found changed or replaced since its batch measurement (lines made again, `_make`).
        self.remade = False
        # The module's parameter dict's values when the lines were made (None included), compared by identity at
        # every deferred call (`holds`).
        self.tensors: tuple[torch.Tensor | None, ...] = ()

    def lines(self, params: Mapping[str, torch.Tensor | None], cache: StatsCache) -> list[Entry]:
        batch = cache.tracked_batch() if self.slots is not None else None
        if batch is None or not self.unchanged(params, batch):
            return self._make(params, cache)
        # Unchanged since measured: the same objects, with the version counters and storage they had then.
        if self.batch is not batch:  # the module's first call of this batch
            measurements = batch.measurements
            self.entries = [Entry(named.name, _PARAMETER, measurements[named.row]) for named in self.named]
            self.batch = batch
        return self.entries.copy()

    def unchanged(self, params: Mapping[str, torch.Tensor | None], batch: TrackedBatch) -> bool:
        """Every parameter is tracked and has not changed since `batch` measured it (a deferred call's check: its
        lines are made later, from `named` and the batch's measurements). A change found marks the lines `remade`."""
        slots = self.slots
        if slots is None or len(params) != len(slots):
            return False
        versions, pointers = batch.versions, batch.pointers
        for param, slot in zip(params.values(), slots):  # noqa: B905  (lengths compared)
            if param is not slot.tensor or (
                param is not None and (param._version != versions[slot.row] or param.data_ptr() != pointers[slot.row])
            ):
                self.remade = True
                return False
        return True

    def holds(self, params: Mapping[str, torch.Tensor | None]) -> bool:
        """The module's parameter dict holds the very tensors the lines were made from (compared by identity, in C):
        not others swapped in for one call (`torch.func.functional_call`)."""
        tensors = self.tensors
        return len(params) == len(tensors) and all(map(is_, params.values(), tensors))

    @property
    def stable(self) -> bool:
        """Every parameter is tracked, and none was found changed since its batch measurement: what deferring a call
        needs (core/engine/recording/recorder.py checks a deferred module's parameters at its first call of a batch
        only)."""
        return self.slots is not None and not self.remade

    def _make(self, params: Mapping[str, torch.Tensor | None], cache: StatsCache) -> list[Entry]:
        entries: list[Entry] = []
        slots: list[ParameterSlot] = []
        named: list[ParameterRow] = []
        tracked = True
        for name, param in params.items():
            if param is None:
                slots.append(ParameterSlot(None, -1))
                continue
            entries.append(Entry(name, _PARAMETER, cache.parameter(param)))
            plain = type(param) in _PLAIN_PARAMETERS and param.layout is torch.strided
            index = cache.index_of(param) if plain else None
            if index is None:  # measured apart (an inference or sparse tensor, a DTensor): asked for at every call
                tracked = False
            else:
                slots.append(ParameterSlot(param, index))
                named.append(ParameterRow(name, index))
        self.slots, self.named = (slots if tracked else None), named
        self.tensors = tuple(params.values())
        self.batch = None  # these lines may hold a changed parameter's own measurement, not the batch's
        return entries
