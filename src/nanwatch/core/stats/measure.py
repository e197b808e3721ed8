"""Measuring tensors on their device, remembering what was measured, and reading the numbers back.

Nothing here waits for the device except `read_back`, which the engine calls once per check that found something
(and tracing, per traced frame): `measure()` only launches kernels.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.stats.base import Kernel, Values
from nanwatch.core.stats.kernels import ABS_KEEPS_DTYPE, FLOAT8_DTYPES
from nanwatch.core.stats.registry import extras, lead

__all__ = [
    "Measurement",
    "measure",
    "StatsCache",
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


def _measure_range(tensor: torch.Tensor) -> Measurement:
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
    seen: set[int] = set()
    for measurement in measurements:
        maximum = measurement.abs_max
        # abs_max is nan when any value is nan, inf when any is inf: it alone says whether a tensor is finite.
        if maximum is None or not maximum.is_floating_point() or id(measurement) in seen:
            continue
        seen.add(id(measurement))
        groups.setdefault((maximum.device, measurement.dtype), []).append(maximum)
    return {key: torch.stack(values) for key, values in groups.items()}


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


def _fingerprint(tensor: torch.Tensor) -> tuple[int, torch.dtype, int]:
    """What changes when a tensor's values may have: its version, and its storage and dtype (`.data =` assignment,
    as `model.half()` and `.to()` do, keeps both the object and its `_version`)."""
    try:
        pointer = tensor.data_ptr()
    except RuntimeError:  # a wrapper subclass (DTensor) has no storage of its own
        pointer = -1
    return tensor._version, tensor.dtype, pointer


def _view_root(tensor: torch.Tensor) -> torch.Tensor:
    base = tensor._base
    return tensor if base is None else base


class StatsCache:
    """Remembers measurements so a tensor seen twice unchanged is measured once.

    Parameters do not change during a forward, and a module's output is usually the next module's input. A tensor's
    `_version` goes up with every in-place change (a ReLU(inplace=True) after the module, an optimizer step), and
    its storage or dtype changes when `.data` is replaced, so a (tensor, fingerprint) pair is what a measurement
    belongs to. Writes that bypass the version counter (fused optimizers, `p.data.add_()`) are invisible to any key:
    the engine calls `forget_parameters()` between training batches for them. Activations are held by weak
    reference, so the cache never keeps a tensor alive; parameters live as long as the model anyway.

    Args:
        kernels: the other statistics' kernels measured in this run (`extra_kernels(config)`).
    """

    def __init__(self, kernels: ExtraKernels = ()) -> None:
        self._kernels = kernels
        self._params: dict[int, tuple[torch.Tensor, tuple[int, torch.dtype, int], Measurement]] = {}
        self._activations: dict[object, tuple[weakref.ref[torch.Tensor], int, Measurement]] = {}

    def measure(self, tensor: torch.Tensor) -> Measurement:
        """Measure without remembering (a loss, a gradient)."""
        return measure(tensor, self._kernels)

    def parameter(self, param: torch.Tensor) -> Measurement:
        if param.is_inference():  # inference tensors keep no version counter (a model built under inference_mode)
            return measure(param, self._kernels)
        key = id(param)
        fingerprint = _fingerprint(param)
        hit = self._params.get(key)
        if hit is not None and hit[0] is param and hit[1] == fingerprint:
            return hit[2]
        measurement = measure(param, self._kernels)
        self._params[key] = (param, fingerprint, measurement)
        return measurement

    def activation(self, tensor: torch.Tensor) -> Measurement:
        # Inference tensors keep no version counter; nested tensors have no shape or stride to key on.
        if tensor.is_inference() or tensor.is_nested:
            return measure(tensor, self._kernels)
        version = tensor._version
        try:
            pointer = tensor.data_ptr()
        except RuntimeError:  # a wrapper subclass (DTensor) has no storage of its own
            pointer = 0
        # Keyed by where the values live, so a view with the same layout (`hidden[:, -n:, :]` with n the length,
        # `input_ids.view(-1, n)`) shares the measurement of the tensor it views; transformers models pass such views
        # between modules, and the logits too. Only views of one base count (they share its version counter, so an
        # in-place change through either is seen); `.data` aliases have counters of their own and are measured
        # apart. Storage-less tensors fall back to identity.
        key: object = (pointer, tensor.dtype, tensor.shape, tensor.stride()) if pointer else id(tensor)
        hit = self._activations.get(key)
        if hit is not None and hit[1] == version:
            seen = hit[0]()  # alive, so its memory cannot have been freed and reused by the tensor looked up
            if seen is tensor:
                if pointer or hit[2].dtype == tensor.dtype:
                    return hit[2]
            elif seen is not None and pointer and _view_root(seen) is _view_root(tensor):
                return hit[2]  # views of one base share one version counter: equal versions, equal values
        measurement = measure(tensor, self._kernels)
        self._activations[key] = (weakref.ref(tensor), version, measurement)
        return measurement

    def forget_parameters(self) -> None:
        """Drop parameter entries (between training batches), for writes no fingerprint sees: fused optimizers."""
        self._params.clear()

    def forget_activations(self) -> None:
        """Drop activation entries (at the end of each batch), so ids of freed tensors are not reused by mistake."""
        self._activations.clear()

    def clear(self) -> None:
        self._params.clear()
        self._activations.clear()
