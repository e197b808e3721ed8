"""The loss scaler a framework keeps, followed the same way by Lightning's, Accelerate's and the HF Trainer's adapters.
Duck-typed: no framework imported."""

from __future__ import annotations

from typing import Literal

from nanwatch.core.contract import AdapterContract
from nanwatch.core.readouts import scaler_of

__all__ = ["follow_scaler"]


def follow_scaler(
    watcher: AdapterContract, holder: object, *, read_scale: Literal["at_batch_end", "when_settled"] = "at_batch_end"
) -> None:
    """Follow the `GradScaler` that `holder` keeps (`scaler_of`: Lightning's precision plugin, an Accelerator, an
    `AcceleratedOptimizer`), if any: there is none without fp16 loss scaling."""
    scaler = scaler_of(holder)
    if scaler is not None:
        watcher.watch_scaler(scaler, read_scale=read_scale)
