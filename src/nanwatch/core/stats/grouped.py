"""Many tensors measured at once: small tensors of one dtype and shape stacked and reduced together.

For a model of many small layers launching kernels costs more than running them, so the parameters are measured as a
few stacks (`StackPlan`, used by the cache once per batch) and the gradients' magnitudes likewise (`MagnitudePlan`,
used by the guard at every step). The numbers are those of `measure()`: a min and a max are exact however they are
grouped.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, overload

import torch

from nanwatch.core.stats.measure import ExtraKernels, Measurement, StackedMeasurement, measure, measure_extras
from nanwatch.core.stats.output_rows import DtypeRows, Rows
from nanwatch.core.stats.paths import accelerator_path, multi_tensor_kernels
from nanwatch.core.stats.pooled import GROUP_MAX_ELEMENTS, multi_tensor_range

__all__ = ["StackPlan", "measure_together", "MagnitudePlan", "as_vector"]

# measure_together(): tensors of up to this many elements are stacked with others of their shape and dtype; a stack
# holds up to _STACK_ELEMENTS elements (so its copy stays small), larger tensors are measured one by one (their
# kernels dominate their launch cost anyway).
_STACK_MAX_NUMEL = 1 << 16
_STACK_ELEMENTS = 1 << 22
# MagnitudePlan on the CPU: up to this many tensors, two per-tensor loops in C (`_foreach_*`); more are stacked.
_FOREACH_MAX_TENSORS = 256
_STACKED_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def measure_together(tensors: Sequence[torch.Tensor], kernels: ExtraKernels = ()) -> list[Measurement]:
    """`measure()` of each tensor, the lead statistic launched for many at once (see `StackPlan`)."""
    return StackPlan(tensors).measure(kernels)


class StackPlan:
    """How a list of tensors (a model's parameters) is measured together: on the CPU, small floating-point tensors of
    one device, dtype and shape are stacked and reduced in one go (three ops per stack, not two per tensor); on
    CUDA, floating-point tensors of one device and dtype, any shapes, take seven multi-tensor ops a group
    (`pooled.multi_tensor_range`, paths.py); the others are measured one by one. For a model of many small layers,
    where launching kernels costs more than running them. The numbers are those of `measure()` (a min and a max are
    exact however they are grouped). The plan is made once, for the tensors' `dtypes` then."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        # The dtypes it was made for: a tensor whose dtype changed since (`.data` replaced by `model.half()`) needs
        # a new plan.
        self.dtypes = [tensor.dtype for tensor in self.tensors]
        # Each group's tensors, dtype, and shape: one stack of tensors of that shape, or (None) a multi-tensor group
        # of one device and dtype, any shapes (on CUDA: `pooled.multi_tensor_range`).
        self.stacks: list[tuple[list[torch.Tensor], torch.dtype, torch.Size | None]] = []
        self.alone: list[int] = []
        groups: dict[tuple[torch.device, torch.dtype, torch.Size], list[int]] = {}
        multi: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, tensor in enumerate(self.tensors):
            if (
                type(tensor) in _PLAIN
                and tensor.dtype in _STACKED_DTYPES
                and tensor.layout is torch.strided
                and not tensor.is_nested
                and not tensor.is_meta
                and tensor.numel() > 0
            ):
                if multi_tensor_kernels(tensor):
                    if tensor.numel() <= GROUP_MAX_ELEMENTS and tensor.is_contiguous():
                        multi.setdefault((tensor.device, tensor.dtype), []).append(index)
                        continue
                elif tensor.numel() <= _STACK_MAX_NUMEL:
                    groups.setdefault((tensor.device, tensor.dtype, tensor.shape), []).append(index)
                    continue
            self.alone.append(index)
        self.members: list[list[int]] = []  # each group's tensors, by index
        for (_device, dtype), indices in multi.items():
            # At most GROUP_MAX_ELEMENTS elements a group: the temporaries of its measurement stay bounded.
            chunk: list[int] = []
            elements = 0
            for index in indices:
                numel = self.tensors[index].numel()
                if chunk and elements + numel > GROUP_MAX_ELEMENTS:
                    self._add_group(chunk, dtype, None)
                    chunk, elements = [], 0
                chunk.append(index)
                elements += numel
            self._add_group(chunk, dtype, None)
        for (_device, dtype, shape), indices in groups.items():
            if len(indices) < 2:
                self.alone += indices
                continue
            per_stack = max(2, _STACK_ELEMENTS // max(1, shape.numel()))
            for start in range(0, len(indices), per_stack):
                self._add_group(indices[start : start + per_stack], dtype, shape)
        # Where each tensor's measurement is: (stack, row), or (-1, its place among those measured alone).
        self.places: list[tuple[int, int]] = [(-1, 0)] * len(self.tensors)
        for number, chunk in enumerate(self.members):
            for row, index in enumerate(chunk):
                self.places[index] = (number, row)
        for position, index in enumerate(self.alone):
            self.places[index] = (-1, position)

    def _add_group(self, indices: list[int], dtype: torch.dtype, shape: torch.Size | None) -> None:
        self.stacks.append(([self.tensors[index] for index in indices], dtype, shape))
        self.members.append(indices)

    def measure(self, kernels: ExtraKernels = ()) -> list[Measurement]:
        """The measurements, in the order of the tensors given. Raises RuntimeError when a stacked tensor changed its
        shape or device since (`torch.stack` refuses): make a new plan then."""
        return list(self.measure_whole(kernels)[0])

    def measure_whole(
        self, kernels: ExtraKernels = ()
    ) -> tuple[Sequence[Measurement], list[DtypeRows], list[Measurement]]:
        """`measure()`, and what its measurements are made of: each stack's rows with its dtype, and the tensors
        measured alone (a check that reads every tensor reads these whole, not one measurement at a time). Without
        extra statistics a stacked tensor's measurement object is made when first asked for (`PlanMeasurements`)."""
        stacks: list[DtypeRows] = []
        extras: list[list[Any]] = []
        with torch.no_grad():  # no graph for the stacks of parameters that require grad
            for stack, dtype, shape in self.stacks:
                if shape is None:  # an accelerator's group: a few multi-tensor kernels, any shapes
                    stacks.append(DtypeRows(Rows(*multi_tensor_range(stack)), dtype))
                else:
                    # One column per tensor: amin/amax over dim 0 of the transposed rows run as a few long vector
                    # passes (aminmax along short rows is several times slower). min and max propagate nan, as a
                    # whole-tensor aminmax does.
                    columns = torch.stack(stack).abs_().view(len(stack), -1).t()
                    stacks.append(DtypeRows(Rows(columns.amin(0), columns.amax(0)), dtype))
                if kernels:
                    extras.append([measure_extras(tensor.detach(), kernels) for tensor in stack])
        alone = [measure(self.tensors[index], kernels) for index in self.alone]
        found = PlanMeasurements(self, stacks, alone)
        for number, stack_extras in enumerate(extras):  # launched now: the extra statistics of each stacked tensor
            for row, extra in enumerate(stack_extras):
                found.stacked(number, row).extra = extra
        return found, stacks, alone


class PlanMeasurements(Sequence[Measurement]):
    """A plan's measurements in the order of its tensors, each stacked one made when first asked for: a model of
    thousands of small parameters is measured at every batch, and most of those objects are never read (the check
    reads the stacks whole)."""

    def __init__(self, plan: StackPlan, stacks: list[DtypeRows], alone: list[Measurement]) -> None:
        self._places, self._members = plan.places, plan.members
        # Each group's shape, or for a multi-tensor group each member's, as measured (never the tensors: a frame kept
        # in the ring holds these, and a closed watcher holds nothing of the model).
        self._shapes: list[tuple[int, ...] | list[tuple[int, ...]]] = [
            [tuple(tensor.shape) for tensor in stack] if shape is None else tuple(shape)
            for stack, _, shape in plan.stacks
        ]
        self._stacks = stacks
        self._alone = alone
        self._made: list[Measurement | None] = [None] * len(plan.places)

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, index: int) -> Measurement: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Measurement]: ...
    def __getitem__(self, index: int | slice) -> Measurement | Sequence[Measurement]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        found = self._made[index]
        if found is None:
            number, row = self._places[index]
            found = self._alone[row] if number < 0 else self.stacked(number, row)
            self._made[index] = found
        return found

    def stacked(self, number: int, row: int) -> StackedMeasurement:
        """Row `row` of stack `number`, made once."""
        index = self._members[number][row]
        found = self._made[index]
        if found is None:
            rows, dtype = self._stacks[number]
            shape = self._shapes[number]
            if isinstance(shape, list):  # a multi-tensor group: each tensor its own shape
                shape = shape[row]
            found = self._made[index] = StackedMeasurement(rows, row, dtype, shape)
        assert isinstance(found, StackedMeasurement)
        return found


class MagnitudePlan:
    """How to take the largest |value| of each tensor of a list (a model's gradients, in the order of its parameters),
    made once and used at every step while the tensors keep their shapes and dtypes.

    `launch(tensors)` gives `(indices, values)` pairs: `values[k]` (a list of 0-d tensors, or a vector) is the largest
    magnitude of `tensors[indices[k]]`, inf or nan as soon as one of its values is; no host sync, and no Python object
    per tensor that the check has to stack again (it folds the lists into its own reduction). Tensors must be plain,
    strided and non-empty.

    Few device ops, whatever the number of tensors: on an accelerator one `_foreach_norm(inf)` (a multi-tensor kernel
    there) takes them all. On the CPU that op is a slow per-tensor kernel (about seven times the `abs` and `max`
    below), so a `_foreach_abs` and a `_foreach_max` take them (both per-tensor loops in C, vectorised), or, when
    bounds will do (`exact=False`), one `_foreach_norm(2)`, faster still (no temporary). Only many
    small tensors on the CPU (a model of thousands of tiny layers, where even a loop in C costs microseconds per
    tensor) are stacked by dtype and shape first, and each stack reduced in one go.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.size = len(tensors)
        self.accelerated = any(map(accelerator_path, tensors))
        self.stacks: list[list[int]] = []
        self.alone: list[int] = []
        self._takes: list[operator.itemgetter[Any]] = []
        # The tensors' kinds, by index: one list of magnitudes per (device, dtype), as the check folds them.
        self._kinds: list[list[int]] = []
        kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, tensor in enumerate(tensors):
            kinds.setdefault((tensor.device, tensor.dtype), []).append(index)
        self._kinds = list(kinds.values())
        self._kinds_of = list(map(_kind_of, tensors))
        self.stacked = not self.accelerated and len(tensors) > _FOREACH_MAX_TENSORS
        if not self.stacked:
            return
        groups: dict[tuple[torch.dtype, torch.Size], list[int]] = {}
        for index, tensor in enumerate(tensors):
            if tensor.numel() <= _STACK_MAX_NUMEL:
                groups.setdefault((tensor.dtype, tensor.shape), []).append(index)
            else:
                self.alone.append(index)
        for (_dtype, shape), indices in groups.items():
            if len(indices) < 2:
                self.alone += indices
                continue
            per_stack = max(2, _STACK_ELEMENTS // max(1, shape.numel()))
            self.stacks += [indices[start : start + per_stack] for start in range(0, len(indices), per_stack)]
        self._takes = [operator.itemgetter(*chunk) for chunk in self.stacks]  # each stack's tensors, taken in C

    def launch(
        self, tensors: Sequence[torch.Tensor], *, exact: bool = True
    ) -> list[tuple[list[int], torch.Tensor | Sequence[torch.Tensor]]]:
        """The magnitudes. With `exact` False, on the CPU: a bound of each instead, finite exactly when the tensor
        is unless it is huge (its 2-norm, in float32 at least, which overflows from about 1e19 on): one pass, no
        temporary, faster than the magnitudes; the caller confirms a bound that is not finite. Raises RuntimeError
        when a tensor's dtype or device, or a stacked tensor's shape, changed since the plan was made."""
        if len(tensors) != self.size:
            raise RuntimeError(f"planned for {self.size} tensors, given {len(tensors)}")
        with torch.no_grad():
            if not self.stacked:
                if list(map(_kind_of, tensors)) != self._kinds_of:  # a dtype or device changed: the lists would mix
                    raise RuntimeError("a tensor changed its dtype or device")
                if self.accelerated:
                    magnitudes = torch._foreach_norm(list(tensors), math.inf)
                elif exact:
                    magnitudes = torch._foreach_max(torch._foreach_abs(list(tensors)))
                else:
                    return [(indices, _bounds([tensors[i] for i in indices])) for indices in self._kinds]
                return [(indices, [magnitudes[i] for i in indices]) for indices in self._kinds]
            found: list[tuple[list[int], torch.Tensor | Sequence[torch.Tensor]]] = []
            for chunk, take in zip(self.stacks, self._takes, strict=True):
                # One column per tensor: amin/amax down the columns run as long vector passes (see StackPlan).
                columns = torch.stack(take(tensors)).view(len(chunk), -1).t()
                found.append((chunk, torch.maximum(columns.amin(0).abs_(), columns.amax(0).abs_())))
            if self.alone:
                by_dtype: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
                for index in self.alone:
                    low, high = torch.aminmax(tensors[index])
                    indices, ends = by_dtype.setdefault(tensors[index].dtype, ([], []))
                    indices.append(index)
                    ends += (low, high)
                for indices, ends in by_dtype.values():
                    pairs = torch.stack(ends).view(-1, 2).abs_()
                    found.append((indices, pairs.amax(1)))
            return found


_kind_of = operator.attrgetter("device", "dtype")


def _bounds(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm (tensors of one dtype): inf or nan when a value is, and from finite values only when
    their squares overflow (float32 at least: from about 1e19 on)."""
    wide = None if tensors[0].dtype == torch.float64 else torch.float32
    return list(torch._foreach_norm(tensors, 2, dtype=wide))


def as_vector(values: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Magnitudes as one vector (the slow path's read): a list of 0-d tensors stacked."""
    return values.reshape(-1) if isinstance(values, torch.Tensor) else torch.stack(list(values))
