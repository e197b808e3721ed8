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

__all__ = ["StackPlan", "measure_together", "MagnitudePlan"]

# measure_together(): tensors of up to this many elements are stacked with others of their shape and dtype; a stack
# holds up to _STACK_ELEMENTS elements (so its copy stays small), larger tensors are measured one by one (their
# kernels dominate their launch cost anyway).
_STACK_MAX_NUMEL = 1 << 16
_STACK_ELEMENTS = 1 << 22
_STACKED_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def measure_together(tensors: Sequence[torch.Tensor], kernels: ExtraKernels = ()) -> list[Measurement]:
    """`measure()` of each tensor, the lead statistic launched for many at once (see `StackPlan`)."""
    return StackPlan(tensors).measure(kernels)


class StackPlan:
    """How a list of tensors (a model's parameters) is measured together: small floating-point tensors of one device,
    dtype and shape are stacked and reduced in one go (three kernel launches per stack, not two per tensor), the
    others measured one by one. For a model of many small layers, where launching kernels costs more than running
    them. The numbers are those of `measure()` (a min and a max are exact however they are grouped). The plan is made
    once, for the tensors' `dtypes` then."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        # The dtypes it was made for: a tensor whose dtype changed since (`.data` replaced by `model.half()`) needs
        # a new plan.
        self.dtypes = [tensor.dtype for tensor in self.tensors]
        self.stacks: list[tuple[list[torch.Tensor], torch.dtype, torch.Size]] = []
        self.alone: list[int] = []
        groups: dict[tuple[torch.device, torch.dtype, torch.Size], list[int]] = {}
        for index, tensor in enumerate(self.tensors):
            if (
                type(tensor) in _PLAIN
                and tensor.dtype in _STACKED_DTYPES
                and tensor.layout is torch.strided
                and not tensor.is_meta
                and 0 < tensor.numel() <= _STACK_MAX_NUMEL
            ):
                groups.setdefault((tensor.device, tensor.dtype, tensor.shape), []).append(index)
            else:
                self.alone.append(index)
        self.members: list[list[int]] = []  # each stack's tensors, by index
        for (_device, dtype, shape), indices in groups.items():
            if len(indices) < 2:
                self.alone += indices
                continue
            per_stack = max(2, _STACK_ELEMENTS // max(1, shape.numel()))
            for start in range(0, len(indices), per_stack):
                chunk = indices[start : start + per_stack]
                self.stacks.append(([self.tensors[index] for index in chunk], dtype, shape))
                self.members.append(chunk)
        # Where each tensor's measurement is: (stack, row), or (-1, its place among those measured alone).
        self.places: list[tuple[int, int]] = [(-1, 0)] * len(self.tensors)
        for number, chunk in enumerate(self.members):
            for row, index in enumerate(chunk):
                self.places[index] = (number, row)
        for position, index in enumerate(self.alone):
            self.places[index] = (-1, position)

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
            for stack, dtype, _ in self.stacks:
                # One column per tensor: amin/amax over dim 0 of the transposed rows run as a few long vector passes
                # (aminmax along short rows is several times slower). min and max propagate nan, as a whole-tensor
                # aminmax does.
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
        self._shapes = [tuple(shape) for _, _, shape in plan.stacks]
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
            found = self._made[index] = StackedMeasurement(rows, row, dtype, self._shapes[number])
        assert isinstance(found, StackedMeasurement)
        return found


class MagnitudePlan:
    """How to take the largest |value| of each tensor of a list (a model's gradients, in the order of its parameters),
    made once and used at every step while the tensors keep their shapes and dtypes.

    `launch(tensors)` gives `(indices, vector)` pairs: `vector[k]` is the largest magnitude of `tensors[indices[k]]`,
    inf or nan as soon as one of its values is; no host sync, and no Python object per tensor (the check reads the
    vectors whole). Tensors must be plain, strided and non-empty. On an accelerator one `_foreach_norm(inf)`, a
    multi-tensor kernel there, takes them all. On the CPU that is a slow per-tensor kernel (about five times an
    `aminmax` over the same tensor), so each tensor's min and max are taken in one pass (both propagate nan, and an
    inf shows in one of them), small tensors of one dtype and shape stacked together first.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.size = len(tensors)
        self.accelerated = not all(tensor.is_cpu for tensor in tensors)
        self.stacks: list[list[int]] = []
        self.alone: list[int] = []
        self._takes: list[operator.itemgetter[Any]] = []
        if self.accelerated:
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

    def launch(self, tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
        """The magnitudes. Raises RuntimeError when a stacked tensor's shape changed since the plan was made."""
        if len(tensors) != self.size:
            raise RuntimeError(f"planned for {self.size} tensors, given {len(tensors)}")
        with torch.no_grad():
            if self.accelerated:
                norms = torch._foreach_norm(list(tensors), math.inf)
                by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
                for index, norm in enumerate(norms):
                    by_kind.setdefault((norm.device, norm.dtype), []).append(index)
                return [(indices, torch.stack([norms[i] for i in indices])) for indices in by_kind.values()]
            found = []
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
