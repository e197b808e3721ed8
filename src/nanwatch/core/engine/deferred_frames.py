"""The frames of deferred calls (core/engine/deferral.py), and what the check reads of them instead of their lines.

A deferred call's frame is made at the check, when its output has been measured with the other deferred outputs of
its dtype, shape and device (`OutputGroup`, one stack); its lines are made only when something reads them. Of a clean
batch most never are: the check reads the stacks, the inputs measured at the calls and the parameters' batch
measurement whole (`Settled`), and only the ring's last frames are ever shown.
"""

from __future__ import annotations

import torch

from nanwatch.core.frames import Direction, Entry, Frame, Role
from nanwatch.core.stats.cache import TrackedBatch
from nanwatch.core.stats.measure import Measurement, StackedMeasurement
from nanwatch.core.stats.staging import Rows
from nanwatch.core.walk import OUTPUT_LABEL, input_label

__all__ = ["DeferredFrame", "FrameSource", "OutputGroup", "Settled"]

_PARAMETER, _INPUT, _OUTPUT, _FORWARD = Role.PARAMETER, Role.INPUT, Role.OUTPUT, Direction.FORWARD
_INPUT_0 = input_label(0)


class Settled:
    """What the frames made from deferred calls hold, so that the check's screen need not read them line by line:
    the stacks their outputs were measured in (every row belongs to one of those frames), the inputs measured at the
    call, and their modules' parameters (once per module and batch measurement).

    Args:
        parameter_sites: how many watched modules have parameters: when that many deferred modules' parameters are
            here, all from one batch measurement, the check reads that measurement whole.
    """

    __slots__ = ("stacks", "inputs", "parameters", "parameter_sites")

    def __init__(self, parameter_sites: int = 0) -> None:
        self.stacks: list[tuple[Rows, torch.dtype]] = []
        self.inputs: list[Measurement] = []
        self.parameters: list[tuple[TrackedBatch, list[tuple[str, int]]]] = []  # per module: the batch, its rows
        self.parameter_sites = parameter_sites

    def reads(self) -> tuple[list[tuple[Rows, torch.dtype]], list[Measurement]]:
        """What the screen reads for these frames: stacks to read whole, and measurements one by one."""
        measurements = list(self.inputs)
        parameters = self.parameters
        batches = {id(batch): batch for batch, _ in parameters}
        if len(batches) == 1 and len(parameters) == self.parameter_sites:  # every module's: the measurement whole
            (batch,) = batches.values()
            measurements += batch.alone
            return self.stacks + batch.stacks, measurements
        for batch, named in parameters:
            found = batch.measurements
            measurements += [found[row] for _, row in named]
        return self.stacks, measurements


# What a deferred call's frame is made from: its module's name and class, micro-batch and phase, the parameters'
# batch measurement with the names and rows of the module's parameters in it, the input (a measurement made at the
# call, or an `OutputGroup` whose row `source_row` it is) and the output (row `row` of `group`).
FrameSource = tuple[
    str,
    str,
    int,
    str,
    "TrackedBatch | None",
    list[tuple[str, int]],
    "Measurement | OutputGroup",
    int,
    "OutputGroup",
    int,
]


class DeferredFrame(Frame):
    """The frame of a deferred call, made at the check from one tuple (`FrameSource`: one slot to set per frame, the
    fields read from it); its lines are made when first read. Its fields are its call's: they cannot be set."""

    __slots__ = ("_source", "_lines")
    _source: FrameSource
    _lines: list[Entry]
    direction = _FORWARD  # a class attribute: deferred calls are forward calls

    @property
    def module_name(self) -> str:  # type: ignore[override]
        return self._source[0]

    @property
    def class_name(self) -> str:  # type: ignore[override]
        return self._source[1]

    @property
    def batch_number(self) -> int:  # type: ignore[override]
        return self._source[2]

    @property
    def phase(self) -> str:  # type: ignore[override]
        return self._source[3]

    @property
    def entries(self) -> list[Entry]:
        try:
            return self._lines
        except AttributeError:  # not read yet
            pass
        _, _, _, _, tracked, named, source, source_row, group, row = self._source
        lines = [] if tracked is None else [Entry(name, _PARAMETER, tracked.measurements[i]) for name, i in named]
        found = source.measurement(source_row) if isinstance(source, OutputGroup) else source
        lines.append(Entry(_INPUT_0, _INPUT, found))
        lines.append(Entry(OUTPUT_LABEL, _OUTPUT, group.measurement(row)))
        self._lines = lines
        return lines

    @entries.setter
    def entries(self, lines: list[Entry]) -> None:
        self._lines = lines


class OutputGroup:
    """Deferred outputs of one dtype, shape and device, measured as one stack: `rows` once measured, and the rows'
    measurement objects made so far (one per row however many lines show it: an output is the next module's input,
    and its container's output, and the checks count a tensor once by its measurement)."""

    __slots__ = ("outputs", "rows", "dtype", "shape", "made")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.outputs: list[torch.Tensor] = []  # until measured (then `rows`)
        self.rows = Rows()
        self.dtype, self.shape = dtype, shape
        self.made: dict[int, StackedMeasurement] = {}

    def measure(self) -> Rows:
        """The outputs measured, one row each: their abs min and max (exact however grouped; nan propagates). The
        outputs are let go."""
        outputs = self.outputs
        values = torch.stack(outputs).abs_().view(len(outputs), -1)
        self.rows, self.outputs = Rows(values.amin(1), values.amax(1)), []
        return self.rows

    def measurement(self, row: int) -> StackedMeasurement:
        found = self.made.get(row)
        if found is None:
            found = self.made[row] = StackedMeasurement(self.rows, row, self.dtype, self.shape)
        return found
