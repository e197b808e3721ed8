"""Keeping the current micro-batch's outermost forward calls, by reference, so a detection can run them again.

All the clean path pays per outermost forward: one pre-hook and one hook call, a few references, the generators'
state (a copy of a few kilobytes), each input tensor's version counter, and a copy of the buffers a forward was seen
to change (a BatchNorm's running statistics, a step counter): a rerun starts from the state the forward started
from. Which buffers a forward changes is learnt once, at the first forward, by comparing every buffer before and
after it (kernels such as BatchNorm's write their running statistics without moving a version counter).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nanwatch.core.features.cause.records import KeptBuffer, KeptCall
from nanwatch.core.runstate import autocast_state, capture_rng_states

__all__ = ["CallKeeper", "same_values"]

_compiling = torch.compiler.is_compiling

# Calls kept at most between two checks (a loop that never ends its micro-batches would otherwise keep every one).
MAX_KEPT = 16


class CallKeeper:
    """The outermost forward calls of the modules it hooks since the last check (`clear`), oldest first."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.calls: list[KeptCall] = []
        self._depth = 0
        self._model = model
        self._changing: list[torch.Tensor] = []  # the buffers a forward changes: copied at each kept call
        self._learnt = False  # whether `_changing` was learnt (at the first forward)
        self._learning: list[KeptBuffer] = []  # during the first forward: every buffer, copied as it began
        self.failed: str | None = None  # why keeping stopped (an input or buffer it could not handle), or None
        self.names: dict[int, str] = {}  # the hooked modules other than the model, by id: their names in it

    def before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A forward pre-hook (with keyword arguments): a call of a hooked module begins. Keeping never fails the
        user's forward: an input or buffer it cannot handle stops the keeping (`failed` says why), not the run."""
        if _compiling() or self.failed is not None:  # inside a graph torch.compile traces: not kept
            return
        try:
            self._before(module, args, kwargs)
        except Exception as error:
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        self.failed = repr(error)
        self.calls, self._learning = [], []

    def _before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._depth += 1
        if self._depth > 1 or len(self.calls) >= MAX_KEPT:  # a call inside a kept one, or too many kept
            return
        with torch.no_grad():
            if not self._learnt and self._model is not None:
                self._learning = [KeptBuffer(buffer, buffer.detach().clone()) for buffer in self._model.buffers()]
                buffers = list(self._learning)
            else:
                buffers = [KeptBuffer(buffer, buffer.detach().clone()) for buffer in self._changing]
        # An inference tensor keeps no version counter: nothing in place can change it either.
        versions = [
            (leaf, leaf._version)
            for leaf in tree_leaves((args, kwargs))
            if isinstance(leaf, torch.Tensor) and not leaf.is_inference()
        ]
        name = self.names.get(id(module))
        self.calls.append(
            KeptCall(
                module=module,
                args=args,
                kwargs=dict(kwargs),
                rng=capture_rng_states(),
                autocast=autocast_state(),
                versions=versions,
                buffers=buffers,
                name=name,
            )
        )

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """A forward hook (always run, `always_call=True`): the call ended, or raised."""
        if _compiling() or self.failed is not None:
            return
        self._depth = max(0, self._depth - 1)
        if self._depth or self._learnt:
            return
        try:
            with torch.no_grad():
                self._changing = [kept.buffer for kept in self._learning if not same_values(kept.buffer, kept.saved)]
        except Exception as error:
            self._fail(error)
        self._learnt, self._learning = True, []

    def clear(self) -> None:
        """A check took the frames these calls made: they are no longer needed."""
        self.calls = []
        self._depth = 0


def same_values(tensor: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether `tensor` holds what `saved` holds, nan where it held nan."""
    if tensor.shape != saved.shape or tensor.dtype != saved.dtype:
        return False
    if torch.equal(tensor, saved):
        return True
    if not tensor.is_floating_point():
        return False
    return bool(torch.equal(tensor.isnan(), saved.isnan())) and bool(
        torch.equal(tensor.nan_to_num(0.0), saved.nan_to_num(0.0))
    )
