"""The plain-PyTorch entry point: `nanwatch.watch(model)` for a hand-written training loop.

The loop calls `handle.step()` after each micro-batch; that is the batch counter. Passing the optimizer lets nanwatch
check before every optimizer step, so a step that would apply inf/nan never runs. Under a `GradScaler` (`scaler=`),
the scale of a micro-batch's step is read as the next micro-batch starts: `step()` may come before or after
`scaler.step()`. When nanwatch raises, the handle removes its hooks first (`step()` goes on counting, recording
nothing); one watcher per model (`take_over`, in `_loop.py`
beside this module).
"""

from __future__ import annotations

import contextlib
import os
from types import TracebackType
from typing import Any

import torch

from nanwatch.adapters._checks import ConfigLike, check_model, check_skip, entry_module, unwrap_model
from nanwatch.adapters._hooks import close_after, guard_steps, stop_on_error, watch_root
from nanwatch.adapters._user_handle import UserHandle
from nanwatch.adapters.plain._loop import ScaleAfterStep, check_config, check_optimizer, hold, take_over
from nanwatch.adapters.plain._rewind import LiveParts, SchedulerArg, schedulers_given
from nanwatch.core.config import WatchConfig, resolve_config
from nanwatch.core.contract import AdapterContract
from nanwatch.core.readouts import GradScalerLike
from nanwatch.core.rewinds import RewindPoint
from nanwatch.core.watcher import Watcher
from nanwatch.errors import LossScaleBelowFloor

__all__ = ["watch", "WatchHandle", "unwrap_model"]


class WatchHandle(UserHandle):
    """What `watch()` returns: call `step()` after each micro-batch; use it as a context manager or `close()` it."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: WatchConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: GradScalerLike | None = None,
        scheduler: SchedulerArg = None,
    ) -> None:
        watched = unwrap_model(check_model(model, "watch()"))
        if optimizer is not None:
            check_optimizer(optimizer, "watch()")
        schedulers = schedulers_given(scheduler, "watch()")
        fix = "pass it, nanwatch.watch(model, optimizer=optimizer, on_detect='skip')"
        check_skip(config, [] if optimizer is None else [optimizer], "watch()", fix)
        # Under on_detect="rewind": the loop's objects a checkpoint is restored into (weakly held), else None.
        self._rewind: LiveParts | None = None
        if config.on_detect == "rewind":
            optimizers = [] if optimizer is None else [getattr(optimizer, "optimizer", optimizer)]
            self._rewind = LiveParts(model, watched, optimizers=optimizers, schedulers=schedulers, scaler=scaler)
        # Holds the model while watching, and lets it go at close().
        self.watcher: AdapterContract = Watcher(watched, config, entry=entry_module(model, watched))
        if scaler is not None:  # before attach: a bad scaler raises with no hook left behind
            self.watcher.watch_scaler(scaler, read_scale="when_settled")
        if self._rewind is not None:
            self.watcher.restore_with(self._rewind.restore)
        self._closed = False
        self._scale = ScaleAfterStep(self.watcher)
        try:
            take_over(watched, caller="watch()", fix="handle.close(), or `with nanwatch.watch(...) as handle:`")
            # Any other optimizer that steps the model's weights (or this one, when none was passed) is said once.
            fix = "Pass the optimizer to check before each of its steps: nanwatch.watch(model, optimizer=optimizer)"
            watch_root(
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
        hold(self)

    @property
    def model(self) -> torch.nn.Module:
        """The watched model (inside a DDP or torch.compile wrapper). Once closed, the handle holds it only weakly:
        `ReferenceError` when nothing else keeps it alive."""
        return self.watcher.model

    @property
    def config(self) -> WatchConfig:
        return self.watcher.config

    def _before_top_forward(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        training = module.training

        def start() -> None:
            if training:
                # The first forward of a micro-batch: the previous one's scaler.step() and update() are done, whether
                # step() came before or after them, so a change of the scale seen now is that micro-batch's.
                self._scale.read(in_hook=True)
            self.watcher.start_batch("train" if training else "eval")

        stop_on_error(self.watcher, start)

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Check (and agree across ranks) before each `optimizer.step()`; raise there so the step never runs."""
        check_optimizer(optimizer, "guard()")
        guard_steps(self.watcher, [optimizer])
        if self._rewind is not None:
            self._rewind.add_optimizer(getattr(optimizer, "optimizer", optimizer))

    def save_checkpoint(self, state: Any, path: str | os.PathLike[str], *, step: int | None = None) -> None:
        """`torch.save(state, path)`, once every weight and optimizer state in `state` is checked finite (one fused
        check; `checkpoint_guard`). Pass modules and optimizers or their state dicts: `{"model": model.state_dict(),
        "optimizer": optimizer.state_dict()}`. A buffer of the model that held inf/nan as watching began (an
        attention mask) may hold the same. A finite checkpoint is the one later reports name as where to resume, and
        under `on_detect="rewind"` the one a rewind restores (docs/long-runs.md says what each entry may be).

        Raises:
            NonFiniteCheckpoint: `state` holds inf/nan; nothing was written to `path` (with `checkpoint_guard=
                "quarantine"`, it was written to `<folder of path>/nanwatch-quarantine/<file>.nonfinite`).
            ConfigError: under `on_detect="rewind"`, `state` is not a checkpoint a rewind could restore in full
                (the model or the optimizer's state missing, an entry nanwatch cannot place); nothing was written.
        """
        layout = None if self._rewind is None else self._rewind.layout_of(state)  # refused before anything is written
        super().save_checkpoint(state, path, step=step)
        if layout is not None:
            used = self.watcher.counters.optimizer_step if step is None else step  # as the guard named it
            self.watcher.note_rewind_point(RewindPoint(os.fspath(path), used, layout))

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

        stop_on_error(self.watcher, end)
        self._scale.step_done()

    def check(self) -> None:
        """Check now (one host sync, and a collective when distributed) rather than waiting for `step()`."""
        stop_on_error(self.watcher, lambda: self.watcher.agreement_point(hold=False))

    def close(self) -> None:
        """Remove every hook; check what was recorded since the last `step()` and log a report if it holds inf/nan."""
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(LossScaleBelowFloor):  # published (written and logged); close() never raises it
                self._scale.read()  # the last micro-batch's step, if step() came before it
        finally:
            self.watcher.close()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is not None:  # log what we saw, remove the hooks, and let the user's exception propagate
            close_after(exc, self.close, self.watcher.logger, "close cleanly")
            return
        if self._closed:
            return
        self._closed = True
        self.watcher.close(raise_detection=True)  # inf/nan recorded since the last step(): raised here
        self._scale.read()  # the last micro-batch's step: may raise LossScaleBelowFloor


def watch(
    model: torch.nn.Module,
    config: ConfigLike = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: GradScalerLike | None = None,
    scheduler: SchedulerArg = None,
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
        scheduler: the run's LR scheduler (`torch.optim.lr_scheduler.LRScheduler`), or a list of them: under
            `on_detect="rewind"`, restored from a checkpoint that holds its state; unused otherwise.
        **overrides: fields of `WatchConfig` that replace those of `config`.

    Returns:
        A handle: call `handle.step()` after each micro-batch; `with watch(model) as handle:` removes the hooks at
        the end of the block. An earlier handle that still watches `model` is closed, with a `NanwatchWarning`.

    Raises:
        ConfigError: the config or an override names an unknown field or holds a bad value; or `on_detect="skip"`
            without `optimizer` (there is no step to skip).
        TypeError: `scaler` is not a GradScaler, or `scheduler` not an LR scheduler.
    """
    check_config(config, "watch()")
    return WatchHandle(
        model, resolve_config(config, **overrides), optimizer=optimizer, scaler=scaler, scheduler=scheduler
    )
