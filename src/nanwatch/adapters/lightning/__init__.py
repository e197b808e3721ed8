"""Lightning: `Trainer(callbacks=[OverflowCallback()])` watches the LightningModule's submodules for inf/nan.

Counters: `batch_number` counts every training micro-batch since training began, across epochs (each micro-batch of
an accumulation window counts), saved in checkpoints; `optimizer_step` is `trainer.global_step` as the micro-batch
starts; `epoch` is `trainer.current_epoch`. The check and its all-reduce run in `on_before_backward` (every rank
reaches it, before the step that would apply the micro-batch), and in `on_before_optimizer_step` under manual
optimization or with `watch_gradients`. `abort_after_batch_num` sets `trainer.should_stop`. More: docs/frameworks.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from nanwatch.adapters._checkpoints import WrappedOnInstance
from nanwatch.adapters._checks import ConfigLike, optional_base, require
from nanwatch.adapters._hooks import close_after, guard_optimizers, warn_if_steps_unguarded
from nanwatch.adapters._scaler import follow_scaler
from nanwatch.adapters.lightning._resume import refuse_poisoned_resume
from nanwatch.adapters.lightning._rewind import restorer_for
from nanwatch.adapters.lightning._trainer import guard_lightning_saves, to_loggers
from nanwatch.core.config import resolve_config
from nanwatch.core.contract import AdapterContract
from nanwatch.core.log import get_logger
from nanwatch.core.rewinds import Rewind
from nanwatch.core.torch_glue.hooks import named_unique_modules
from nanwatch.core.watcher import Watcher
from nanwatch.errors import BatchLimitReached, NonFiniteError

__all__ = ["OverflowCallback"]

_LIGHTNING_IMPORT_ERROR: ImportError | None = None
if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer
else:  # the error is raised again, with the install hint, when the callback is constructed
    Callback, _LIGHTNING_IMPORT_ERROR = optional_base("lightning.pytorch", "Callback")


class OverflowCallback(Callback):
    """A Lightning callback that finds the first inf/nan and stops every rank there.

    Args:
        config: a `WatchConfig`, a dict of its fields, or the path of a YAML/JSON file; defaults when None.
        **overrides: fields of `WatchConfig` that replace those of `config` (e.g. `max_frames_to_save=50`).

    Raises:
        ImportError: the `lightning` package is not installed.
        ConfigError: the config or an override names an unknown field or holds a bad value.
    """

    def __init__(self, config: ConfigLike = None, **overrides: Any) -> None:
        message = "nanwatch's OverflowCallback needs the `lightning` package, which could not be imported "
        require(
            _LIGHTNING_IMPORT_ERROR,
            f'{message}({_LIGHTNING_IMPORT_ERROR}). Install it with: pip install "nanwatch[lightning]"',
        )
        super().__init__()
        self.config = resolve_config(config, **overrides)
        self.watcher: AdapterContract | None = None  # while a fit (or a watched validate/test) runs
        self._counters: dict[str, Any] | None = None  # kept between fits, restored from checkpoints
        self._rewinds: list[Rewind] = []  # the last fit's, once it ended
        self._resume_check: WrappedOnInstance | None = None  # from setup() of a fit to its teardown

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watcher is not None:
            return
        watcher: AdapterContract = Watcher(
            pl_module, self.config, rank=trainer.global_rank, world_size=trainer.world_size
        )
        if self._counters is not None:
            watcher.load_state_dict(self._counters)
        # The LightningModule itself is left out: under DDP its forward runs as the wrapper's, elsewhere not at all.
        # Named as everywhere (FSDP's and checkpointing's wrappers left out of the names: core/torch_glue/hooks.py).
        watcher.attach((name, module) for name, module in named_unique_modules(pl_module) if module is not pl_module)
        if not trainer.is_global_zero:
            watcher.summary_sink = None  # Lightning's loggers write on rank zero only: no read-back elsewhere
        elif trainer.loggers:  # without any, the summary goes to the "nanwatch" logger
            watcher.summary_sink = to_loggers(trainer)
        follow_scaler(watcher, trainer.precision_plugin)  # MixedPrecision("16-mixed") and FSDP's have one
        # Checked before each step (after Lightning's closure computed the gradients); under a scaler only the steps
        # it does not skip reach the optimizer.
        guard_optimizers(watcher, trainer.optimizers, count_steps=False)
        # Manual optimization may step an optimizer of its own, which Lightning does not know: said once.
        warn_if_steps_unguarded(
            watcher,
            (pl_module,),
            "Return the optimizer from configure_optimizers(): nanwatch then checks before each of its steps.",
        )
        # Every checkpoint the strategy writes is checked first (ModelCheckpoint's, trainer.save_checkpoint()).
        guard_lightning_saves(watcher, trainer)
        if self.config.on_detect == "rewind":  # a rewind restores the last of those through the strategy
            watcher.restore_with(restorer_for(trainer))
        self.watcher = watcher

    def _stop(self, *, check: bool = False) -> None:
        if self.watcher is not None:
            self._counters = self.watcher.state_dict()
            self._rewinds = self.watcher.rewinds
            watcher, self.watcher = self.watcher, None
            watcher.close(check=check)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before Lightning reads `ckpt_path`: the checkpoint a fit resumes from is checked as it is read.
        if stage == "fit" and self.config.checkpoint_guard != "off" and self._resume_check is None:
            self._resume_check = refuse_poisoned_resume(trainer, pl_module)

    def _stop_resume_check(self) -> None:
        check, self._resume_check = self._resume_check, None
        if check is not None:
            check.remove()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config.watch_eval:  # a stand-alone `trainer.validate()`; under `fit()` the watcher already runs
            self._start(trainer, pl_module)

    on_test_start = on_validation_start

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_resume_check()
        self._stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning re-raises `exception` after this hook; nothing here may replace or hide it. The user's own error
        # may come from an inf/nan we saw: check what is pending (no collective) and publish it.
        self._stop_resume_check()
        check = not isinstance(exception, NonFiniteError)
        close_after(exception, lambda: self._stop(check=check), get_logger(), "check the last batch")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.watcher is not None:
            self.watcher.start_batch("train", optimizer_step=trainer.global_step, epoch=trainer.current_epoch)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self.watcher is not None:
            # The loss `training_step` returned (often `F.mse_loss(...)`, computed outside every module): read in the
            # check before the step. Under a scaler an inf loss would otherwise pass for an overflow it handles.
            self.watcher.watch_loss(loss)

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

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.watcher is not None:
            self.watcher.start_batch("eval")  # recorded only with config.watch_eval

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

    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end

    @property
    def rewinds(self) -> list[Rewind]:
        """Under `on_detect="rewind"`: each rewind of the running fit (or of the last one, once it ended), oldest
        first: `batch_number`, the checkpoint's `path` and `optimizer_step`, what was `restored`."""
        return self.watcher.rewinds if self.watcher is not None else list(self._rewinds)

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
