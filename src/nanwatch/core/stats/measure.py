"""One tensor measured: the `Measurement` type, and `measure()`, which launches every statistic's kernels for it.

This is the one-off measurement every other path builds on: the cache (`cache.py`) remembers measurements,
`stacking.py` measures many tensors at once, `readback.py` reads the numbers to the host. Nothing here waits for the
device: `measure()` only launches kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.stats.base import Kernel
from nanwatch.core.stats.kernels import ABS_KEEPS_DTYPE, FLOAT8_DTYPES, values_of
from nanwatch.core.stats.output_rows import Rows
from nanwatch.core.stats.registry import extras, lead
from nanwatch.core.stats.sharded import local_shard

__all__ = [
    "Measurement",
    "NotedMeasurement",
    "StackedMeasurement",
    "ExtraKernels",
    "extra_kernels",
    "measure",
    "measure_extras",
]

# The lead statistic's kernel. The cache (`cache.py`) binds it too, for its own fast path: a benchmark that swaps the
# kernel swaps both.
_RANGE = lead().range_kernel()
_WIDENED = frozenset(getattr(torch, name) for name in ("uint16", "uint32") if hasattr(torch, name))


@dataclass(slots=True)
class Measurement:
    """One tensor's statistics as device tensors (or why it was not measured).

    Attributes:
        abs_min, abs_max: the lead statistic, as 0-d tensors on the tensor's device.
        dtype, shape: of the tensor (`shape` is None for a nested tensor).
        skipped: why there are no numbers: "empty", "meta: not measured", ...
        extra: the other statistics measured in this run, by name: one device vector each.
    """

    abs_min: torch.Tensor | None
    abs_max: torch.Tensor | None
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    skipped: str | None = None
    extra: dict[str, torch.Tensor] | None = None

    @property
    def is_float(self) -> bool:
        return self.abs_max is not None and self.abs_max.is_floating_point()

    @property
    def note(self) -> str | None:
        """With numbers, what they were taken from where that is not every element as the tensor holds it (a
        `NotedMeasurement`); None for a plain tensor's (a class-level answer: nothing is set per measurement)."""
        return None


class NotedMeasurement(Measurement):
    """The numbers of the values a sparse or nested tensor holds, and a note that says so: "sparse_coo: values" (the
    values stored, not the zeros left out), "nested: values"."""

    __slots__ = ("_note",)

    def __init__(
        self, abs_min: torch.Tensor, abs_max: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None, note: str
    ) -> None:
        super().__init__(abs_min, abs_max, dtype, shape)
        self._note = note

    @property
    def note(self) -> str | None:
        return self._note


class StackedMeasurement(Measurement):
    """A measurement that is row `row` of tensors measured together (a stack of parameters, staged activations):
    `abs_min` and `abs_max` are made when read."""

    __slots__ = ("rows", "row")

    def __init__(self, rows: Rows, row: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        # Made at every staged module output: the fields set directly, not through the dataclass's __init__.
        self.rows, self.row = rows, row
        self.dtype, self.shape, self.skipped, self.extra = dtype, shape, None, None

    @property
    def abs_min(self) -> torch.Tensor:
        return self.rows.low(self.row)

    @abs_min.setter
    def abs_min(self, value: torch.Tensor | None) -> None:
        pass  # the numbers are the stack's

    @property
    def abs_max(self) -> torch.Tensor:
        return self.rows.high(self.row)

    @abs_max.setter
    def abs_max(self, value: torch.Tensor | None) -> None:
        pass

    @property
    def is_float(self) -> bool:
        return True  # only floating-point tensors are stacked


ExtraKernels = tuple[tuple[str, Kernel], ...]


def extra_kernels(config: WatchConfig) -> ExtraKernels:
    """The kernels of every registered statistic besides the lead that a run with `config` measures."""
    found = []
    for statistic in extras():
        kernel = statistic.kernel(config)
        if kernel is not None:
            found.append((statistic.name, kernel))
    return tuple(found)


def measure(tensor: torch.Tensor, kernels: ExtraKernels = ()) -> Measurement:
    """Launch the kernels of every statistic for `tensor`; never raises for odd tensors, says why instead."""
    if type(tensor) is not torch.Tensor:  # a DTensor: this rank's shard, so no read of it runs a collective
        tensor = local_shard(tensor)
    measurement = _measure_range(tensor)
    if kernels and measurement.abs_max is not None:
        # The other statistics are of the same elements as the lead's: a sparse tensor's stored values, ...
        data = tensor.detach() if measurement.note is None else values_of(tensor.detach())
        found = {}
        for name, kernel in kernels:
            vector = kernel(data)
            if vector is not None:
                found[name] = vector
        if found:
            measurement.extra = found
    return measurement


def measure_extras(data: torch.Tensor, kernels: ExtraKernels) -> dict[str, torch.Tensor] | None:
    """The other statistics' vectors for `data` (already detached), by name; None when none applies."""
    found = {}
    for name, kernel in kernels:
        vector = kernel(data)
        if vector is not None:
            found[name] = vector
    return found or None


def _measure_range(tensor: torch.Tensor) -> Measurement:
    dtype = tensor.dtype
    # The common case first, with as few questions as can be: a plain non-empty tensor whose abs keeps its dtype.
    if (
        dtype in ABS_KEEPS_DTYPE
        and not tensor.is_nested
        and tensor.layout is torch.strided
        and not tensor.is_meta
        and tensor.numel()
    ):
        # detach() only where a graph could be built or a subclass hides the plain tensor (a Parameter): one op less
        # for every activation of an inference forward.
        data = tensor if type(tensor) is torch.Tensor and not tensor.requires_grad else tensor.detach()
        abs_min, abs_max = _RANGE(data)
        return Measurement(abs_min, abs_max, dtype, tuple(tensor.shape))
    if tensor.is_nested or tensor.layout is not torch.strided:
        return _measure_values(tensor)
    shape = tuple(tensor.shape)
    dtype = tensor.dtype
    if tensor.is_meta:
        return Measurement(None, None, dtype, shape, skipped="meta: not measured")
    if tensor.numel() == 0:
        return Measurement(None, None, dtype, shape, skipped="empty")
    # detach() only where a graph could be built or a subclass hides the plain tensor (a Parameter): one op less for
    # every activation of an inference forward.
    data = tensor if type(tensor) is torch.Tensor and not tensor.requires_grad else tensor.detach()
    if dtype in ABS_KEEPS_DTYPE:
        abs_min, abs_max = _RANGE(data)
        return Measurement(abs_min, abs_max, dtype, shape)
    try:
        if dtype is torch.bool:
            magnitude = data.to(torch.uint8)
        elif dtype in FLOAT8_DTYPES:
            # float8 has no reduction kernels; every float8 value is exact in float32.
            magnitude = data.float().abs_()
        elif data.is_quantized:
            magnitude = data.dequantize().abs()
        elif dtype in _WIDENED:
            # uint16/uint32 have no reduction kernels on the CPU; their values are exact in int64 (and already >= 0).
            magnitude = data.to(torch.int64)
        else:  # complex: abs() is the (real) magnitude
            magnitude = data.abs()
        abs_min, abs_max = torch.aminmax(magnitude)
    except (NotImplementedError, RuntimeError, TypeError):
        # A dtype torch cannot reduce here (uint64, an exotic subclass): marked, never a reason to stop watching.
        return Measurement(None, None, dtype, shape, skipped=f"{str(dtype).replace('torch.', '')} not measured")
    return Measurement(abs_min, abs_max, dtype, shape)


def _measure_values(tensor: torch.Tensor) -> Measurement:
    """A nested or sparse tensor, measured on the values it holds (`values_of`), and said so on its line."""
    nested = tensor.is_nested
    # A nested tensor has no single shape (asking for it raises); an eval-mode nn.TransformerEncoder with a padding
    # mask passes these between its layers.
    shape = None if nested else tuple(tensor.shape)
    kind = "nested" if nested else str(tensor.layout).replace("torch.", "")
    if tensor.is_meta:
        return Measurement(None, None, tensor.dtype, shape, skipped=f"{kind}, meta: not measured")
    try:
        values = values_of(tensor.detach())
    except (NotImplementedError, RuntimeError, TypeError):  # a layout with no values to read (mkldnn, a new one)
        return Measurement(None, None, tensor.dtype, shape, skipped=f"{kind}: not measured")
    found = _measure_range(values)
    if found.abs_max is None:  # "empty": no values (a sparse tensor of zeros only, a nested tensor of empty parts)
        return Measurement(None, None, tensor.dtype, shape, skipped=f"{kind}: {found.skipped}")
    assert found.abs_min is not None
    return NotedMeasurement(found.abs_min, found.abs_max, tensor.dtype, shape, f"{kind}: values")
