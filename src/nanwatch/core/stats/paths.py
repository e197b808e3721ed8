"""Which way a tensor's statistics are launched: for few launches (an accelerator) or for few passes (the CPU).

On a GPU every kernel costs a launch (5-10 us of host time) whatever its size, so there many tensors are measured with
multi-tensor kernels (`_foreach_*`: a few launches for a list of any shapes; `pooled.py`). On the CPU those kernels
are loops that allocate every temporary at once, several times slower than measuring each tensor into a scratch
buffer (`kernels.abs_aminmax`) or stacking small ones by shape (`grouped.StackPlan`); a CPU op costs no launch.

`multi_tensor_kernels`: CUDA (and ROCm, which torch calls cuda), where torch fuses the multi-tensor kernels nanwatch
uses. Other accelerators (MPS, XPU, XLA) may run them as loops of one kernel per tensor, which would cost more
launches than it saves: they keep measuring each tensor as it is seen. `accelerator_path`: any device but the CPU,
for the choices that only ask whether the device is the CPU (chunk sizes, a scratch buffer on the host, the guard's
`_foreach_norm`).

benchmarks/device_ops.py counts the ops a training step dispatches, on any machine: what a GPU would launch is the
accelerator's path, so it runs that path on CPU tensors (`cpu_as_accelerator`), as the tests' `--accelerator-path`
option does (tests/conftest.py) to check it without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["accelerator_path", "cpu_as_accelerator", "multi_tensor_kernels"]

_cpu_takes_accelerator_path = False


def multi_tensor_kernels(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is measured with others, by multi-tensor kernels: a CUDA tensor (and CPU tensors too inside
    `cpu_as_accelerator`)."""
    return tensor.is_cuda or _cpu_takes_accelerator_path


def accelerator_path(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is on an accelerator (any device but the CPU; CPU tensors too inside `cpu_as_accelerator`)."""
    return not tensor.is_cpu or _cpu_takes_accelerator_path


@contextmanager
def cpu_as_accelerator() -> Iterator[None]:
    """CPU tensors measured the accelerator's way while inside: for counting, on a machine without one, the ops a GPU
    would launch (benchmarks/device_ops.py). The numbers are the same either way; only the ops differ."""
    global _cpu_takes_accelerator_path
    before = _cpu_takes_accelerator_path
    _cpu_takes_accelerator_path = True
    try:
        yield
    finally:
        _cpu_takes_accelerator_path = before
