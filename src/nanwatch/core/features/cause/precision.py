"""The precision test: the culprit recomputed in a wider dtype from the same finite inputs and weights.

If the wider run is finite, the narrow dtype's range was what failed: the evidence is that dtype's largest value,
the magnitude the wider run needed, and, where the module is a composite, the first op whose result passed the
narrow dtype's range (found by running both with an op recorder and comparing them op by op).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from nanwatch.core.features.cause.compiled import running_eagerly
from nanwatch.core.features.cause.hooks import without_hooks
from nanwatch.core.features.cause.records import CulpritCall
from nanwatch.core.runstate import autocast_as, capture_rng_states, restore_rng_states

__all__ = ["Inconclusive", "OpResult", "PrecisionFinding", "precision_test", "wider"]


class Inconclusive(Exception):
    """The test ran but cannot tell: its message says why."""


def wider(dtype: torch.dtype) -> torch.dtype:
    """The dtype a culprit is recomputed in: float32 for the 16- and 8-bit floats, float64 for float32."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


@dataclass(frozen=True)
class OpResult:
    """One op of a recorded run: its name, and the largest magnitude of its floating-point results (inf/nan kept)."""

    name: str
    abs_max: float
    finite: bool


@dataclass(frozen=True)
class PrecisionFinding:
    """What the precision test found.

    Attributes:
        narrow: the dtype the culprit ran in; wide: the dtype it was recomputed in.
        wide_finite: whether the recomputation was finite (the cause is "precision" only then).
        wide_abs_max: the largest magnitude of the recomputed outputs.
        narrow_max: the narrow dtype's largest finite value.
        first_op: the first op whose narrow result was non-finite while the wide one was finite, with the wide
            magnitude it needed; None where no op could be told apart (the op recorder could not run).
        first_op_needed: that op's magnitude in the wide run.
    """

    narrow: torch.dtype
    wide: torch.dtype
    wide_finite: bool
    wide_abs_max: float | None
    narrow_max: float
    first_op: str | None
    first_op_needed: float | None


# Ops that only allocate (their contents are whatever the memory held): never the op that went non-finite.
_ALLOCATIONS = ("empty", "new_empty")


class _OpRecorder(TorchDispatchMode):
    """Notes every op's floating-point results' largest magnitude, in order (only on a detection: it syncs)."""

    ops: list[OpResult]  # set before use: the mode keeps torch's (unannotated) constructor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket.__name__).startswith(_ALLOCATIONS):  # uninitialised memory: nothing computed
            return out
        floats = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
        if floats:
            finite = all(bool(torch.isfinite(leaf).all()) for leaf in floats)
            magnitude = max(float(leaf.detach().abs().max()) if leaf.numel() else 0.0 for leaf in floats)
            self.ops.append(OpResult(str(func.overloadpacket.__name__), magnitude, finite))
        return out


@dataclass(frozen=True)
class _Run:
    """A run of a copy of the culprit: its floating-point outputs, and the ops it ran."""

    outputs: list[torch.Tensor]
    ops: list[OpResult]


def _run(module: torch.nn.Module, call: CulpritCall, dtype: torch.dtype | None) -> _Run:
    """Run a copy of the culprit on copies of its inputs: as it ran (`dtype` None), or everything floating-point cast
    to `dtype` with autocast off; from the random generators' state at the call (a dropout draws the same mask in
    both runs), put back as they were afterwards. The copy runs without hooks: the user's are not called again."""
    without_hooks(module)
    args, kwargs = tree_map_only(torch.Tensor, lambda tensor: tensor.clone(), (call.args, call.kwargs))
    with torch.no_grad():  # the state the call began in (a counter, running statistics), not the state after it
        for name, value in call.buffers.items():
            module.get_buffer(name).copy_(value)
    if dtype is not None:
        module = module.to(dtype)
        args, kwargs = tree_map_only(
            torch.Tensor, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor, (args, kwargs)
        )
    recorder = _OpRecorder()  # type: ignore[no-untyped-call]
    recorder.ops = []
    callers = capture_rng_states(numpy=True)
    try:
        restore_rng_states(call.rng)
        with torch.no_grad(), running_eagerly(), autocast_as(call.autocast if dtype is None else {}), recorder:
            output = module(*args, **kwargs)
    finally:
        restore_rng_states(callers)
    floats = [leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
    return _Run(floats, recorder.ops)


def precision_test(call: CulpritCall) -> PrecisionFinding:
    """Recompute the culprit from the same inputs and weights in a wider dtype (module and inputs copied: the live
    module is not touched), and compare the two runs op by op.

    Raises:
        RuntimeError, MemoryError: the recomputation failed (the caller says the test could not run).
    """
    narrow = call.output_dtype or torch.float32
    wide = wider(narrow)
    narrow_run = _run(copy.deepcopy(call.module), call, None)
    if all(bool(torch.isfinite(leaf).all()) for leaf in narrow_run.outputs):
        raise Inconclusive(
            "a copy of the culprit run alone on the same inputs comes out finite: what it computes depends on more "
            "than its inputs, weights and buffers"
        )
    wide_run = _run(copy.deepcopy(call.module), call, wide)
    wide_finite = all(bool(torch.isfinite(leaf).all()) for leaf in wide_run.outputs)
    magnitudes = [float(leaf.abs().max()) for leaf in wide_run.outputs if leaf.numel()]
    first_op = first_needed = None
    if wide_finite:
        for narrow_op, wide_op in zip(narrow_run.ops, wide_run.ops):  # noqa: B905  (a shorter run just compares less)
            if narrow_op.name != wide_op.name:
                break  # the two runs took different paths: nothing more can be matched op by op
            if not narrow_op.finite and wide_op.finite:
                first_op, first_needed = narrow_op.name, wide_op.abs_max
                break
    return PrecisionFinding(
        narrow=narrow,
        wide=wide,
        wide_finite=wide_finite,
        wide_abs_max=max(magnitudes) if magnitudes else None,
        narrow_max=float(torch.finfo(narrow).max),
        first_op=first_op,
        first_op_needed=first_needed,
    )
