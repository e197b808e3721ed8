"""How sentinel mode reads the model's output: one pass on the device, no host sync, until the check's one read.

Apart from the feature because this is its hot path, the only work it adds to every training call besides keeping
references: a min and max (or, in evaluation, a sum) per float output, read on the host only when a flag trips.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch.core.feature_api import Phase
from nanwatch.core.stats.kernels import FLOAT8_DTYPES
from nanwatch.core.stats.measure import measure
from nanwatch.core.walk import walk

__all__ = ["Seen", "float_leaves", "holds_non_finite", "look_at", "unreadable"]

# Evaluation outputs of these dtypes are summed (float16/bfloat16 sums need a float32 pass, slower than aminmax).
_SUMMED = frozenset((torch.float32, torch.float64))


@dataclass
class Seen:
    """What was seen of one output: 0-d device tensors, any of them inf/nan when a value is; and what it is of."""

    values: tuple[torch.Tensor, ...]
    what: str
    batch_number: int
    phase: Phase
    output: torch.Tensor | None = None  # kept until the check when `values` is a sum, which can overflow


def float_leaves(value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield "output", value
        return
    for label, leaf in walk(value, "output"):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            yield label, leaf


def look_at(output: torch.Tensor, what: str, batch_number: int, training: bool) -> Seen | None:
    """One read-only pass over `output`, no host sync. In training its min and max: exact (neither overflows from
    finite values), and nothing is kept, since the check comes at the optimizer step. In evaluation, checked as the
    batch ends, a float32/float64 output is summed (the cheapest pass there is) and kept until then, so a sum that
    overflowed from finite values is told from an inf/nan by looking at the output itself. A float8, nested or sparse
    output is measured as full mode measures it; None when it cannot be read at all."""
    phase: Phase = "train" if training else "eval"
    if output.layout is not torch.strided or output.is_nested or output.dtype in FLOAT8_DTYPES:
        return _look_at_odd(output, what, batch_number, phase)
    if not training and output.dtype in _SUMMED:
        return Seen((output.sum(),), what, batch_number, "eval", output)
    return Seen(tuple(torch.aminmax(output)), what, batch_number, phase)


def _look_at_odd(output: torch.Tensor, what: str, batch_number: int, phase: Phase) -> Seen | None:
    """A float8, nested or sparse output, which torch cannot reduce in one `aminmax`: its abs max as full mode
    measures it (inf/nan when any value is), over a sparse tensor's stored values; None when it cannot be read."""
    if output.layout is torch.sparse_coo:
        output = output._values()
    elif output.layout is not torch.strided and not output.is_nested:  # CSR, CSC, BSR, BSC
        output = output.values()
    found = measure(output)
    if found.abs_max is None:
        return None
    return Seen((found.abs_max,), what, batch_number, phase)


def holds_non_finite(item: Seen) -> bool:
    """The slow path, for the few items whose flag tripped: read their numbers (and look at a kept output)."""
    if all(_finite(float(value)) for value in item.values):
        return False
    return item.output is None or not bool(torch.isfinite(item.output).all())


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def unreadable(module: torch.nn.Module, output: Any, *, guarded: bool) -> str:
    """What to say of an output that holds no floating-point tensor: what was returned, what is still checked."""
    if output is None or isinstance(output, (bool, int, float)):
        returned = repr(output) if output is None else f"a {type(output).__name__} ({output!r})"
    elif isinstance(output, torch.Tensor):
        returned = f"a {str(output.dtype).removeprefix('torch.')} tensor"
    else:
        returned = f"a {type(output).__name__} with no floating-point tensor in it"
    checked = (
        "only the gradients are checked, before each optimizer step (and a loss recorded with watch_loss)"
        if guarded
        else "with no optimizer guarded, nothing else is either (but a loss recorded with watch_loss)"
    )
    return (
        f"nanwatch sentinel mode: the forward of {type(module).__name__} returned {returned}, so its output is not "
        f"checked; {checked}. Return the output (or the loss) as a floating-point tensor, record the loss with "
        "watch_loss(loss), pass the optimizer (optimizer=) so the gradients are checked before each step, or watch "
        "with mode='full'. (Said once.)"
    )
