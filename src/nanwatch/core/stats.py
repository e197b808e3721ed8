"""Per-tensor statistics: abs-min and abs-max, kept on the tensor's device until someone must read them.

Nothing here synchronises with the device: `measure()` only launches the kernels. Values are exact (a min and a max
are exact in any dtype), so the numbers printed later are the ones transformers would print.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["Measurement", "measure", "StatsCache", "FLOAT8_DTYPES"]

FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


@dataclass(slots=True)
class Measurement:
    """abs-min and abs-max of one tensor, as 0-d tensors on its device (or a reason it was not measured)."""

    abs_min: torch.Tensor | None
    abs_max: torch.Tensor | None
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    skipped: str | None = None  # why no numbers: "empty", "meta", ...

    @property
    def is_float(self) -> bool:
        return self.abs_max is not None and self.abs_max.is_floating_point()


def measure(tensor: torch.Tensor) -> Measurement:
    """Launch the kernels for abs-min/abs-max of `tensor`; never raises for odd tensors, says why instead."""
    shape = tuple(tensor.shape)
    dtype = tensor.dtype
    if tensor.device.type == "meta":
        return Measurement(None, None, dtype, shape, skipped="meta")
    if tensor.layout is not torch.strided:
        return Measurement(None, None, dtype, shape, skipped=str(tensor.layout).replace("torch.", ""))
    if tensor.numel() == 0:
        return Measurement(None, None, dtype, shape, skipped="empty")
    data = tensor.detach()
    if data.dtype is torch.bool:
        magnitude = data.to(torch.uint8)
    elif data.dtype in FLOAT8_DTYPES:
        # float8 has no reduction kernels; every float8 value is exact in float32.
        magnitude = data.float().abs_()
    elif data.dtype.is_complex or data.is_quantized:
        magnitude = data.dequantize().abs() if data.is_quantized else data.abs()
    else:
        magnitude = data.abs()
    abs_min, abs_max = torch.aminmax(magnitude)
    return Measurement(abs_min, abs_max, dtype, shape)


class StatsCache:
    """Remembers measurements so a tensor seen twice unchanged is measured once.

    Parameters do not change during a forward, and a module's output is usually the next module's input. A tensor's
    `_version` goes up with every in-place change (a ReLU(inplace=True) after the module, an optimizer step), so
    a (tensor, version) pair is what a measurement belongs to. Activations are held by weak reference, so the cache
    never keeps a tensor alive; parameters live as long as the model anyway.
    """

    def __init__(self) -> None:
        self._params: dict[int, tuple[torch.Tensor, int, Measurement]] = {}
        self._activations: dict[int, tuple[weakref.ref[torch.Tensor], int, Measurement]] = {}

    def parameter(self, param: torch.Tensor) -> Measurement:
        key = id(param)
        version = param._version
        hit = self._params.get(key)
        if hit is not None and hit[0] is param and hit[1] == version:
            return hit[2]
        measurement = measure(param)
        self._params[key] = (param, version, measurement)
        return measurement

    def activation(self, tensor: torch.Tensor) -> Measurement:
        if tensor.is_inference():  # inference tensors keep no version counter
            return measure(tensor)
        key = id(tensor)
        version = tensor._version
        hit = self._activations.get(key)
        if hit is not None and hit[0]() is tensor and hit[1] == version:
            return hit[2]
        measurement = measure(tensor)
        self._activations[key] = (weakref.ref(tensor), version, measurement)
        return measurement

    def forget_activations(self) -> None:
        """Drop activation entries (at the end of each batch), so ids of freed tensors are not reused by mistake."""
        self._activations.clear()

    def clear(self) -> None:
        self._params.clear()
        self._activations.clear()
