"""What the user holds: the members `nanwatch.watch`'s handle (plain) and Accelerate's tracker share (`UserHandle`).

What only the plain loop's handle needs (one live handle per model, the loop's GradScaler read once per micro-batch)
lives beside it, in `plain/_loop.py`."""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch

from nanwatch.adapters._checkpoints import save_checked
from nanwatch.core.contract import AdapterContract
from nanwatch.core.rewinds import Rewind

__all__ = ["UserHandle"]

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

    @property
    def rewinds(self) -> list[Rewind]:
        """Under `on_detect="rewind"`: each rewind, oldest first (`batch_number`, the checkpoint's `path` and
        `optimizer_step`, what was `restored`; report_dir/rewinds.jsonl)."""
        return [] if self.watcher is None else self.watcher.rewinds

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
        return 0 if self.watcher is None else self.watcher.counters.batch_number

    @property
    def optimizer_step(self) -> int | None:
        """Optimizer steps so far (guarded steps, or the framework's count); None when nothing counts them."""
        return None if self.watcher is None else self.watcher.counters.optimizer_step

    @property
    def epoch(self) -> int | None:
        """The epoch in the reports; None until the framework or the user says one (`handle.epoch = n`)."""
        return None if self.watcher is None else self.watcher.counters.epoch

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
