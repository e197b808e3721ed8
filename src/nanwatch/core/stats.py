"""Per-tensor statistics: abs-min and abs-max, kept on the tensor's device until someone must read them.

Nothing here synchronises with the device: `measure()` only launches the kernels. Values are exact (a min and a max
are exact in any dtype), so the numbers printed later are the ones transformers would print.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
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
    # Only with count_underflow: int64 counts of values that underflow (see `UnderflowCounter` in core/headroom.py).
    underflow: torch.Tensor | None = None

    @property
    def is_float(self) -> bool:
        return self.abs_max is not None and self.abs_max.is_floating_point()


# Given a float tensor's values, launches the kernels that count its underflowing values (`count_underflow`).
CountUnderflow = Callable[[torch.Tensor], torch.Tensor | None]


def measure(tensor: torch.Tensor, underflow: CountUnderflow | None = None) -> Measurement:
    """Launch the kernels for abs-min/abs-max of `tensor`; never raises for odd tensors, says why instead.

    With `underflow` (only when counting is asked for), a measured floating-point tensor also gets its counts.
    """
    if underflow is not None:
        measurement = measure(tensor)
        if measurement.abs_max is not None and tensor.dtype.is_floating_point:
            measurement.underflow = underflow(tensor.detach())
        return measurement
    if tensor.is_nested:
        # A nested tensor has no single shape (asking for it raises); an eval-mode nn.TransformerEncoder with a
        # padding mask passes these between its layers. Its numbers are those of all its components together.
        flat = measure(torch.cat([part.reshape(-1) for part in tensor.detach().unbind()]))
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
    if dtype in _ABS_KEEPS_DTYPE:
        abs_min, abs_max = _abs_aminmax(data)
        return Measurement(abs_min, abs_max, dtype, shape)
    if dtype is torch.bool:
        magnitude = data.to(torch.uint8)
    elif dtype in FLOAT8_DTYPES:
        # float8 has no reduction kernels; every float8 value is exact in float32.
        magnitude = data.float().abs_()
    elif data.is_quantized:
        magnitude = data.dequantize().abs()
    else:  # complex: abs() is the (real) magnitude
        magnitude = data.abs()
    abs_min, abs_max = torch.aminmax(magnitude)
    return Measurement(abs_min, abs_max, dtype, shape)


# The dtypes whose abs() has the same dtype, so the magnitudes can be written into a reused buffer.
_ABS_KEEPS_DTYPE: frozenset[torch.dtype] = frozenset(
    (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    + (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
)
# CPU: magnitudes go through a reused buffer of this many elements. A fresh abs() of a large tensor is a fresh
# allocation, which glibc serves with mmap and the kernel with page faults: for 32 MiB of logits that costs more
# than the abs itself. Larger tensors go through it in chunks of this size.
_CPU_CHUNK = 1 << 20
# Other devices have caching allocators; chunks there only bound the temporary copy of a huge tensor (logits).
_DEVICE_CHUNK = 1 << 26
# From this many elements on, the magnitudes are reduced as integers (see `_SAME_SIZE_INT`): it saves more time in
# the reduction than the three extra tiny ops cost.
_INT_REDUCE_FROM = 1 << 19
# After abs() a float's sign bit is clear, so its bits, read as a signed integer of the same size, order as its
# magnitude does (nan above inf). Integer min/max skip the nan bookkeeping of float reductions: on the CPU they take
# about half the time.
_SAME_SIZE_INT: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}


class _Scratch(threading.local):
    """Per thread (a forward may run in several: DataParallel, user threads): one buffer per dtype, and views of it
    shaped like the tensors met so far, so that measuring one costs two torch calls and no allocation."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.views: dict[tuple[torch.dtype, torch.Size], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def views_for(self, dtype: torch.dtype, shape: torch.Size, numel: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A view of the buffer shaped `shape`, and the same as integers when they are to be reduced as such."""
        key = (dtype, shape)
        views = self.views.get(key)
        if views is None:
            target = self.buffer(dtype)[:numel].view(shape)
            as_int = _SAME_SIZE_INT.get(dtype) if numel >= _INT_REDUCE_FROM else None
            views = (target, None if as_int is None else target.view(as_int))
            if len(self.views) >= 1024:  # a model whose shapes never repeat: do not grow without bound
                self.views.clear()
            self.views[key] = views
        return views

    def buffer(self, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.buffers.get(dtype)
        if buffer is None:
            with torch.inference_mode(False):  # an inference tensor could not be written outside inference mode
                buffer = self.buffers[dtype] = torch.empty(_CPU_CHUNK, dtype=dtype)
        return buffer


_scratch = _Scratch()


def _abs_aminmax(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.aminmax(data.abs())`, the same numbers, without a fresh full-size temporary on the CPU."""
    numel = data.numel()
    # Subclasses (DTensor, fake tensors) keep their own semantics: no writing into a plain buffer for them.
    if not data.is_cpu or type(data) is not torch.Tensor:
        if numel <= _DEVICE_CHUNK or not data.is_contiguous():
            return torch.aminmax(data.abs())
        flat = data.view(-1)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = [
            torch.aminmax(flat[start : start + _DEVICE_CHUNK].abs()) for start in range(0, numel, _DEVICE_CHUNK)
        ]
    elif numel <= _CPU_CHUNK:
        target, as_int = _scratch.views_for(data.dtype, data.shape, numel)
        torch.abs(data, out=target)
        if as_int is None:
            return torch.aminmax(target)
        return _as_magnitudes(torch.aminmax(as_int), data.dtype)
    elif not data.is_contiguous():
        return torch.aminmax(data.abs())  # rare: a large strided view
    else:
        buffer = _scratch.buffer(data.dtype)
        int_dtype = _SAME_SIZE_INT.get(data.dtype)
        flat = data.view(-1)
        parts = []
        for start in range(0, numel, _CPU_CHUNK):
            part = flat[start : start + _CPU_CHUNK]
            magnitudes = torch.abs(part, out=buffer[: part.numel()])
            if int_dtype is None:
                parts.append(torch.aminmax(magnitudes))
            else:
                parts.append(_as_magnitudes(torch.aminmax(magnitudes.view(int_dtype)), data.dtype))
    # min and max propagate nan, so a nan in any chunk gives nan, as a single aminmax would.
    return torch.stack([part[0] for part in parts]).min(), torch.stack([part[1] for part in parts]).max()


def _as_magnitudes(
    int_range: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (min, max) of magnitudes reduced as integers, back as floats, exactly as a float aminmax gives them."""
    low, high = int_range
    high = high.view(dtype)
    # A nan makes `high` nan; minimum() passes it on, as a float min() would have.
    return torch.minimum(low.view(dtype), high), high


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
    the watcher calls `forget_parameters()` between training batches for them. Activations are held by weak
    reference, so the cache never keeps a tensor alive; parameters live as long as the model anyway.
    """

    def __init__(self, underflow: CountUnderflow | None = None) -> None:
        self._underflow = underflow
        self._params: dict[int, tuple[torch.Tensor, tuple[int, torch.dtype, int], Measurement]] = {}
        self._activations: dict[object, tuple[weakref.ref[torch.Tensor], int, Measurement]] = {}

    def _measure(self, tensor: torch.Tensor) -> Measurement:
        return measure(tensor) if self._underflow is None else measure(tensor, self._underflow)

    def parameter(self, param: torch.Tensor) -> Measurement:
        if param.is_inference():  # inference tensors keep no version counter (a model built under inference_mode)
            return self._measure(param)
        key = id(param)
        fingerprint = _fingerprint(param)
        hit = self._params.get(key)
        if hit is not None and hit[0] is param and hit[1] == fingerprint:
            return hit[2]
        measurement = self._measure(param)
        self._params[key] = (param, fingerprint, measurement)
        return measurement

    def activation(self, tensor: torch.Tensor) -> Measurement:
        # Inference tensors keep no version counter; nested tensors have no shape or stride to key on.
        if tensor.is_inference() or tensor.is_nested:
            return self._measure(tensor)
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
        measurement = self._measure(tensor)
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
