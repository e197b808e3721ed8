"""The frames of deferred calls (deferral.py), and what the check reads of them instead of their lines.

A deferred call's frame is made as the call returns, from one tuple; its output is measured at the check with the
other outputs deferred since the last one (`DeferredOutputs`: one stack per dtype, shape and device, most often one
in all), and its lines are made only when something reads them. Of a clean batch most never are: the check reads the
stacks, the inputs measured at the calls and the parameters' batch measurement whole (`Settled`), and only the ring's
last frames are ever shown.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nanwatch.core.frames import Direction, Entry, Frame, Role
from nanwatch.core.stats.cache import TrackedBatch
from nanwatch.core.stats.measure import Measurement, StackedMeasurement, measure
from nanwatch.core.stats.output_rows import Rows
from nanwatch.core.walk import OUTPUT_LABEL, input_label

__all__ = [
    "CHANGED_AFTER_CALL",
    "DEFERRED_DTYPES",
    "DeferredFrame",
    "DeferredOutputs",
    "FrameSource",
    "Named",
    "Settled",
]

_PARAMETER, _INPUT, _OUTPUT, _FORWARD = Role.PARAMETER, Role.INPUT, Role.OUTPUT, Direction.FORWARD
_INPUT_0 = input_label(0)
# What a deferred output's line says when it was changed in place after its call, before the check measured it.
CHANGED_AFTER_CALL = "changed in place after the call: not measured"
# The dtypes of the outputs deferred: a stack of them measures each exactly.
DEFERRED_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))
_STRIDED = torch.strided


class Settled:
    """What the frames made from deferred calls hold, so that the check's screen need not read them line by line:
    the stacks their outputs were measured in (every row belongs to one of those frames), the inputs measured at the
    call, and their modules' parameters (once per module and batch measurement).

    Args:
        parameter_sites: how many watched modules have parameters: when that many deferred modules' parameters are
            here, all from one batch measurement, the check reads that measurement whole.
    """

    __slots__ = ("stacks", "inputs", "parameters", "batches", "parameter_sites")

    def __init__(self, parameter_sites: int = 0) -> None:
        self.stacks: list[tuple[Rows, torch.dtype]] = []
        self.inputs: list[Measurement] = []
        self.parameters: list[tuple[TrackedBatch, list[tuple[str, int]]]] = []  # per module: the batch, its rows
        self.batches: list[TrackedBatch] = []  # the batch measurements in `parameters`, each once
        self.parameter_sites = parameter_sites

    def reads(self) -> tuple[list[tuple[Rows, torch.dtype]], list[Measurement]]:
        """What the screen reads for these frames: stacks to read whole, and measurements one by one."""
        measurements = list(self.inputs)
        parameters = self.parameters
        if len(self.batches) == 1 and len(parameters) == self.parameter_sites:  # every module's: the measurement
            (batch,) = self.batches  # whole
            measurements += batch.alone
            return self.stacks + batch.stacks, measurements
        for batch, named in parameters:
            found = batch.measurements
            measurements += [found[row] for _, row in named]
        return self.stacks, measurements


class Named(Protocol):
    """What a deferred frame reads of its module's site (core/engine/recording/deferral.py's `Site`)."""

    name: str
    class_name: str


# What a deferred call's frame is made from, kept as the call returns: its module's site, `(micro-batch, phase)`, the
# parameters' batch measurement with the names and rows of the module's parameters in it, the input (a measurement
# made at the call, or where the deferred output it is was kept) and where its output was kept (`DeferredOutputs`).
FrameSource = tuple[
    Named,
    tuple[int, str],
    "TrackedBatch | None",
    list[tuple[str, int]],
    "Measurement | int",
    int,
    "DeferredOutputs",
]


class DeferredFrame(Frame):
    """The frame of a deferred call, made as the call returns from one tuple (`FrameSource`: one slot to set per
    frame, the fields read from it); its lines are made when first read, after its round's outputs were measured.
    Its fields are its call's: they cannot be set."""

    __slots__ = ("_source", "_lines")
    _source: FrameSource
    _lines: list[Entry]
    direction = _FORWARD  # a class attribute: deferred calls are forward calls

    @property
    def module_name(self) -> str:  # type: ignore[override]
        return self._source[0].name

    @property
    def class_name(self) -> str:  # type: ignore[override]
        return self._source[0].class_name

    @property
    def batch_number(self) -> int:  # type: ignore[override]
        return self._source[1][0]

    @property
    def phase(self) -> str:  # type: ignore[override]
        return self._source[1][1]

    @property
    def entries(self) -> list[Entry]:
        try:
            return self._lines
        except AttributeError:  # not read yet
            pass
        _, _, tracked, named, source, at, outputs = self._source
        lines = [] if tracked is None else [Entry(name, _PARAMETER, tracked.measurements[i]) for name, i in named]
        found = outputs.measurement(source) if isinstance(source, int) else source
        lines.append(Entry(_INPUT_0, _INPUT, found))
        lines.append(Entry(OUTPUT_LABEL, _OUTPUT, outputs.measurement(at)))
        self._lines = lines
        return lines

    @entries.setter
    def entries(self, lines: list[Entry]) -> None:
        self._lines = lines


class DeferredOutputs:
    """The outputs deferred in one round (between two settlements), each kept with its version counter at the call
    in one flat list (`kept`: output, version, output, version...: one `+=` per call), where a frame names its
    output by position; `measure` stacks them (one stack when they share a dtype, shape and device, as a chain of
    small modules' outputs do; else one per dtype, shape and device) and lets them go. A row's measurement object is
    made once however many lines show it (an output is the next module's input, and its container's output: the
    checks count a tensor once by its measurement)."""

    __slots__ = ("kept", "dtype", "mixed", "_groups", "_where", "_tensors", "_changed")

    def __init__(self) -> None:
        self.kept: list[torch.Tensor | int] = []  # until measured
        self.dtype: torch.dtype | None = None  # the first output's dtype, and whether another was admitted since
        self.mixed = False
        self._groups: list[_OutputGroup | _AloneGroup] = []
        # Each output's group and row, with several groups.
        self._where: list[tuple[_OutputGroup | _AloneGroup, int]] | None = None
        self._tensors: list[torch.Tensor] | None = None  # the outputs alone, once `changed` took them from `kept`
        # The outputs changed in place after their calls, by row: not measured (the values now are not what the call
        # returned), each shown as such (`measurement`).
        self._changed: dict[int, Measurement] = {}

    def admits(self, dtype: torch.dtype) -> bool:
        """Whether an output of `dtype` (not the round's first) can be deferred: a floating-point dtype a stack
        measures exactly. Asked before it is kept (the dtypes are known without reading every output again)."""
        if dtype not in DEFERRED_DTYPES:
            return False
        if self.dtype is None:
            self.dtype = dtype
        else:
            self.mixed = True
        return True

    def changed(self) -> list[int]:
        """Where the outputs changed in place since their calls (their version counters moved) were kept."""
        kept = self.kept
        tensors: list[torch.Tensor] = kept[0::2]  # type: ignore[assignment]
        self._tensors = tensors  # `measure` stacks the same list
        if [tensor._version for tensor in tensors] == kept[1::2]:
            return []
        rows = [row for row, tensor in enumerate(tensors) if tensor._version != kept[2 * row + 1]]
        for row in rows:
            tensor = tensors[row]
            self._changed[row] = Measurement(None, None, tensor.dtype, tuple(tensor.shape), skipped=CHANGED_AFTER_CALL)
            # Its row of the stack holds zeros: what the caller wrote there later is neither shown nor screened.
            tensors[row] = torch.zeros_like(tensor)
        return [2 * row for row in rows]

    def measure(self) -> list[tuple[Rows, torch.dtype]]:
        """Measure the outputs, their abs min and max (exact however grouped; nan propagates): the stacks' rows and
        dtypes. The outputs are let go."""
        tensors: list[torch.Tensor] = self._tensors if self._tensors is not None else self.kept[0::2]  # type: ignore[assignment]
        self.kept, self._tensors = [], None
        if not tensors:
            return []
        first = tensors[0]
        if not self.mixed:
            try:  # one stack: refused (RuntimeError) when shapes, devices or layouts differ
                stacked = torch.stack(tensors)
            except RuntimeError:
                pass
            else:
                if _measurable(stacked):
                    whole = _OutputGroup(stacked, first.dtype, tuple(first.shape))
                    self._groups = [whole]
                    return [(whole.rows, first.dtype)]
        groups: dict[tuple[torch.dtype, torch.Size, torch.device], list[int]] = {}
        try:
            for row, tensor in enumerate(tensors):
                groups.setdefault((tensor.dtype, tensor.shape, tensor.device), []).append(row)
        except RuntimeError:  # a nested tensor has no shape: each output measured on its own
            groups = {(first.dtype, torch.Size(), first.device): list(range(len(tensors)))}
        where: list[tuple[_OutputGroup | _AloneGroup, int]] = [None] * len(tensors)  # type: ignore[list-item]
        read: list[tuple[Rows, torch.dtype]] = []
        for (dtype, shape, _), rows in groups.items():
            group = _group([tensors[row] for row in rows], dtype, tuple(shape))
            read += group.read()
            self._groups.append(group)
            for place, row in enumerate(rows):
                where[row] = (group, place)
        self._where = where
        return read

    def measurement(self, at: int) -> Measurement:
        """The measurement of the output kept at `at` (after `measure`)."""
        if self._changed:
            changed = self._changed.get(at >> 1)
            if changed is not None:
                return changed
        where = self._where
        if where is None:
            return self._groups[0].measurement(at >> 1)
        group, row = where[at >> 1]
        return group.measurement(row)


def _measurable(stacked: torch.Tensor) -> bool:
    """Whether a stack of outputs can be measured as one: strided and holding values (not sparse, meta or empty)."""
    return stacked.layout is _STRIDED and not stacked.is_meta and stacked.numel() > 0


def _group(tensors: list[torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...]) -> _OutputGroup | _AloneGroup:
    """Outputs of one dtype, shape and device, measured as one stack; or each on its own where a stack cannot be
    (sparse, nested, meta or empty outputs, met once a module was deferred)."""
    try:
        stacked = torch.stack(tensors)
    except RuntimeError:  # layouts differ, or a layout torch cannot stack
        return _AloneGroup(tensors)
    return _OutputGroup(stacked, dtype, shape) if _measurable(stacked) else _AloneGroup(tensors)


class _OutputGroup:
    """Deferred outputs of one dtype, shape and device, measured as one stack (`rows`), and the rows' measurement
    objects made so far."""

    __slots__ = ("rows", "dtype", "shape", "made")

    def __init__(self, stacked: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        values = stacked.abs_().view(len(stacked), -1)
        self.rows = Rows(values.amin(1), values.amax(1))
        self.dtype, self.shape = dtype, shape
        self.made: dict[int, StackedMeasurement] = {}

    def read(self) -> list[tuple[Rows, torch.dtype]]:
        return [(self.rows, self.dtype)]

    def measurement(self, row: int) -> StackedMeasurement:
        found = self.made.get(row)
        if found is None:
            found = self.made[row] = StackedMeasurement(self.rows, row, self.dtype, self.shape)
        return found


class _AloneGroup:
    """Deferred outputs a stack cannot measure, each measured on its own as a call recorded as it returns would be
    (`measure`: a sparse tensor's values, a note for a meta or empty one); their abs maxima are stacked for the
    screen."""

    __slots__ = ("made",)

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.made = [measure(tensor) for tensor in tensors]

    def read(self) -> list[tuple[Rows, torch.dtype]]:
        """The measured rows' abs min and max, stacked by device and dtype (those with no numbers left out)."""
        kinds: dict[tuple[torch.device, torch.dtype, torch.dtype | None], list[Measurement]] = {}
        for found in self.made:
            if found.abs_max is not None and found.abs_max.is_floating_point():
                kinds.setdefault((found.abs_max.device, found.abs_max.dtype, found.dtype), []).append(found)
        return [
            (Rows(torch.stack([m.abs_min for m in made]), torch.stack([m.abs_max for m in made])), dtype)  # type: ignore[misc]
            for (_, _, dtype), made in kinds.items()
            if dtype is not None
        ]

    def measurement(self, row: int) -> Measurement:
        return self.made[row]
