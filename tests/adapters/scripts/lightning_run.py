"""A tiny LightningModule whose activations go inf at a chosen micro-batch, and a two-rank DDP run of it.

Imported by tests/adapters/test_lightning.py for the single-process runs; run as a script for the DDP run:

    python tests/adapters/scripts/lightning_run.py --out DIR

Lightning's ddp launcher starts rank 1 by running this same command again. Only rank 1 sees inf, at its micro-batch
3. Each rank writes `DIR/rank{R}.json` with the error it raised; rank 0 also waits for the rank it launched and
writes its exit code to `DIR/children.json`. Reports go to `DIR/reports`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from blowup_models import Blowup, hook_count, same_weights
from torch.utils.data import DataLoader, TensorDataset

from nanwatch.adapters.lightning import OverflowCallback
from nanwatch.errors import NonFiniteError


class InjectingModule(pl.LightningModule):
    """Linear -> ReLU -> Blowup -> Linear regression with SGD; optionally manual optimization or its own nan check."""

    def __init__(
        self,
        inject_at: int | None = None,
        inject_rank: int | None = None,
        inject_eval_at: int | None = None,
        manual: bool = False,
        raise_on_nan: bool = False,
    ) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()
        self.blowup = Blowup(inject_at, inject_rank, inject_eval_at)
        self.out = torch.nn.Linear(8, 1)
        self.automatic_optimization = not manual
        self.raise_on_nan = raise_on_nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blowup(self.act(self.inp(x))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.raise_on_nan and not torch.isfinite(loss):
            raise RuntimeError("the user's own check: the loss is not finite")
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.validation_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Snapshots(pl.Callback):
    """Copies the weights at the start of every training micro-batch, indexed by its own count across epochs."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.weights.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def loaders(n_train: int = 4, n_val: int = 4, batch_size: int = 2) -> tuple[DataLoader[Any], DataLoader[Any]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_val, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    train = TensorDataset(x[:n_train], y[:n_train])
    val = TensorDataset(x[n_train:], y[n_train:])
    return DataLoader(train, batch_size=batch_size), DataLoader(val, batch_size=batch_size)


def make_trainer(root: Path, callbacks: list[pl.Callback], **overrides: Any) -> pl.Trainer:
    """A quick CPU Trainer: 2 micro-batches per optimizer step, validation every epoch, no logs or checkpoints."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "accumulate_grad_batches": 2,
        "num_sanity_val_steps": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
        "default_root_dir": str(root),
    }
    options.update(overrides)
    return pl.Trainer(callbacks=callbacks, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    out: Path = args.out
    model = InjectingModule(inject_at=3, inject_rank=1)
    snapshots = Snapshots()
    callback = OverflowCallback(report_dir=out / "reports")
    # 8 samples, 2 ranks, batches of 2: 2 micro-batches per rank and epoch, one optimizer step per epoch.
    trainer = make_trainer(out, [snapshots, callback], devices=2, strategy="ddp", max_epochs=4)
    train, val = loaders(n_train=8)
    try:
        trainer.fit(model, train, val)
    except NonFiniteError as error:
        rank = trainer.global_rank
        record = {
            "raised_at": time.time(),
            "error": type(error).__name__,
            "batch_number": error.batch_number,
            "rank": error.rank,
            "optimizer_step": error.optimizer_step,
            "epoch": error.epoch,
            "module_name": error.module_name,
            "report": error.report,
            "global_step": trainer.global_step,
            "weights_unchanged": same_weights(model, snapshots.weights[error.batch_number]),
            "hooks_left": hook_count(model),
        }
        (out / f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
        if rank == 0:
            children = trainer.strategy.launcher.procs  # the processes Lightning's ddp launcher started
            codes = [child.wait(timeout=60) for child in children]
            (out / "children.json").write_text(json.dumps({"exit_codes": codes, "at": time.time()}), encoding="utf-8")
        raise
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"finished": True}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
