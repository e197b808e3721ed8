"""What a framework's own objects say, read the same way by every adapter: the loss scaler it keeps, and the counters
its state implies. Duck-typed: no framework imported."""

from __future__ import annotations

import math
from typing import Any, Literal

from nanwatch.core.contract import AdapterContract
from nanwatch.core.readouts import scaler_of

__all__ = ["follow_scaler", "dataloader_epoch", "trainer_epoch", "micro_batches_done"]


def follow_scaler(
    watcher: AdapterContract, holder: object, *, read_scale: Literal["at_batch_end", "when_settled"] = "at_batch_end"
) -> None:
    """Follow the `GradScaler` that `holder` keeps (`scaler_of`: Lightning's precision plugin, an Accelerator, an
    `AcceleratedOptimizer`), if any: there is none without fp16 loss scaling."""
    scaler = scaler_of(holder)
    if scaler is not None:
        watcher.watch_scaler(scaler, read_scale=read_scale)


def dataloader_epoch(accelerator: Any, otherwise: int | None) -> int | None:
    """Accelerate: the epoch of the prepared dataloader running now (its `iteration`); `otherwise` when it has none."""
    iteration = getattr(accelerator.gradient_state.active_dataloader, "iteration", None)
    return iteration if isinstance(iteration, int) else otherwise


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
