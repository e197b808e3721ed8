"""The Accelerate adapter: `OverflowTracker`, a tracker you pass to `Accelerator(log_with=[...])`.

Accelerate calls a tracker's `log()` on the main process only and resets `accelerator.step` every epoch, so neither
drives nanwatch. After `accelerator.prepare(...)`, every rank calls `tracker.attach(accelerator, model)`: a
training-mode forward of the unwrapped model starts a micro-batch and ends the previous one (every micro-batch of an
accumulation window counts); the real optimizer's step pre-hook (inside each `AcceleratedOptimizer`) is where every
rank checks and agrees, before the weights change. Under fp16 the Accelerator's `GradScaler` is followed. The epoch is
the prepared dataloader's `iteration`, unless `set_epoch()` says otherwise. More: docs/frameworks.md.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from nanwatch.adapters._checks import ConfigLike, check_model, check_skip, entry_module, optional_base, require
from nanwatch.adapters._hooks import stop_on_error, watch_root
from nanwatch.adapters._scaler import follow_scaler
from nanwatch.adapters._user_handle import UserHandle
from nanwatch.adapters.accelerate._accelerator import (
    dataloader_epoch,
    guard_accelerate_saves,
    optimizer_list,
    to_trackers,
    watch_loss_of,
)
from nanwatch.adapters.accelerate._resume import guard_accelerate_loads
from nanwatch.adapters.accelerate._rewind import restorer_for
from nanwatch.core.config import resolve_config
from nanwatch.core.contract import AdapterContract
from nanwatch.core.watcher import Watcher

_IMPORT_ERROR: ImportError | None = None
if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker
else:  # the class must still exist without accelerate, so that constructing it can say what is missing
    GeneralTracker, _IMPORT_ERROR = optional_base("accelerate.tracking", "GeneralTracker")

__all__ = ["OverflowTracker"]


class OverflowTracker(UserHandle, GeneralTracker):  # type: ignore[misc]
    """Watches a model trained with Accelerate for inf/nan; every rank stops together at the first one.

    Args:
        config: a `WatchConfig`, a dict of its fields, or the path of a YAML/JSON file; defaults when None.
        **overrides: fields of `WatchConfig` that replace those of `config`.

    Raises:
        ImportError: accelerate is not installed.
        ConfigError: the config or an override names an unknown field or holds a bad value.
    """

    name = "nanwatch"
    requires_logging_directory = False
    # attach() and the hooks run on every process; only log() and finish() are called by Accelerate on the main one.
    main_process_only = False

    def __init__(self, config: ConfigLike = None, **overrides: Any) -> None:
        message = 'OverflowTracker needs the "accelerate" package; install it with: pip install "nanwatch[accelerate]"'
        require(_IMPORT_ERROR, message)
        super().__init__()
        self.config = resolve_config(config, **overrides)
        self.watcher: AdapterContract | None = None
        self._batch_open = False
        self._pending_state: dict[str, Any] | None = None
        self._keep_counters = False  # while a rewind's load_state() runs: its counters are not rewound

    @property
    def tracker(self) -> AdapterContract | None:
        """The core `Watcher` (None before `attach()`)."""
        return self.watcher

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Accepts `accelerator.log()` calls and ignores them: nanwatch counts from hooks on every rank instead."""

    def finish(self) -> None:
        """Called by `accelerator.end_training()` (main process only): remove this process's hooks."""
        self.detach()

    def attach(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    ) -> OverflowTracker:
        """Start watching; call it on every rank, after `accelerator.prepare(...)`.

        Args:
            accelerator: the `Accelerator` that prepared `model`.
            model: the prepared model (a DistributedDataParallel wrapper is looked through for module names).
            optimizers: the optimizer(s) whose steps are guarded; by default every optimizer `accelerator` prepared.

        Returns:
            The tracker itself, so `with tracker.attach(accelerator, model):` removes the hooks at the end.
        """
        if self.watcher is not None and self.watcher.attached:
            raise RuntimeError("nanwatch: OverflowTracker is already attached; call detach() first")
        checked = check_model(model, "OverflowTracker.attach()")
        guarded = optimizer_list(optimizers, default=getattr(accelerator, "_optimizers", []))
        fix = (
            "prepare the optimizer (accelerator.prepare) before tracker.attach(), or pass it: "
            "tracker.attach(accelerator, model, optimizers=optimizer)"
        )
        check_skip(self.config, guarded, "OverflowTracker.attach()", fix)
        root = accelerator.unwrap_model(checked, keep_torch_compile=False)
        watcher: AdapterContract = Watcher(
            root,
            self.config,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            entry=entry_module(model, root),
        )
        if self._pending_state is not None:
            watcher.load_state_dict(self._pending_state)
            self._pending_state = None
        if self._epoch_said is not None:
            watcher.set_counters(epoch=self._epoch_said)
        watcher.summary_sink = to_trackers(accelerator, watcher, self) if accelerator.is_main_process else None
        # First of the root's pre-hooks: the previous micro-batch ends (and may be reported, with its replay copy)
        # before anything starts recording the new one. An optimizer that steps the model but is not among these
        # (none was prepared, say) is said once.
        watch_root(
            watcher,
            root,
            lambda module, args: self._before_root_forward(accelerator, module),
            optimizers=guarded,
            models=(model, root),
            fix="Prepare the optimizer (accelerator.prepare) before tracker.attach(), or pass it: "
            "tracker.attach(accelerator, model, optimizers=optimizer).",
            prepend=True,
        )
        # The loss handed to `accelerator.backward(loss)` (often `F.mse_loss(...)`, outside every module): read in
        # the check before the step.
        watch_loss_of(watcher, accelerator, "backward")
        # None unless fp16 runs on a device Accelerate builds a GradScaler for; its first reading at the counters set.
        follow_scaler(watcher, accelerator)
        self.watcher = watcher
        self._batch_open = False
        guard_accelerate_saves(watcher, accelerator)  # save_state() checks first, until detach()
        if self.config.on_detect == "rewind":  # a rewind restores the last of those through load_state()
            watcher.restore_with(restorer_for(accelerator, self._keeping_counters, self))
        if self.config.checkpoint_guard != "off":
            guard_accelerate_loads(watcher, accelerator)  # load_state() checks the folder before it loads any of it
        return self

    def detach(self) -> None:
        """Remove every hook (on all modules and optimizers); log a report if the last frames hold inf/nan."""
        if self.watcher is not None and self.watcher.attached:
            self.watcher.close()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.detach()

    def state_dict(self) -> dict[str, Any]:
        """The counters, so `accelerator.register_for_checkpointing(tracker)` keeps them across a resume."""
        if self.watcher is None:
            return {}
        state = self.watcher.state_dict()
        if self._batch_open:  # saved between micro-batches: the one that ran is over, the next forward is a new one
            state["batch_number"] += 1
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state or self._keep_counters:  # a rewind's load_state(): the run goes on counting
            return
        if self.watcher is None:
            self._pending_state = dict(state)
        else:
            self.watcher.load_state_dict(state)
        self._batch_open = False

    def _keeping_counters(self, keep: bool) -> None:
        self._keep_counters = keep

    def _before_root_forward(self, accelerator: Accelerator, module: torch.nn.Module) -> None:
        watcher = self.watcher
        if watcher is None:
            return
        if not module.training:
            watcher.start_batch("eval")  # one forward, checked as it returns; the training micro-batch stays open
            return
        epoch = self._epoch_said
        if epoch is None:
            epoch = dataloader_epoch(accelerator, otherwise=watcher.counters.epoch)
        watcher.set_phase("train")  # back from any evaluation, in the open micro-batch, which ends now
        if self._batch_open:
            stop_on_error(watcher, watcher.end_batch)
        self._batch_open = True
        # Raises when another rank stopped: our hooks go with the error, as with end_batch's.
        stop_on_error(watcher, lambda: watcher.start_batch("train", epoch=epoch))
