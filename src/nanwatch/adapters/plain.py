"""The plain-PyTorch entry point: `nanwatch.watch(model)` for a hand-written training loop.

The loop calls `handle.step()` after each micro-batch; that is the batch counter. Passing the optimizer lets nanwatch
check before every optimizer step, so a step that would apply inf/nan never runs. Under a `GradScaler` (`scaler=`),
the scale of a micro-batch's step is read as the next micro-batch starts: `step()` may come before or after
`scaler.step()`. When nanwatch raises, the handle removes its hooks first (`step()` goes on counting, recording
nothing); one watcher per model (`_take_over`).
"""

from __future__ import annotations

import contextlib
import weakref
from types import TracebackType
from typing import Any

import torch

from nanwatch.adapters import _common
from nanwatch.core.config import WatchConfig, resolve_config
from nanwatch.core.contract import AdapterContract
from nanwatch.core.log import warn
from nanwatch.core.readouts import GradScalerLike
from nanwatch.core.watcher import Watcher
from nanwatch.errors import LossScaleBelowFloor

unwrap_model = _common.unwrap_model

__all__ = ["watch", "WatchHandle", "unwrap_model"]


class WatchHandle(_common.UserHandle):
    """What `watch()` returns: call `step()` after each micro-batch; use it as a context manager or `close()` it."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: WatchConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: GradScalerLike | None = None,
    ) -> None:
        watched = _common.unwrap_model(_common.check_model(model, "watch()"))
        if optimizer is not None:
            _common.check_optimizer(optimizer, "watch()")
        # Holds the model while watching, and lets it go at close().
        self.watcher: AdapterContract = Watcher(watched, config, entry=_common.entry_module(model, watched))
        if scaler is not None:  # before attach: a bad scaler raises with no hook left behind
            self.watcher.watch_scaler(scaler, read_scale="when_settled")
        self._closed = False
        self._scale_unread = False  # a micro-batch ended; the scaler's verdict on its step is not read yet
        try:
            _take_over(watched)
            # Any other optimizer that steps the model's weights (or this one, when none was passed) is said once.
            fix = "Pass the optimizer to check before each of its steps: nanwatch.watch(model, optimizer=optimizer)"
            _common.watch_root(
                self.watcher,
                watched,
                self._before_top_forward,
                optimizers=[] if optimizer is None else [optimizer],
                models=(model, watched),
                fix=f"{fix}, or handle.guard(optimizer).",
            )
        except BaseException:
            self.watcher.close(check=False)  # a watch() that failed leaves nothing attached
            raise
        _LIVE.add(self)

    @property
    def model(self) -> torch.nn.Module:
        """The watched model (inside a DDP or torch.compile wrapper). Once closed, the handle holds it only weakly:
        `ReferenceError` when nothing else keeps it alive."""
        return self.watcher.model

    @property
    def config(self) -> WatchConfig:
        return self.watcher.config

    @property
    def optimizer_step(self) -> int | None:
        return self.watcher.optimizer_step

    @property
    def epoch(self) -> int | None:
        return self.watcher.epoch

    @epoch.setter
    def epoch(self, value: int | None) -> None:
        self.watcher.set_counters(epoch=value)

    def _before_top_forward(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        training = module.training

        def start() -> None:
            if training:
                # The first forward of a micro-batch: the previous one's scaler.step() and update() are done, whether
                # step() came before or after them, so a change of the scale seen now is that micro-batch's.
                self._settle_scale()
            self.watcher.start_batch("train" if training else "eval")

        _common.stop_on_error(self.watcher, start)

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Check (and agree across ranks) before each `optimizer.step()`; raise there so the step never runs."""
        _common.check_optimizer(optimizer, "guard()")
        _common.guard_steps(self.watcher, [optimizer])

    def step(self) -> None:
        """End the current training micro-batch: check it, then advance `batch_number`.

        Raises:
            NonFiniteError: inf/nan was seen in this micro-batch (on any rank, when distributed).
            BatchLimitReached: this was batch `abort_after_batch_num`.
        """
        if self._closed:
            raise RuntimeError("nanwatch: step() called on a closed watch handle")

        def end() -> None:
            self.watcher.start_batch("train")
            # If the optimizer guard already agreed during this micro-batch, end_batch() runs no second collective.
            self.watcher.end_batch()

        _common.stop_on_error(self.watcher, end)
        self._scale_unread = True

    def _settle_scale(self) -> None:
        # One read of the loss scale per micro-batch (none without a scaler); may raise LossScaleBelowFloor.
        if self._scale_unread:
            self._scale_unread = False
            self.watcher.on_optimizer_step("settled")

    def check(self) -> None:
        """Check now (one host sync, and a collective when distributed) rather than waiting for `step()`."""
        _common.stop_on_error(self.watcher, lambda: self.watcher.agreement_point(hold=False))

    def summary(self) -> dict[str, float]:
        """The abs max of every watched module in the last training batch checked clean, also logged to "nanwatch"
        (one transfer from the device; `summary_every_n_batches` logs the same every N batches unasked).

        Returns:
            `{"nanwatch/absmax/<module>": value, ..., "nanwatch/absmax_global": value, "nanwatch/batch_number": n}`
            (the root module is `(root)`), or an empty dict before any watched batch was checked.
        """
        summary = self.watcher.summary()
        if summary is None:
            return {}
        self.watcher.logger.info(summary.to_text())
        return summary.metrics()

    def close(self) -> None:
        """Remove every hook; check what was recorded since the last `step()` and log a report if it holds inf/nan."""
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(LossScaleBelowFloor):  # published (written and logged); close() never raises it
                self._settle_scale()  # the last micro-batch's step, if step() came before it
        finally:
            self.watcher.close()

    def __enter__(self) -> WatchHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is not None:  # log what we saw, remove the hooks, and let the user's exception propagate
            _common.close_after(exc, self.close, self.watcher.logger, "close cleanly")
            return
        if self._closed:
            return
        self._closed = True
        self.watcher.close(raise_detection=True)  # inf/nan recorded since the last step(): raised here
        self._settle_scale()  # the last micro-batch's step: may raise LossScaleBelowFloor


# The handles whose hooks may still be on a model (a handle is kept alive by its hooks, not by this set).
_LIVE: weakref.WeakSet[WatchHandle] = weakref.WeakSet()


def _take_over(model: torch.nn.Module) -> None:
    """One watcher per model: close every live handle that still has hooks on a module of `model`, with a warning.
    Two handles on one model would both record every call and both count batches; a nan in the new run would be
    raised by the old handle with its own batch number."""
    if not _LIVE:
        return
    ours = {id(module) for module in model.modules()}
    for old in list(_LIVE):
        if old._closed or not old.watcher.attached or ours.isdisjoint(map(id, old.model.modules())):
            continue
        warn(
            f"nanwatch: watch() on a model that an earlier watch() handle still watches (at its "
            f"batch_number={old.batch_number}): that handle is closed now, and the new one takes over. Close a "
            "handle when its run ends: handle.close(), or `with nanwatch.watch(...) as handle:`"
        )
        old.close()


def watch(
    model: torch.nn.Module,
    config: _common.ConfigLike = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: GradScalerLike | None = None,
    **overrides: Any,
) -> WatchHandle:
    """Watch every module of `model` for inf/nan.

    Args:
        model: the model (a DistributedDataParallel, FSDP1 or `checkpoint_wrapper` wrapper is looked through).
        config: a `WatchConfig`, a dict of its fields, or the path of a YAML/JSON file; defaults when None.
        optimizer: if given, nanwatch checks before each of its steps, so inf/nan never reaches the weights.
        scaler: the run's `torch.amp.GradScaler`, if any: inf/nan gradients on the steps it skips are then expected
            (logged, and the run goes on); the scale's history goes into the report, and the run stops when the
            scale falls below `min_loss_scale`. Pass `optimizer` too, so a step the scaler does not skip is checked.
        **overrides: fields of `WatchConfig` that replace those of `config`.

    Returns:
        A handle: call `handle.step()` after each micro-batch; `with watch(model) as handle:` removes the hooks at
        the end of the block. An earlier handle that still watches `model` is closed, with a `NanwatchWarning`.

    Raises:
        ConfigError: the config or an override names an unknown field or holds a bad value.
        TypeError: `scaler` is not a GradScaler.
    """
    _common.check_config(config, "watch()")
    return WatchHandle(model, resolve_config(config, **overrides), optimizer=optimizer, scaler=scaler)
