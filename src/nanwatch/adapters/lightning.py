"""Lightning: `Trainer(callbacks=[OverflowCallback()])` watches the LightningModule's submodules for inf/nan.

How Lightning's counters map onto nanwatch's:

- `batch_number`: every training micro-batch since training began, across epochs (with `accumulate_grad_batches`
  each micro-batch counts). Counted by nanwatch itself in `on_train_batch_end`; Lightning's `batch_idx` restarts
  every epoch and `global_step` counts optimizer steps, so neither is it.
- `optimizer_step`: `trainer.global_step` when the micro-batch starts, i.e. the 0-indexed optimizer step that will
  apply this micro-batch's gradients.
- `epoch`: `trainer.current_epoch`.

The check of each micro-batch and its one all-reduce run in `on_before_backward` (`on_before_optimizer_step` under
manual optimization), which every rank reaches: inf/nan raises `NonFiniteError` there on every rank, so the optimizer
step that would apply it never runs. `abort_after_batch_num` stops the run the Lightning way, by setting
`trainer.should_stop` (as `EarlyStopping` does): `fit()` returns normally, loggers and checkpoints are finalized.
With `summary_every_n_batches`, rank zero sends the per-module abs max to every logger in `trainer.loggers` at
`trainer.global_step` (to the "nanwatch" logger when the Trainer has none).
With `watch_gradients`, `on_before_optimizer_step` is an agreement point too (a second all-reduce per optimizer step),
so an inf/nan gradient stops the run before the step that would apply it. Under a `GradScaler` (the precision
plugin's `scaler`, found by itself) inf/nan gradients on steps the scaler skips are expected (see core/amp.py);
the loss given to `on_before_backward` is recorded as the `(loss)` frame, and the scale is read at each batch end.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer

from nanwatch.core.amp import GradScalerLike, scaler_of
from nanwatch.core.config import WatchConfig, resolve_config
from nanwatch.core.summary import Summary
from nanwatch.core.watcher import Watcher
from nanwatch.errors import BatchLimitReached, NonFiniteError

__all__ = ["OverflowCallback"]

_LIGHTNING_IMPORT_ERROR: ImportError | None = None
if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer
else:
    try:
        from lightning.pytorch import Callback
    except ImportError as error:  # raised again, with the install hint, when the callback is constructed
        _LIGHTNING_IMPORT_ERROR = error
        Callback = object


class OverflowCallback(Callback):
    """A Lightning callback that finds the first inf/nan in a forward pass and stops every rank there.

    Args:
        config: a `WatchConfig`, a dict of its fields, or the path of a YAML/JSON file; defaults when None.
        **overrides: fields of `WatchConfig` that replace those of `config` (e.g. `max_frames_to_save=50`).

    Attributes:
        config: the resolved `WatchConfig`.
        watcher: the core `Watcher` while a fit (or a watched validate/test) runs; None before and after.

    Raises:
        ImportError: the `lightning` package is not installed.
        ConfigError: the config or an override names an unknown field or holds a bad value.
    """

    def __init__(self, config: WatchConfig | dict[str, Any] | str | Path | None = None, **overrides: Any) -> None:
        if _LIGHTNING_IMPORT_ERROR is not None:
            raise ImportError(
                "nanwatch's OverflowCallback needs the `lightning` package, which could not be imported "
                f'({_LIGHTNING_IMPORT_ERROR}). Install it with: pip install "nanwatch[lightning]"'
            ) from _LIGHTNING_IMPORT_ERROR
        super().__init__()
        self.config = resolve_config(config, **overrides)
        self.watcher: Watcher | None = None
        # Counters kept between fits and restored from a checkpoint before `on_fit_start` creates the watcher.
        self._counters: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------- lifecycle

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watcher is not None:
            return
        watcher = Watcher(pl_module, self.config, rank=trainer.global_rank, world_size=trainer.world_size)
        if self._counters is not None:
            watcher.load_state_dict(self._counters)
        # The LightningModule itself is left out: under DDP its forward runs as the wrapper's, elsewhere not at all.
        watcher.attach((name, module) for name, module in pl_module.named_modules() if module is not pl_module)
        if not trainer.is_global_zero:
            watcher.summary_sink = None  # Lightning's loggers write on rank zero only: no read-back elsewhere
        elif trainer.loggers:  # without any, the summary goes to the "nanwatch" logger
            watcher.summary_sink = lambda summary: _log_summary(trainer, summary)
        scaler = scaler_of(trainer.precision_plugin)  # MixedPrecision("16-mixed") and FSDP's have one
        if scaler is not None:
            _follow_scaler(watcher, scaler, trainer.optimizers)
        self.watcher = watcher

    def _stop(self) -> None:
        if self.watcher is not None:
            self._counters = self.watcher.state_dict()
            self.watcher.detach()
            self.watcher = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config.watch_eval:  # a stand-alone `trainer.validate()`; under `fit()` the watcher already runs
            self._start(trainer, pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config.watch_eval:
            self._start(trainer, pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning re-raises `exception` after this hook; nothing here may replace or hide it.
        try:
            if self.watcher is not None and not isinstance(exception, NonFiniteError):
                self.watcher.flush()  # the user's own error may come from an inf/nan we saw: log it, no collective
        except Exception as error:
            if self.watcher is not None:
                self.watcher.logger.warning(f"nanwatch could not check the last batch after {exception!r}: {error!r}")
        finally:
            self._stop()

    # ------------------------------------------------------------------------------------------- training

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.watcher is not None:
            self.watcher.set_phase("train")
            self.watcher.optimizer_step = trainer.global_step
            self.watcher.epoch = trainer.current_epoch

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self.watcher is not None and self.watcher.loss_scale is not None:
            # Under a scaler an inf loss would pass for an overflow the scaler handles (core/amp.py).
            self.watcher.watch_loss(loss)
        # Automatic optimization runs exactly one backward per micro-batch, before any optimizer step that uses it.
        if self.watcher is not None and pl_module.automatic_optimization:
            self.watcher.agreement_point()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        # Manual optimization may run any number of backwards; what must not happen is a step applying inf/nan.
        # With watch_gradients, the backward frames recorded since `on_before_backward` are checked here too.
        if self.watcher is not None and (not pl_module.automatic_optimization or self.config.watch_gradients):
            self.watcher.agreement_point()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.watcher is None:
            return
        try:
            self.watcher.end_batch()  # runs the check and its collective only if no agreement point ran
        except BatchLimitReached as stop:
            # Every rank counts the same micro-batches, so every rank stops at the same one without a collective.
            self.watcher.logger.info(str(stop))
            trainer.should_stop = True

    # ------------------------------------------------------------------------------------ validation, test

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.watcher is not None:
            self.watcher.set_phase("eval")  # stops recording unless config.watch_eval

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.watcher is not None and self.config.watch_eval:
            self.watcher.end_batch()

    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    # --------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The counters (`batch_number`, `eval_batch_number`, `optimizer_step`, `epoch`), saved in checkpoints."""
        if self.watcher is not None:
            return self.watcher.state_dict()
        if self._counters is not None:
            return dict(self._counters)
        return {"batch_number": 0, "eval_batch_number": 0, "optimizer_step": None, "epoch": None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters, so that `batch_number` goes on counting after a resume from a checkpoint."""
        self._counters = dict(state_dict)
        if self.watcher is not None:
            self.watcher.load_state_dict(self._counters)


def _follow_scaler(watcher: Watcher, scaler: GradScalerLike, optimizers: list[Optimizer]) -> None:
    # Lightning runs `scaler.step(optimizer)`, which calls `optimizer.step()` only for the steps it does not skip:
    # the step pre-hook tells the watcher which those are (no collective; a detection waits for the next check).
    watcher.watch_scaler(scaler)
    for optimizer in optimizers:
        watcher.hooks.add_handle(
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: watcher.optimizer_step_applying(opt))
        )


def _log_summary(trainer: Trainer, summary: Summary) -> None:
    # Straight to the loggers at the interval nanwatch was given: `log_dict` would also apply log_every_n_steps.
    metrics = summary.metrics()
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
