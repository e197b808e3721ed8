"""The frames of deferred calls (deferral.py), and what the check reads of them instead of their lines.

A deferred call's frame (`DeferredFrame`) is made as the call returns, a record of what the call used: its module,
its micro-batch, the parameters' batch measurement, its input and where its output was kept. The output is measured at
the check with the other outputs deferred since the last one (`DeferredOutputs`: one stack per dtype, shape and
device, most often one in all), and the frame's lines are made only when something reads them. Of a clean batch most
never are: the check reads the stacks, the inputs measured at the calls and the parameters' batch measurement whole
(`Settled`), and only the ring's last frames are ever shown.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from nanwatch.core.engine.counters import Stamp
from nanwatch.core.engine.recording.parameter_lines import ParameterRow
from nanwatch.core.frames import Direction, Entry, Frame, Role
from nanwatch.core.stats.cache import TrackedBatch
from nanwatch.core.stats.measure import Measurement, StackedMeasurement, measure
from nanwatch.core.stats.output_rows import DtypeRows, Rows
from nanwatch.core.stats.paths import multi_tensor_kernels
from nanwatch.core.stats.pooled import CHANGED_AFTER_CALL, multi_tensor_range
from nanwatch.core.walk import OUTPUT_LABEL, input_label

__all__ = [
    "CHANGED_AFTER_CALL",
    "DEFERRED_DTYPES",
    "DeferredFrame",
    "DeferredOutputs",
    "ModuleParameters",
    "Named",
    "ScreenReads",
    "Settled",
]

_PARAMETER, _INPUT, _OUTPUT, _FORWARD = Role.PARAMETER, Role.INPUT, Role.OUTPUT, Direction.FORWARD
_INPUT_0 = input_label(0)
# The dtypes of the outputs deferred: a stack of them measures each exactly.
DEFERRED_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))
_STRIDED = torch.strided


class ModuleParameters(NamedTuple):
    """A deferred module's parameters, as the screen reads them: the batch measurement, and their rows in it."""

    batch: TrackedBatch
    rows: list[ParameterRow]


class ScreenReads(NamedTuple):
    """What the check's screen reads for the frames of deferred calls."""

    whole: list[DtypeRows]  # stacks read whole: every row belongs to one of the frames
    measurements: list[Measurement]  # read one by one


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
        self.stacks: list[DtypeRows] = []
        self.inputs: list[Measurement] = []
        self.parameters: list[ModuleParameters] = []  # once per module and batch measurement
        self.batches: list[TrackedBatch] = []  # the batch measurements in `parameters`, each once
        self.parameter_sites = parameter_sites

    def reads(self) -> ScreenReads:
        """What the screen reads for these frames: stacks to read whole, and measurements one by one."""
        measurements = list(self.inputs)
        parameters = self.parameters
        if len(self.batches) == 1 and len(parameters) == self.parameter_sites:  # every module's: the measurement
            (batch,) = self.batches  # whole
            measurements += batch.alone
            return ScreenReads(self.stacks + batch.stacks, measurements)
        for module in parameters:
            found = module.batch.measurements
            measurements += [found[parameter.row] for parameter in module.rows]
        return ScreenReads(self.stacks, measurements)


class Named(Protocol):
    """What a deferred frame reads of its module's site (deferral.py's `Site`)."""

    name: str
    class_name: str


class DeferredFrame(Frame):
    """The frame of a deferred call: what the call used, recorded as it returned; its lines are made when first read,
    after its round's outputs were measured. A forward frame, always.

    Args:
        site: its module.
        stamp: its micro-batch and phase.
        parameters: the parameters' batch measurement its lines name (None for a module without parameters).
        parameter_rows: the module's parameters, by name, and their rows in that measurement.
        input_measured: its input, measured at the call; or None when the input is the output of a deferred call
            before it (a chain of modules), kept at `input_row` of `outputs`.
        input_row: where in `outputs` its input was kept, or -1 when it was measured at the call.
        output_row: where in `outputs` its output was kept.
        outputs: the round's deferred outputs, measured together at the check.
    """

    __slots__ = (
        "site",
        "stamp",
        "parameters",
        "parameter_rows",
        "input_measured",
        "input_row",
        "output_row",
        "outputs",
        "_lines",
    )
    _lines: list[Entry]  # made when first read

    def __init__(
        self,
        site: Named,
        stamp: Stamp,
        parameters: TrackedBatch | None,
        parameter_rows: list[ParameterRow],
        input_measured: Measurement | None,
        input_row: int,
        output_row: int,
        outputs: DeferredOutputs,
    ) -> None:
        self.site = site
        self.stamp = stamp
        self.parameters = parameters
        self.parameter_rows = parameter_rows
        self.input_measured = input_measured
        self.input_row = input_row
        self.output_row = output_row
        self.outputs = outputs

    @property
    def module_name(self) -> str:
        return self.site.name

    @property
    def class_name(self) -> str:
        return self.site.class_name

    @property
    def batch_number(self) -> int:
        return self.stamp.batch_number

    @property
    def phase(self) -> str:
        return self.stamp.phase

    @property
    def direction(self) -> Direction:
        return _FORWARD

    @property
    def entries(self) -> list[Entry]:
        try:
            return self._lines
        except AttributeError:  # not read yet
            pass
        parameters, outputs = self.parameters, self.outputs
        lines = []
        if parameters is not None:
            found = parameters.measurements
            lines = [Entry(parameter.name, _PARAMETER, found[parameter.row]) for parameter in self.parameter_rows]
        given = self.input_measured
        lines.append(Entry(_INPUT_0, _INPUT, given if given is not None else outputs.measurement(self.input_row)))
        lines.append(Entry(OUTPUT_LABEL, _OUTPUT, outputs.measurement(self.output_row)))
        self._lines = lines
        return lines


class GroupRow(NamedTuple):
    """Where a deferred output was measured: its group, and its row there."""

    group: _OutputGroup | _AloneGroup
    row: int


class DeferredOutputs:
    """The outputs deferred in one round (between two settlements), each kept with its version counter at the call
    (`tensors[row]`, `versions[row]`), where a frame names its output by row; `measure` stacks them (one stack when
    they share a dtype, shape and device, as a chain of small modules' outputs do; else one per dtype, shape and
    device) and lets them go. A row's measurement object is made once however many lines show it (an output is the
    next module's input, and its container's output: the checks count a tensor once by its measurement)."""

    __slots__ = ("tensors", "versions", "dtype", "mixed", "_groups", "_where", "_changed")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []  # until measured
        self.versions: list[int] = []  # each output's version counter at its call
        self.dtype: torch.dtype | None = None  # the first output's dtype, and whether another was admitted since
        self.mixed = False
        self._groups: list[_OutputGroup | _AloneGroup] = []
        self._where: list[GroupRow] | None = None  # each output's group and row, with several groups
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
        """The rows of the outputs changed in place since their calls (their version counters moved)."""
        tensors, versions = self.tensors, self.versions
        if [tensor._version for tensor in tensors] == versions:
            return []
        rows = [row for row, tensor in enumerate(tensors) if tensor._version != versions[row]]
        for row in rows:
            tensor = tensors[row]
            self._changed[row] = Measurement(None, None, tensor.dtype, tuple(tensor.shape), skipped=CHANGED_AFTER_CALL)
            # Its row of the stack holds zeros: what the caller wrote there later is neither shown nor screened.
            tensors[row] = torch.zeros_like(tensor)
        return rows

    def measure(self) -> list[DtypeRows]:
        """Measure the outputs, their abs min and max (exact however grouped; nan propagates): the stacks' rows and
        dtypes. The outputs are let go."""
        tensors = self.tensors
        self.tensors, self.versions = [], []
        if not tensors:
            return []
        first = tensors[0]
        if multi_tensor_kernels(first):
            return self._measure_multi(tensors)
        if not self.mixed:
            try:  # one stack: refused (RuntimeError) when shapes, devices or layouts differ
                stacked = torch.stack(tensors)
            except RuntimeError:
                pass
            else:
                if _measurable(stacked):
                    whole = _stacked_group(stacked, first.dtype, tuple(first.shape))
                    self._groups = [whole]
                    return [DtypeRows(whole.rows, first.dtype)]
        groups: dict[tuple[torch.dtype, torch.Size, torch.device], list[int]] = {}
        try:
            for row, tensor in enumerate(tensors):
                groups.setdefault((tensor.dtype, tensor.shape, tensor.device), []).append(row)
        except RuntimeError:  # a nested tensor has no shape: each output measured on its own
            groups = {(first.dtype, torch.Size(), first.device): list(range(len(tensors)))}
        return self._placed(
            [
                (_group([tensors[row] for row in rows], dtype, tuple(shape)), rows)
                for (dtype, shape, _), rows in groups.items()
            ],
            len(tensors),
        )

    def _measure_multi(self, tensors: list[torch.Tensor]) -> list[DtypeRows]:
        """`measure` on CUDA: the outputs of one device and dtype, any shapes, in seven multi-tensor ops
        (core/stats/pooled.py); those a multi-tensor kernel does not take whole (sparse, nested, meta, empty, not
        contiguous) each on its own."""
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        alone: list[int] = []
        for row, tensor in enumerate(tensors):
            if (
                tensor.layout is _STRIDED
                and not tensor.is_nested
                and not tensor.is_meta
                and tensor.numel() > 0
                and tensor.is_contiguous()
            ):
                groups.setdefault((tensor.dtype, tensor.device), []).append(row)
            else:
                alone.append(row)
        parts: list[tuple[_OutputGroup | _AloneGroup, list[int]]] = [
            (_multi_group([tensors[row] for row in rows], dtype), rows) for (dtype, _), rows in groups.items()
        ]
        if alone:
            parts.append((_AloneGroup([tensors[row] for row in alone]), alone))
        return self._placed(parts, len(tensors))

    def _placed(self, parts: list[tuple[_OutputGroup | _AloneGroup, list[int]]], count: int) -> list[DtypeRows]:
        """The groups the outputs were measured in, each with its outputs' rows (of `count`): kept, each output's
        group and place noted, and what the screen reads of them."""
        where: dict[int, GroupRow] = {}
        read: list[DtypeRows] = []
        for group, rows in parts:
            read += group.read()
            self._groups.append(group)
            for place, row in enumerate(rows):
                where[row] = GroupRow(group, place)
        self._where = [where[row] for row in range(count)]
        return read

    def measurement(self, row: int) -> Measurement:
        """The measurement of the output kept at `row` (after `measure`)."""
        if self._changed:
            changed = self._changed.get(row)
            if changed is not None:
                return changed
        where = self._where
        if where is None:
            return self._groups[0].measurement(row)
        found = where[row]
        return found.group.measurement(found.row)


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
    return _stacked_group(stacked, dtype, shape) if _measurable(stacked) else _AloneGroup(tensors)


def _stacked_group(stacked: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> _OutputGroup:
    """Outputs of one dtype, shape and device, stacked: reduced row by row."""
    values = stacked.abs_().view(len(stacked), -1)
    return _OutputGroup(Rows(values.amin(1), values.amax(1)), dtype, [shape] * len(stacked))


def _multi_group(tensors: list[torch.Tensor], dtype: torch.dtype) -> _OutputGroup:
    """Outputs of one device and dtype, any shapes, measured with multi-tensor kernels (CUDA's way:
    core/stats/pooled.py)."""
    return _OutputGroup(Rows(*multi_tensor_range(tensors)), dtype, [tuple(tensor.shape) for tensor in tensors])


class _OutputGroup:
    """Deferred outputs of one dtype and device measured together (`rows`, one row each, with each output's shape),
    and the rows' measurement objects made so far."""

    __slots__ = ("rows", "dtype", "shapes", "made")

    def __init__(self, rows: Rows, dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> None:
        self.rows, self.dtype, self.shapes = rows, dtype, shapes
        self.made: dict[int, StackedMeasurement] = {}

    def read(self) -> list[DtypeRows]:
        return [DtypeRows(self.rows, self.dtype)]

    def measurement(self, row: int) -> StackedMeasurement:
        found = self.made.get(row)
        if found is None:
            found = self.made[row] = StackedMeasurement(self.rows, row, self.dtype, self.shapes[row])
        return found


class _AloneGroup:
    """Deferred outputs a stack cannot measure, each measured on its own as a call recorded as it returns would be
    (`measure`: a sparse tensor's values, a note for a meta or empty one); their abs maxima are stacked for the
    screen."""

    __slots__ = ("made",)

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.made = [measure(tensor) for tensor in tensors]

    def read(self) -> list[DtypeRows]:
        """The measured rows' abs min and max, stacked by device and dtype (those with no numbers left out)."""
        lows: dict[tuple[torch.device, torch.dtype, torch.dtype], list[torch.Tensor]] = {}
        highs: dict[tuple[torch.device, torch.dtype, torch.dtype], list[torch.Tensor]] = {}
        for found in self.made:
            low, high = found.abs_min, found.abs_max
            if low is not None and high is not None and high.is_floating_point() and found.dtype is not None:
                kind = (high.device, high.dtype, found.dtype)
                lows.setdefault(kind, []).append(low)
                highs.setdefault(kind, []).append(high)
        return [
            DtypeRows(Rows(torch.stack(lows[kind]), torch.stack(of_kind)), kind[2]) for kind, of_kind in highs.items()
        ]

    def measurement(self, row: int) -> Measurement:
        return self.made[row]
