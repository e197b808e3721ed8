"""Which of two ways a tensor's statistics are launched: the accelerator's (few launches) or the CPU's (few passes).

On a GPU every kernel costs a launch (5-10 us of host time) whatever its size, so many tensors are measured with
multi-tensor kernels (`_foreach_*`: one launch for a list of any shapes; `pooled.py`). On the CPU those kernels are
loops that allocate every temporary at once, several times slower than measuring each tensor into a scratch buffer
(`kernels.abs_aminmax`) or stacking small ones by shape (`grouped.StackPlan`); a CPU op costs no launch. So the path
follows the tensor's device (`multi_tensor_kernels`).

benchmarks/device_ops.py counts the ops a training step dispatches, on any machine: what a GPU would launch is the
accelerator's path, so it runs that path on CPU tensors (`cpu_as_accelerator`). Nothing else does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["cpu_as_accelerator", "multi_tensor_kernels"]

_cpu_takes_accelerator_path = False


def multi_tensor_kernels(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is measured the accelerator's way: any tensor not on the CPU (and CPU tensors too inside
    `cpu_as_accelerator`)."""
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
