"""The transformers `Trainer` adapter: `Trainer(..., callbacks=[OverflowTrainerCallback(config)])`.

Counters: `batch_number` counts every training micro-batch (each `training_step` call), resumed from checkpoints; a
micro-batch ends at `on_substep_end`, or at `on_pre_optimizer_step` when it is the last one before an optimizer step.
Both are reached by every rank, so the check's all-reduce sits there, and a step that would apply inf/nan never runs.
The report's optimizer step is `state.global_step` and its epoch `floor(state.epoch)`. Under fp16 the Trainer's
`GradScaler` (which its Accelerator hands to the optimizer) is followed; its scale is read after each optimizer step.
More: docs/frameworks.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from nanwatch.adapters._checks import ConfigLike, optional_base, require, unwrap_model
from nanwatch.adapters._hooks import add_phase_hook, guard_optimizers, stop_on_error
from nanwatch.adapters._scaler import follow_scaler
from nanwatch.adapters.hf_trainer._resume import verify_resumed
from nanwatch.adapters.hf_trainer._trainer import (
    HeldForLog,
    close_when_forward_raises,
    micro_batches_done,
    trainer_epoch,
    verify_trainer_save,
)
from nanwatch.core.config import resolve_config
from nanwatch.core.contract import AdapterContract
from nanwatch.core.features.checkpoint_load import ModelMasks
from nanwatch.core.readouts import LossScaleHistory
from nanwatch.core.watcher import Watcher
from nanwatch.errors import ConfigError

_MISSING_TRANSFORMERS: ImportError | None = None
if TYPE_CHECKING:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
else:  # constructing the callback reports a missing transformers; importing this module alone must not fail
    TrainerCallback, _MISSING_TRANSFORMERS = optional_base("transformers", "TrainerCallback")

__all__ = ["OverflowTrainerCallback"]

# The Trainer loads its checkpoints (weights in any of its formats, sharded, PEFT adapters, DeepSpeed; the optimizer,
# the scheduler, the RNG states) only in `train(resume_from_checkpoint=...)`, through methods of the Trainer that a
# callback is never handed; restoring the files by hand would miss some of them and leave the rest half-restored.
_NO_REWIND = (
    "nanwatch: on_detect='rewind' is not available with the transformers Trainer: it loads a checkpoint only when "
    "train(resume_from_checkpoint=...) starts, never in place mid-run. Use on_detect='skip', or resume from the last "
    "checkpoint verified finite, which every report names"
)


class OverflowTrainerCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Watches every module of the model a transformers `Trainer` trains, and stops the run at the first inf/nan.

    Hooks are attached in `on_train_begin` and removed in `on_train_end`, before nanwatch raises, and when the model's
    forward raises. The Trainer tells callbacks nothing when something else raises (a callback, the loss code outside
    the model): the next `train()` removes stale hooks then, or call `close()`.

    Args:
        config: a `WatchConfig`, a dict of its fields, or the path of a YAML/JSON file; defaults when None.
        **overrides: fields of `WatchConfig` that replace those of `config`.

    Attributes:
        watcher: the core `Watcher` while `train()` runs; None before and after.
        loss_scale: under a `GradScaler`, the scale's history as it was when the last `train()` ended (or raised).

    Raises:
        ImportError: transformers is not installed.
        ConfigError: the config or an override names an unknown field or holds a bad value, or asks for
            `on_detect="rewind"`, which the Trainer does not allow (`_NO_REWIND` says why).
    """

    def __init__(self, config: ConfigLike = None, **overrides: Any) -> None:
        message = "OverflowTrainerCallback needs the transformers package, which is not installed: pip install "
        require(_MISSING_TRANSFORMERS, message + '"nanwatch[transformers]"')
        self.config = resolve_config(config, **overrides)
        if self.config.on_detect == "rewind":
            raise ConfigError(_NO_REWIND)
        self.watcher: AdapterContract | None = None
        self._summary = HeldForLog()  # due, waiting for the Trainer's next log event
        self.loss_scale: LossScaleHistory | None = None
        self._masks: ModelMasks | None = None  # the model's buffers as the Trainer was built (see on_init_end)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # The model as built, before any checkpoint is loaded into it: its buffers that hold -inf are masks.
        model = kwargs.get("model")
        if isinstance(model, torch.nn.Module) and self.config.checkpoint_guard != "off":
            self._masks = ModelMasks([unwrap_model(model)])

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"OverflowTrainerCallback expects the Trainer to pass its model, got {type(model).__name__}"
            )
        self.close()  # hooks left by an earlier train() that raised something other than our own error
        root = unwrap_model(model)
        if self.config.checkpoint_guard != "off":  # what train(resume_from_checkpoint=...) loaded, before a step
            verify_resumed(args, state, root, kwargs.get("optimizer"), self._masks)
        # Rank and world size come from torch.distributed (as args.process_index does): its default group carries
        # the agreement all-reduce.
        watcher: AdapterContract = Watcher(root, self.config)
        batches = micro_batches_done(args, state, kwargs.get("train_dataloader"))
        epoch = trainer_epoch(state)
        watcher.load_state_dict({"batch_number": batches, "optimizer_step": state.global_step, "epoch": epoch})
        optimizer = kwargs.get("optimizer")
        # The Trainer's accelerator's GradScaler, if fp16 scales the loss. The scale changes only in a step's
        # update(): read it once, after each step (on_optimizer_step).
        follow_scaler(watcher, optimizer, read_scale="when_settled")
        watcher.attach()
        add_phase_hook(watcher, root, self._before_top_forward)
        # The Trainer tells callbacks nothing when training raises; an error in the model's forward is seen here.
        close_when_forward_raises(watcher, root, lambda: self.close(check=True))
        if optimizer is not None:
            # Checked before each step (under a scaler, inside `scaler.step`, which calls `optimizer.step` only for
            # a step it does not skip); every rank gets here alike.
            guard_optimizers(watcher, [optimizer], run=self._run)
        watcher.summary_sink = self._summary.hold  # on every rank: see on_step_end
        self.watcher = watcher

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close(check=True)  # only eval forwards can still be pending; local check, no collective at this point

    def close(self, *, check: bool = False) -> None:
        """Remove every hook nanwatch put on the model (safe to call more than once)."""
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            self.loss_scale = watcher.loss_scale_history() or self.loss_scale
            watcher.close(check=check)

    def _before_top_forward(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        # The Trainer calls model.train() before each training_step and model.eval() before evaluating.
        if (watcher := self.watcher) is not None:
            # Raises when another rank stopped: our hooks go with the error (a NanwatchError in a forward hook
            # does not close them: see close_when_forward_raises).
            self._run(lambda: watcher.start_batch("train" if module.training else "eval"))

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # After `scaler.step` and `scaler.update`, skipped or not: the one reading of the scale per step, so a drop
        # (and a fall below the floor) is put on the micro-batch whose gradients caused it.
        if (watcher := self.watcher) is not None:
            self._run(lambda: watcher.on_optimizer_step("settled", optimizer_step=state.global_step))

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_batch(state, "train")

    on_pre_optimizer_step = on_substep_end  # the last micro-batch before an optimizer step ends there

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # One evaluation batch is over; every rank evaluates the same number of batches, so the collective is safe.
        if self.watcher is not None and self.watcher.counters.phase == "eval" and self.watcher.recording:
            self._end_batch(state, "eval")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._summary.due:  # on every rank alike (see HeldForLog)
            control.should_log = True
        self.on_epoch_end(args, state, control, **kwargs)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The Trainer saves (and rotates older checkpoints out) right after these events when its control says so.
        if (watcher := self.watcher) is not None and control.should_save:
            self._run(lambda: verify_trainer_save(watcher, args.output_dir or ".", state.global_step, kwargs))

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._summary.put_into(logs, state.log_history, state.global_step)

    def _end_batch(self, state: TrainerState, phase: str) -> None:
        watcher = self.watcher
        if watcher is None:
            return

        def end() -> None:
            if phase == "train":
                watcher.start_batch("train")  # raises when another rank stopped (this rank's frames checked first)
            watcher.end_batch(optimizer_step=state.global_step, epoch=trainer_epoch(state))

        self._run(end)

    def _run(self, action: Callable[[], None]) -> None:
        # The Trainer has no exception event: the hooks go before any error of a check leaves train().
        if self.watcher is not None:
            stop_on_error(self.watcher, action, close=self.close, errors=BaseException)
