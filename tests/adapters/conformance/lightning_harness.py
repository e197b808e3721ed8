"""Lightning: `OverflowCallback` in a real `lightning.pytorch.Trainer` (CPU; strategy "ddp" under torchrun).

The LightningModule holds the net as `net`, and the callback names modules from the LightningModule down: the fault
module is `net.block.fault`. A checkpoint is a `ModelCheckpoint` file, resumed with `trainer.fit(ckpt_path=...)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tests.adapters.conformance.common import (
    BATCH_SIZE,
    LEARNING_RATE,
    MICRO_BATCHES_PER_EPOCH,
    ConformanceNet,
    FunctionalLoss,
    Outcome,
    Scenario,
    StepRecorder,
    eval_dataset,
    new_loss,
    new_net,
    outcome,
    train_dataset,
    world_size,
)
from torch.utils.data import DataLoader

from nanwatch.adapters.lightning import OverflowCallback
from nanwatch.core.watcher import Watcher

NAME = "lightning"
FAULT_NAME = "net.block.fault"


class _LitNet(pl.LightningModule):
    def __init__(self, net: ConformanceNet, loss_fn: FunctionalLoss | None = None, *, fused: bool = False) -> None:
        super().__init__()
        self.net = net
        self.loss_fn = loss_fn
        self.fused = fused

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.loss_fn is not None:  # `F.mse_loss(...)` in the training step, as most LightningModules do
            return self.loss_fn(self.net(batch["x"])["logits"], batch["labels"])
        loss: torch.Tensor = self.net(batch["x"], labels=batch["labels"])["loss"]
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.net(batch["x"], labels=batch["labels"])["loss"]
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE, fused=self.fused or None)


class _Probe(pl.Callback):
    """Once training starts (after a checkpoint was restored): keep the callback's watcher (it drops it when the fit
    ends) and start recording the weights after each optimizer step."""

    def __init__(self, overflow: OverflowCallback, recorder: StepRecorder) -> None:
        self.overflow = overflow
        self.recorder = recorder
        self.watcher: Watcher | None = None
        self.optimizers: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watcher = self.overflow.watcher
        self.optimizers = list(trainer.optimizers)
        self.recorder.restart()
        self.recorder.track(self.optimizers[0])


def _fit(
    scenario: Scenario, workdir: Path, *, epochs: int, micro_batches_done: int = 0, ckpt_path: str | None = None
) -> tuple[Outcome, pl.Trainer]:
    net = new_net(scenario, micro_batches_done=micro_batches_done)
    module = _LitNet(net, new_loss(scenario, micro_batches_done=micro_batches_done), fused=scenario.fused)
    overflow = OverflowCallback(scenario.config(workdir))
    recorder = StepRecorder(net)
    probe = _Probe(overflow, recorder)
    callbacks: list[pl.Callback] = [overflow, probe]
    if scenario.resume_after is not None:
        callbacks.append(ModelCheckpoint(dirpath=workdir / "lightning-checkpoints", every_n_epochs=1))
    distributed = world_size() > 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size(),
        strategy="ddp" if distributed else "auto",
        max_epochs=epochs,
        accumulate_grad_batches=scenario.accumulation,
        # Validation only where the scenario asks, after every optimizer step (the interval counts micro-batches).
        num_sanity_val_steps=0,
        val_check_interval=scenario.accumulation if scenario.evaluate else None,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=scenario.resume_after is not None,
        default_root_dir=str(workdir),
        callbacks=callbacks,
    )
    train = DataLoader(train_dataset(scenario), batch_size=BATCH_SIZE)
    val = DataLoader(eval_dataset(), batch_size=BATCH_SIZE) if scenario.evaluate else None
    error: Exception | None = None
    try:
        trainer.fit(module, train, val, ckpt_path=ckpt_path)
    except Exception as caught:
        error = caught
    found = outcome(
        error,
        net=net,
        watcher=probe.watcher,
        recorder=recorder,
        model=module,
        optimizers=probe.optimizers,
        workdir=workdir,
    )
    return found, trainer


def run(scenario: Scenario, workdir: Path) -> Outcome:
    if scenario.resume_after is None:
        return _fit(scenario, workdir, epochs=scenario.epochs)[0]
    first, trainer = _fit(scenario, workdir, epochs=scenario.resume_after // MICRO_BATCHES_PER_EPOCH)
    if first.error is not None:
        return first
    checkpoint = trainer.checkpoint_callback
    assert isinstance(checkpoint, ModelCheckpoint)
    assert checkpoint.best_model_path, "the first fit saved no checkpoint"
    resumed, _ = _fit(
        scenario,
        workdir,
        epochs=scenario.epochs,
        micro_batches_done=scenario.resume_after,
        ckpt_path=checkpoint.best_model_path,
    )
    return resumed
