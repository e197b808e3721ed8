"""What only the HF Trainer adapter needs, beside hf_trainer/__init__.py: the counters the Trainer's state implies
(`trainer_epoch`, `micro_batches_done`), and what its callback events lack, made up for: a summary held for its next
log event (`HeldForLog`), the model's forward that raises closing the watcher (`close_when_forward_raises`: the Trainer
has no exception event), the checkpoint its control is about to save checked first (`verify_trainer_save`).
Duck-typed: transformers is not imported."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from nanwatch.adapters._checkpoints import torch_save_writer
from nanwatch.adapters._checks import real_optimizer
from nanwatch.core.contract import AdapterContract
from nanwatch.core.feature_api import QUARANTINE_FOLDER, WriteAside
from nanwatch.core.readouts import Summary
from nanwatch.errors import NanwatchError

__all__ = ["trainer_epoch", "micro_batches_done", "HeldForLog", "close_when_forward_raises", "verify_trainer_save"]


def trainer_epoch(state: Any) -> int | None:
    """The HF Trainer: `state.epoch` is fractional (epoch + share of it done); its floor is the epoch in progress."""
    epoch: float | None = state.epoch
    return None if epoch is None else math.floor(epoch)


def micro_batches_done(args: Any, state: Any, dataloader: Any) -> int:
    """The HF Trainer: micro-batches already trained when `train()` resumes from a checkpoint (0 on a fresh start)."""
    accumulation: int = args.gradient_accumulation_steps
    steps: int = state.global_step
    try:
        per_epoch = len(dataloader)
    except TypeError:  # no length (an IterableDataset): whole accumulation groups only
        return steps * accumulation
    # The Trainer skips whole epochs, then whole accumulation groups of the epoch in progress.
    updates_per_epoch = max(math.ceil(per_epoch / accumulation), 1)
    return (steps // updates_per_epoch) * per_epoch + (steps % updates_per_epoch) * accumulation


class HeldForLog:
    """The HF Trainer: a summary, due on every rank alike, waits for the Trainer's next log event. Every rank asks the
    Trainer to log then (`due`): its logging gathers the loss across ranks, and asking on one rank only would leave
    the others out of that collective."""

    def __init__(self) -> None:
        self._metrics: dict[str, float] | None = None

    def hold(self, summary: Summary) -> None:
        """The watcher's sink: keep the summary's metrics until `put_into`."""
        self._metrics = summary.metrics()

    @property
    def due(self) -> bool:
        return self._metrics is not None

    def put_into(self, logs: MutableMapping[str, Any] | None, log_history: list[dict[str, Any]], step: int) -> None:
        """Into the Trainer's `logs` (what the callbacks after this one receive), and into the copy of them that
        `Trainer.log()` appended to `log_history` just before calling `on_log` (when it is this `step`'s)."""
        metrics = self._metrics
        if metrics is None or logs is None:
            return
        self._metrics = None
        logs.update(metrics)
        if log_history and log_history[-1].get("step") == step:
            log_history[-1].update(metrics)


def close_when_forward_raises(watcher: AdapterContract, root: torch.nn.Module, close: Callable[[], None]) -> None:
    """Run `close` when the root's forward raises the user's own error, for frameworks that tell callbacks nothing
    when training fails (the HF Trainer): the error goes on unchanged, and no hook of ours stays on the model."""

    def after_failed_forward(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # With always_call, torch runs this hook inside its `except` when the forward raised: the error is current.
        failure = sys.exc_info()[1]
        if failure is not None and not isinstance(failure, NanwatchError):
            close()

    handle = root.register_forward_hook(after_failed_forward, always_call=True)
    watcher.hooks.add_handle(handle)

    def keep_last(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        # `close` removes hooks from the very dict torch is walking when it calls this one. The walk may end after
        # such a change only if this hook is its last item: were it not, torch would raise "OrderedDict mutated
        # during iteration" in place of the user's error. So it is kept last, before every forward.
        hooks = module._forward_hooks
        if handle.id in hooks and next(reversed(hooks)) != handle.id:
            hooks[handle.id] = hooks.pop(handle.id)  # to the end, under the same key

    watcher.hooks.add_handle(root.register_forward_pre_hook(keep_last))


def verify_trainer_save(watcher: AdapterContract, output_dir: str, global_step: int, kwargs: dict[str, Any]) -> None:
    """The HF Trainer is about to save checkpoint-<global_step> (its control says so): check the model and the
    optimizer (from the event's `kwargs`) it will write."""
    optimizer = kwargs.get("optimizer")
    state: dict[str, Any] = {"model": kwargs.get("model")}
    if optimizer is not None:
        state["optimizer"] = real_optimizer(optimizer)

    dicts = torch_save_writer(lambda: {name: value.state_dict() for name, value in state.items()})
    path = os.path.join(output_dir, f"checkpoint-{global_step}")
    # In output_dir, out of the Trainer's way: it resumes from and rotates `checkpoint-<N>` folders only.
    quarantine = os.path.join(output_dir, QUARANTINE_FOLDER)
    watcher.verify_checkpoint(state, path, step=global_step, write_aside=WriteAside(quarantine, dicts))
