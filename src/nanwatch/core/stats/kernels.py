"""The device side of the built-in statistics: kernels launched per tensor, none of which waits for the device."""

from __future__ import annotations

import threading

import torch

from nanwatch.core.stats.paths import accelerator_path

__all__ = ["FLOAT8_DTYPES", "ABS_KEEPS_DTYPE", "abs_aminmax", "count_non_finite", "values_of"]

FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)
# The dtypes whose abs() has the same dtype, so the magnitudes can be written into a reused buffer.
ABS_KEEPS_DTYPE: frozenset[torch.dtype] = frozenset(
    (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    + (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
)
# CPU: magnitudes go through a reused buffer of this many elements. A fresh abs() of a large tensor is a fresh
# allocation, which glibc serves with mmap and the kernel with page faults: for 32 MiB of logits that costs more
# than the abs itself. Larger tensors go through it in chunks of this size.
_CPU_CHUNK = 1 << 20
# Below this many elements (64 KiB of float32) a fresh abs() is served from the heap, not by mmap: cheaper than
# finding the buffer's view for the shape.
_FRESH_MAX = 1 << 14
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


def abs_aminmax(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.aminmax(data.abs())`, the same numbers, without a fresh full-size temporary on the CPU.

    For a plain strided, non-empty tensor of a dtype in `ABS_KEEPS_DTYPE`.
    """
    numel = data.numel()
    # Subclasses (DTensor, fake tensors) keep their own semantics: no writing into a plain buffer for them.
    if accelerator_path(data) or type(data) is not torch.Tensor:
        if numel <= _DEVICE_CHUNK or not data.is_contiguous():
            return torch.aminmax(data.abs())
        flat = data.view(-1)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = [
            torch.aminmax(flat[start : start + _DEVICE_CHUNK].abs()) for start in range(0, numel, _DEVICE_CHUNK)
        ]
    elif numel <= _FRESH_MAX:
        return torch.aminmax(data.abs())  # small: a fresh temporary comes from the heap, with no page fault
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
    """The (min, max) of magnitudes reduced as integers, back as floats: the numbers a float aminmax gives, except that
    with a nan among them the min is a number where a float min is nan (the max is nan either way: its bits are the
    largest). `AbsRange.read` makes that min nan as it is read: no device op more per tensor for it."""
    low, high = int_range
    return low.view(dtype), high.view(dtype)


def values_of(data: torch.Tensor) -> torch.Tensor:
    """The values a nested or sparse tensor (detached) holds, as one strided tensor; `data` itself for any other.

    Sparse: the values stored (COO's as stored, duplicates not summed), not the zeros left out. Nested: every
    component's elements (a jagged tensor's buffer when its components fill it). Raises where the layout has no values
    to read (NotImplementedError, RuntimeError).
    """
    if data.is_nested:
        if data.layout is torch.jagged and getattr(data, "_lengths", None) is None:
            return data.values()  # the components one after another, nothing else
        parts = [part.reshape(-1) for part in data.unbind()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=data.dtype, device=data.device)
    layout = data.layout
    if layout is torch.strided:
        return data
    if layout is torch.sparse_coo:
        return data._values()  # values() asks for a coalesced tensor: coalescing would sum duplicates, a new op
    return data.values()  # CSR, CSC, BSR, BSC (blocks: still values)


def count_non_finite(tensor: torch.Tensor) -> torch.Tensor:
    """`[nan count, inf count]` of a tensor (of the values it holds: `values_of`), as one int64 vector on its
    device."""
    data = values_of(tensor.detach())
    if data.is_quantized:
        data = data.dequantize()
    elif data.dtype in FLOAT8_DTYPES:
        data = data.float()  # float8 has no isnan/isinf kernels everywhere; every float8 value is exact in float32
    return torch.stack([torch.isnan(data).sum(), torch.isinf(data).sum()])
