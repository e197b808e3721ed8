"""What the user holds: the members `nanwatch.watch`'s handle and Accelerate's tracker share (`UserHandle`), and one
live handle per model (`take_over`), and the scale of the loop's GradScaler read once per micro-batch
(`ScaleAfterStep`)."""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol, TypeVar

import torch

from nanwatch.adapters._checkpoints import save_checked
from nanwatch.core.contract import AdapterContract
from nanwatch.core.log import warn

__all__ = ["UserHandle", "LiveHandle", "hold", "let_go", "take_over", "ScaleAfterStep"]

_H = TypeVar("_H", bound="UserHandle")


class UserHandle:
    """What the object a user holds (`nanwatch.watch`'s handle, Accelerate's tracker) offers in both: the counters
    (0 or None before there is a watcher), a loss recorded, a summary on demand, a checked checkpoint, the skipped
    micro-batches, `with handle:`."""

    watcher: AdapterContract | None
    _epoch_said: int | None = None  # by `set_epoch`, for a watcher that comes later too

    def save_checkpoint(self, state: Any, path: str | os.PathLike[str], *, step: int | None = None) -> None:
        """`torch.save(state, path)`, once every weight and optimizer state in `state` is checked finite (one fused
        check; `checkpoint_guard`). Pass modules and optimizers or their state dicts: `{"model": model.state_dict(),
        "optimizer": optimizer.state_dict()}`. A buffer of the model that held inf/nan as watching began (an
        attention mask) may hold the same. A finite checkpoint is the one later reports name as where to resume.

        Raises:
            NonFiniteCheckpoint: `state` holds inf/nan; nothing was written to `path` (with `checkpoint_guard=
                "quarantine"`, it was written to `<folder of path>/nanwatch-quarantine/<file>.nonfinite`).
        """
        if self.watcher is None:
            raise RuntimeError("nanwatch: save_checkpoint() needs a watcher (attach() first)")
        save_checked(self.watcher, state, path, step)

    @property
    def skipped(self) -> list[dict[str, object]]:
        """Under `on_detect="skip"`: the micro-batches whose optimizer step was skipped (report_dir/skipped.jsonl)."""
        return [] if self.watcher is None else self.watcher.skipped

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Record a loss computed outside the model as a frame of its own (module `(loss)`); returns `loss`:
        `scaler.scale(handle.watch_loss(loss)).backward()`, `accelerator.backward(tracker.watch_loss(loss))`.

        A non-finite loss is then reported as such. Under a `GradScaler` it matters most: an inf loss makes every
        gradient inf, which without this looks like an overflow the scaler handles, until the scale hits its floor. A
        loss the model returns (as transformers models do) is already in the model's own frame.
        """
        if self.watcher is not None:
            self.watcher.watch_loss(loss)
        return loss

    @property
    def batch_number(self) -> int:
        """The current training micro-batch, 0-indexed: how many have ended."""
        return 0 if self.watcher is None else self.watcher.batch_number

    @property
    def optimizer_step(self) -> int | None:
        """Optimizer steps so far (guarded steps, or the framework's count); None when nothing counts them."""
        return None if self.watcher is None else self.watcher.optimizer_step

    @property
    def epoch(self) -> int | None:
        """The epoch in the reports; None until the framework or the user says one (`handle.epoch = n`)."""
        return None if self.watcher is None else self.watcher.epoch

    @epoch.setter
    def epoch(self, value: int | None) -> None:
        self.set_epoch(value)

    def set_epoch(self, epoch: int | None) -> None:
        """Say which epoch runs now (`handle.epoch = epoch` does the same): it is the epoch, over one a framework
        reads (Accelerate's dataloader), until said again, or None."""
        self._epoch_said = epoch
        if self.watcher is not None:
            self.watcher.set_counters(epoch=epoch)

    def summary(self) -> dict[str, float]:
        """The abs max of every watched module in the last training batch checked clean, also logged to "nanwatch"
        (one transfer from the device; `summary_every_n_batches` logs the same every N batches unasked).

        Returns:
            `{"nanwatch/absmax/<module>": value, ..., "nanwatch/absmax_global": value, "nanwatch/batch_number": n}`
            (the root module is `(root)`), or an empty dict before any watched batch was checked.
        """
        if self.watcher is None or (summary := self.watcher.summary()) is None:
            return {}
        self.watcher.logger.info(summary.to_text())
        return summary.metrics()

    def __enter__(self: _H) -> _H:
        return self


# ------------------------------------------------------------------------------ one live handle per model


class LiveHandle(Protocol):
    """A handle whose hooks may be on a model until it is closed."""

    @property
    def watcher(self) -> AdapterContract | None: ...

    @property
    def batch_number(self) -> int: ...

    def close(self) -> None: ...


# The handles whose hooks may still be on a model (a handle is kept alive by its hooks, not by this set).
_LIVE: weakref.WeakSet[LiveHandle] = weakref.WeakSet()


def hold(handle: LiveHandle) -> None:
    """`handle` watches its model now, until `let_go(handle)`: a later `take_over` of that model closes it."""
    _LIVE.add(handle)


def let_go(handle: LiveHandle) -> None:
    """`handle` is closed (or shares its model on purpose, as benchmarks/overhead.py does): no `take_over` closes it."""
    _LIVE.discard(handle)


def take_over(model: torch.nn.Module, *, caller: str, fix: str) -> None:
    """One watcher per model: close every live handle that still has hooks on a module of `model`, with a warning
    that names `caller` and how to close a handle (`fix`). Two handles on one model would both record every call and
    both count batches; a nan in the new run would be raised by the old handle with its own batch number."""
    if not _LIVE:
        return
    ours = {id(module) for module in model.modules()}
    for old in list(_LIVE):
        watcher = old.watcher
        if watcher is None or not watcher.attached or ours.isdisjoint(map(id, watcher.model.modules())):
            continue
        warn(
            f"nanwatch: {caller} on a model that an earlier {caller} handle still watches (at its "
            f"batch_number={old.batch_number}): that handle is closed now, and the new one takes over. Close a "
            f"handle when its run ends: {fix}"
        )
        old.close()


# ----------------------------------------------------------------------- the scale of the loop's GradScaler


class ScaleAfterStep:
    """A hand-written loop calls `handle.step()` before or after `scaler.step()` and `update()`: the scale that a
    micro-batch's step left is read once (none without a scaler), as the next training micro-batch starts or watching
    ends, when that step is surely done (`watch_scaler(read_scale="when_settled")`)."""

    def __init__(self, watcher: AdapterContract) -> None:
        self._watcher = watcher
        self._unread = False  # a micro-batch ended; the scaler's verdict on its step is not read yet

    def step_done(self) -> None:
        """A micro-batch ended: its optimizer step is done, or will be by the next forward."""
        self._unread = True

    def read(self, *, in_hook: bool = False) -> None:
        """Read the scale of the last micro-batch's step, if not read yet; may raise `LossScaleBelowFloor`.

        `in_hook`: called from a forward pre-hook, where reading a GPU's scale would wait for the GPU: the scale is
        copied there and read with the next check (the "settling" stage)."""
        if self._unread:
            self._unread = False
            self._watcher.on_optimizer_step("settling" if in_hook else "settled")
