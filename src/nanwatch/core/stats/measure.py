"""Measuring tensors on their device, remembering what was measured, and reading the numbers back.

Nothing here waits for the device except `read_back`, which the engine calls once per check that found something
(and tracing, per traced frame): `measure()` only launches kernels.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.stats.base import Kernel, Values
from nanwatch.core.stats.kernels import ABS_KEEPS_DTYPE, FLOAT8_DTYPES
from nanwatch.core.stats.registry import extras, lead
from nanwatch.core.stats.sharded import local_shard
from nanwatch.core.stats.staging import STAGE_MAX_NUMEL, Rows, Staging

__all__ = [
    "Measurement",
    "measure",
    "measure_together",
    "MagnitudePlan",
    "StackPlan",
    "StatsCache",
    "TrackedBatch",
    "ReadBack",
    "read_back",
    "extra_kernels",
    "stack_maxima",
    "read_flags",
    "holds_non_finite",
]

_RANGE = lead().range_kernel()
_WIDENED = frozenset(getattr(torch, name) for name in ("uint16", "uint32") if hasattr(torch, name))


@dataclass(slots=True)
class Measurement:
    """One tensor's statistics as device tensors (or why it was not measured).

    Attributes:
        abs_min, abs_max: the lead statistic, as 0-d tensors on the tensor's device.
        dtype, shape: of the tensor (`shape` is None for a nested tensor).
        skipped: why there are no numbers: "empty", "meta", "sparse_coo", ...
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
        data = tensor.detach()
        found = {}
        for name, kernel in kernels:
            vector = kernel(data)
            if vector is not None:
                found[name] = vector
        if found:
            measurement.extra = found
    return measurement


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
    once; `fits()` says whether the tensors still have the dtypes it was made for."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
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
        self._order: list[int] = []  # the tensors' indices in the order `measure()` finds their measurements
        for (_device, dtype, shape), indices in groups.items():
            if len(indices) < 2:
                self.alone += indices
                continue
            per_stack = max(2, _STACK_ELEMENTS // max(1, shape.numel()))
            for start in range(0, len(indices), per_stack):
                chunk = indices[start : start + per_stack]
                self.stacks.append(([self.tensors[index] for index in chunk], dtype, shape))
                self._order += chunk
        self._order += self.alone

    def fits(self) -> bool:
        """Whether every stacked tensor still has the dtype of its stack (`.data` replaced by `model.half()`)."""
        return all(tensor.dtype is dtype for stack, dtype, _ in self.stacks for tensor in stack)

    def measure(self, kernels: ExtraKernels = ()) -> list[Measurement]:
        """The measurements, in the order of the tensors given. Raises RuntimeError when a stacked tensor changed its
        shape or device since (`torch.stack` refuses): make a new plan then."""
        found: list[Measurement] = []
        with torch.no_grad():  # no graph for the stacks of parameters that require grad
            for stack, dtype, shape in self.stacks:
                # One column per tensor: amin/amax over dim 0 of the transposed rows run as a few long vector passes
                # (aminmax along short rows is several times slower). min and max propagate nan, as a whole-tensor
                # aminmax does.
                columns = torch.stack(stack).abs_().view(len(stack), -1).t()
                rows = Rows(columns.amin(0), columns.amax(0))
                sizes = tuple(shape)
                for row, tensor in enumerate(stack):
                    one = StackedMeasurement(rows, row, dtype, sizes)
                    if kernels:
                        one.extra = _extras(tensor.detach(), kernels)
                    found.append(one)
        found += [measure(self.tensors[index], kernels) for index in self.alone]
        ordered: list[Measurement | None] = [None] * len(found)
        for index, measurement in zip(self._order, found, strict=True):
            ordered[index] = measurement
        return [measurement for measurement in ordered if measurement is not None]


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
            for chunk in self.stacks:
                # One column per tensor: amin/amax down the columns run as long vector passes (see StackPlan).
                columns = torch.stack([tensors[index] for index in chunk]).view(len(chunk), -1).t()
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


def _extras(data: torch.Tensor, kernels: ExtraKernels) -> dict[str, torch.Tensor] | None:
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
    if tensor.is_nested:
        # A nested tensor has no single shape (asking for it raises); an eval-mode nn.TransformerEncoder with a
        # padding mask passes these between its layers. Its numbers are those of all its components together.
        flat = _measure_range(torch.cat([part.reshape(-1) for part in tensor.detach().unbind()]))
        return Measurement(flat.abs_min, flat.abs_max, tensor.dtype, None, flat.skipped)
    shape = tuple(tensor.shape)
    dtype = tensor.dtype
    if tensor.is_meta:
        return Measurement(None, None, dtype, shape, skipped="meta")
    if tensor.layout is not torch.strided:
        return Measurement(None, None, dtype, shape, skipped=str(tensor.layout).replace("torch.", ""))
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


# ------------------------------------------------------------------------------------------------------ reading

_Owner = TypeVar("_Owner")


def stack_maxima(measurements: Iterable[Measurement]) -> dict[tuple[torch.device, torch.dtype | None], torch.Tensor]:
    """The floating-point abs maxima, each measurement once, stacked by (device, dtype of the measured tensor)."""
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
        stacked = torch.stack([t for key in keys for t in (unique[key].abs_min, unique[key].abs_max)])  # type: ignore[misc]
        numbers = stacked.tolist()
        for index, key in enumerate(keys):
            values[key] = lead().read(numbers[2 * index : 2 * index + 2])
    extra: dict[int, dict[str, Values]] = {key: {} for key in unique}
    by_name = {statistic.name: statistic for statistic in extras()}
    for (_device, name), keys in vectors.items():
        statistic = by_name.get(name)
        if statistic is None:  # unregistered since it was measured
            continue
        rows = _stack_rows([unique[key].extra[name] for key in keys])  # type: ignore[index]
        for key, row in zip(keys, rows, strict=True):
            extra[key][name] = statistic.read(row)
    return {key: ReadBack(values[key], extra[key]) for key in unique}


def _stack_rows(vectors: Sequence[torch.Tensor]) -> list[list[int | float]]:
    if all(v.shape == vectors[0].shape for v in vectors):
        return torch.stack(list(vectors)).reshape(len(vectors), -1).tolist()
    return [v.reshape(-1).tolist() for v in vectors]


# -------------------------------------------------------------------------------------------------------- cache


def _pointer(tensor: torch.Tensor) -> int:
    try:
        return tensor.data_ptr()
    except RuntimeError:  # a wrapper subclass (DTensor) has no storage of its own
        return 0


def _view_root(tensor: torch.Tensor) -> torch.Tensor:
    base = tensor._base
    return tensor if base is None else base


# A parameter's measurement, valid while the parameter is the same object with the same version, storage and dtype
# (`.data =` assignment, as `model.half()` and `.to()` do, keeps both the object and its `_version`).
_ParamHit = tuple[torch.Tensor, int, int, torch.dtype, Measurement]


# An activation's measurement: a weak reference to the tensor measured, its version and storage then.
class _Seen(weakref.ref):  # type: ignore[type-arg]
    """An activation's measurement: a weak reference to the tensor measured, with its version and storage then (one
    object, not a reference and a tuple: the garbage collector walks what lives until the batch ends)."""

    __slots__ = ("version", "pointer", "measurement")
    version: int
    pointer: int
    measurement: Measurement


def _seen(tensor: torch.Tensor, version: int, pointer: int, measurement: Measurement) -> _Seen:
    seen = _Seen(tensor)
    seen.version, seen.pointer, seen.measurement = version, pointer, measurement
    return seen


_ActivationHit = _Seen


@dataclass(frozen=True, slots=True)
class TrackedBatch:
    """One batch's measurements of the tracked parameters, in the plan's order, with each parameter's version
    counter and storage when it was measured: a measurement holds while the parameter still has both."""

    measurements: list[Measurement]
    versions: list[int]
    pointers: list[int]


class StatsCache:
    """Remembers measurements so a tensor seen twice unchanged is measured once.

    Parameters do not change during a forward, and a module's output is usually the next module's input. A tensor's
    `_version` goes up with every in-place change (a ReLU(inplace=True) after the module, an optimizer step), and
    its storage or dtype changes when `.data` is replaced, so a (tensor, fingerprint) pair is what a measurement
    belongs to. Writes that bypass the version counter (fused optimizers, `p.data.add_()`) are invisible to any key:
    the engine calls `forget_parameters()` between training batches for them. Activations are held by weak
    reference, so the cache never keeps a tensor alive; parameters live as long as the model anyway.

    The parameters given to `track_parameters()` are measured together, in a handful of kernel launches, when the
    first of them is asked for after `forget_parameters()` (`measure_together`): once per batch, not one launch per
    parameter.

    Args:
        kernels: the other statistics' kernels measured in this run (`extra_kernels(config)`).
    """

    def __init__(self, kernels: ExtraKernels = ()) -> None:
        self._kernels = kernels
        self._params: dict[int, _ParamHit] = {}
        # The tracked parameters (`track_parameters`), measured together once per batch: their measurements and
        # fingerprints then, in lists in the plan's order (a handful of objects per batch, not a tuple per parameter).
        self._plan: StackPlan | None = None
        self._index: dict[int, int] = {}
        self._measured: list[Measurement] | None = None
        self._versions: list[int] = []
        self._pointers: list[int] = []
        self._dtypes: list[torch.dtype] = []
        self._tracked: TrackedBatch | None = None
        # The tensor looked up last: most often one module's output, about to be the next one's input.
        self._last: _ActivationHit | None = None
        # Activations by identity, and by where their values live (views sharing a measurement, `_activation_miss`).
        self._by_id: dict[int, _ActivationHit] = {}
        self._activations: dict[object, _ActivationHit] = {}
        # Small activations are copied there and measured together when read (the check).
        self._staging = Staging()

    @property
    def kernels(self) -> ExtraKernels:
        return self._kernels

    def measure(self, tensor: torch.Tensor) -> Measurement:
        """Measure without remembering (a loss, a gradient)."""
        return measure(tensor, self._kernels)

    def track_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """The parameters the hooks will ask for (those of the watched modules), to be measured together."""
        unique = {id(param): param for param in params if not param.is_inference()}  # no version: never cached
        self._plan = StackPlan(list(unique.values())) if unique else None
        self._index = {key: index for index, key in enumerate(unique)}
        self._measured = None

    def tracked_batch(self) -> TrackedBatch | None:
        """This batch's measurements of the tracked parameters, with their fingerprints then (all measured now if
        they were not yet); a new object after every `forget_parameters()`. None when no parameter is tracked."""
        if self._measured is None:
            if self._plan is None:
                return None
            self._measure_tracked()
        return self._tracked

    def index_of(self, param: torch.Tensor) -> int | None:
        """Where `param` is in `tracked_batch()`'s lists, or None when it is not tracked (`track_parameters`)."""
        return self._index.get(id(param))

    def parameter(self, param: torch.Tensor) -> Measurement:
        measured = self._measured
        index = self._index.get(id(param))
        if index is not None and measured is not None:
            plan = self._plan
            assert plan is not None
            if (
                plan.tensors[index] is param
                and param._version == self._versions[index]
                and param.dtype is self._dtypes[index]
                and _pointer(param) == self._pointers[index]
            ):
                return measured[index]
        hit = self._params.get(id(param))
        if hit is not None and hit[0] is param:
            try:
                version = param._version
            except RuntimeError:  # an inference tensor (a model built under inference_mode) keeps no version
                return measure(param, self._kernels)
            if version == hit[1] and param.dtype is hit[3] and _pointer(param) == hit[2]:
                return hit[4]
        return self._parameter_miss(param, index)

    def _parameter_miss(self, param: torch.Tensor, index: int | None) -> Measurement:
        if param.is_inference():  # no version counter: measured every time
            return measure(param, self._kernels)
        if index is not None and self._measured is None:
            # The first tracked parameter of this batch: measure every tracked one now, together.
            self._measure_tracked()
            return self.parameter(param)
        measurement = measure(param, self._kernels)
        self._params[id(param)] = (param, param._version, _pointer(param), param.dtype, measurement)
        return measurement

    def _measure_tracked(self) -> None:
        plan = self._plan
        assert plan is not None
        try:
            if not plan.fits():
                raise RuntimeError("dtypes changed")
            measurements = plan.measure(self._kernels)
        except RuntimeError:  # a parameter changed dtype, shape or device since the plan was made: make a new one
            plan = self._plan = StackPlan(plan.tensors)
            measurements = plan.measure(self._kernels)
        tensors = plan.tensors
        self._versions = [tensor._version for tensor in tensors]
        self._pointers = [_pointer(tensor) for tensor in tensors]
        self._dtypes = [tensor.dtype for tensor in tensors]
        self._measured = measurements
        self._tracked = TrackedBatch(measurements, self._versions, self._pointers)

    def activation(self, tensor: torch.Tensor) -> Measurement:
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor keeps no version counter: measured every time
            return measure(tensor, self._kernels)
        hit = self._last
        if hit is None or hit() is not tensor:
            hit = self._by_id.get(id(tensor))
            if hit is None or hit() is not tensor:
                return self._activation_miss(tensor, version)
        # The weak reference is alive, so the memory of the tensor measured cannot have been reused. Without storage
        # to compare (pointer 0), the dtype at least.
        if (
            hit.version == version
            and hit.pointer == _pointer(tensor)
            and (hit.pointer or hit.measurement.dtype == tensor.dtype)
        ):
            self._last = hit
            return hit.measurement
        return self._activation_miss(tensor, version)

    def _activation_miss(self, tensor: torch.Tensor, version: int) -> Measurement:
        if tensor.is_nested:  # no shape or stride to key on
            return measure(tensor, self._kernels)
        if type(tensor) is torch.Tensor and not self._kernels:
            # The commonest miss first (a module's fresh output): plain, small, with storage: staged, one copy.
            found = self._staging.stage_plain(tensor)
            if found is not None:
                rows, row, pointer = found
                stacked = StackedMeasurement(rows, row, tensor.dtype, tuple(tensor.shape))
                self._last = self._by_id[id(tensor)] = _seen(tensor, version, pointer, stacked)
                return stacked
        pointer = _pointer(tensor)
        # Keyed by where the values live, so a view with the same layout (`hidden[:, -n:, :]` with n the length,
        # `input_ids.view(-1, n)`) shares the measurement of the tensor it views; transformers models pass such views
        # between modules, and the logits too. Only views of one base count (they share its version counter, so an
        # in-place change through either is seen); `.data` aliases have counters of their own and are measured
        # apart. Storage-less tensors (pointer 0) are known by identity only.
        key: object = None
        measurement: Measurement | None = None
        if pointer:
            # A plain tuple, not a torch.Size: the garbage collector stops walking tuples of plain numbers.
            dtype, shape = tensor.dtype, tuple(tensor.shape)
            numel = tensor.numel()
            # A plain non-empty tensor with storage (so not meta, not sparse), and no other statistic to launch.
            plain = type(tensor) is torch.Tensor and not self._kernels and numel
            # Small: one copy now, measured with the others of its shape when read (core/stats/staging.py). A view of
            # it is measured again rather than looked up: a copy costs less than finding it.
            staged = None
            if plain and numel <= STAGE_MAX_NUMEL:
                staged = self._staging.stage(tensor.detach() if tensor.requires_grad else tensor)
            if staged is not None:
                measurement = StackedMeasurement(staged[0], staged[1], dtype, shape)
            else:
                key = (pointer, dtype, shape, tensor.stride())
                hit = self._activations.get(key)
                if hit is not None and hit.version == version:
                    seen = hit()
                    if seen is not None and (seen is tensor or _view_root(seen) is _view_root(tensor)):
                        # views of one base share one version counter: equal versions, equal values
                        self._last = self._by_id[id(tensor)] = _seen(tensor, version, pointer, hit.measurement)
                        return hit.measurement
                if plain and dtype in ABS_KEEPS_DTYPE:
                    # The common case, straight to the kernels, whose abs keeps the dtype: every other question
                    # `measure()` would ask is answered.
                    abs_min, abs_max = _RANGE(tensor.detach() if tensor.requires_grad else tensor)
                    measurement = Measurement(abs_min, abs_max, dtype, shape)
        if measurement is None:
            measurement = measure(tensor, self._kernels)
        entry = self._last = _seen(tensor, version, pointer, measurement)
        self._by_id[id(tensor)] = entry
        if key is not None:
            self._activations[key] = entry
        return measurement

    def forget_parameters(self) -> None:
        """Drop parameter entries (between training batches), for writes no fingerprint sees: fused optimizers."""
        self._params.clear()
        self._measured = None

    def forget_activations(self) -> None:
        """Drop activation entries (at the end of each batch), so ids of freed tensors are not reused by mistake."""
        self._last = None
        self._by_id.clear()
        self._activations.clear()
        self._staging.rewind()

    def clear(self) -> None:
        """Forget everything, the tracked parameters too (`track_parameters`), and free the staging buffers: a cleared
        cache holds no tensor (a closed watcher lets the model go)."""
        self.forget_parameters()
        self.forget_activations()
        self._staging.clear()
        self._plan, self._index, self._tracked = None, {}, None
        self._versions, self._pointers, self._dtypes = [], [], []
