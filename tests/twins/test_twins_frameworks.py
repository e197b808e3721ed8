"""Watching a healthy run changes nothing, in each framework: the real Lightning `Trainer`, an `Accelerator` loop and
the HF `Trainer`, each in full mode, sentinel mode, `watch_gradients`, spikes with `on_detect="skip"`, and the
checkpoint guard on the framework's own checkpoints (every other optimizer step).

Each twin trains the same seeded model (dropout, a `-inf` causal-mask buffer) on the same data with gradient
accumulation 2, unwatched and watched; both must end with bitwise-identical weights and buffers, optimizer state, RNG
states (torch, Python, NumPy) and optimizer steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.twins.twin import StepCounter, TwinEnd, seed_everything, twin_end
from torch import nn
from torch.utils.data import DataLoader, Dataset

pytestmark = pytest.mark.slow

WIDTH, SAMPLES, BATCH, ACCUMULATION = 8, 32, 4, 2
STEPS = SAMPLES // BATCH // ACCUMULATION
MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "sentinel": {"mode": "sentinel"},
    # A fused AdamW (the HF Trainer's default already) takes sentinel mode's check as its found_inf.
    "sentinel-fused": {"mode": "sentinel"},
    "gradients": {"watch_gradients": True},
    "spikes-skip": {"spike_window": 2, "on_detect": "skip"},
    "checkpoints": {},
}


class CausalRegressor(nn.Module):
    """Linear, a causal mix through a `-inf` mask buffer, dropout, Linear; returns its loss with the targets."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mask", torch.full((WIDTH, WIDTH), float("-inf")).triu(1))
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.inp(x)
        mixed = torch.softmax(hidden.unsqueeze(-1) * hidden.unsqueeze(-2) + self.mask, dim=-1) @ hidden.unsqueeze(-1)
        logits = self.out(self.drop(mixed.squeeze(-1)))
        return {"loss": nn.functional.mse_loss(logits, labels), "logits": logits}


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, WIDTH, generator=generator)
        self.y = self.x.sum(1, keepdim=True) * 0.1

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


def _both(run: Callable[[dict[str, Any] | None, Path], TwinEnd], mode: str, tmp_path: Path) -> None:
    unwatched = run(None, tmp_path / "unwatched")
    watched = run(MODES[mode], tmp_path / "watched")
    assert unwatched.steps == STEPS
    assert watched.differences(unwatched) == []


# ---------------------------------------------------------------------------------------------------- Lightning


def _lightning(config: dict[str, Any] | None, folder: Path, checkpoints: bool, fused: bool) -> TwinEnd:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nanwatch.adapters.lightning import OverflowCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = CausalRegressor()

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.net(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=fused or None)

    seed_everything(0)
    module = Module()
    callbacks: list[Any] = []
    if checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=folder / "checkpoints", every_n_train_steps=2, save_top_k=-1))
    if config is not None:
        callbacks.append(OverflowCallback(report_dir=folder / "reports", **config))
    trainer = pl.Trainer(
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATION,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=folder,
    )
    trainer.fit(module, DataLoader(Pairs(), batch_size=BATCH))
    return twin_end(module, trainer.optimizers[0], trainer.global_step)


@pytest.mark.parametrize("mode", list(MODES))
def test_lightning_twins(mode: str, tmp_path: Path) -> None:
    _both(lambda config, folder: _lightning(config, folder, mode == "checkpoints", "fused" in mode), mode, tmp_path)


# ---------------------------------------------------------------------------------------------------- Accelerate


def _accelerate(config: dict[str, Any] | None, folder: Path, checkpoints: bool, fused: bool) -> TwinEnd:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from nanwatch.adapters.accelerate import OverflowTracker

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    seed_everything(0)
    model = CausalRegressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    steps = StepCounter(optimizer)
    tracker = None if config is None else OverflowTracker(report_dir=folder / "reports", **config)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=ACCUMULATION,
        log_with=None if tracker is None else [tracker],
        project_config=ProjectConfiguration(project_dir=str(folder), automatic_checkpoint_naming=True),
    )
    prepared, prepared_optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(Pairs(), batch_size=BATCH))
    if tracker is not None:
        tracker.attach(accelerator, prepared)
    try:
        for batch in loader:
            with accelerator.accumulate(prepared):
                accelerator.backward(prepared(**batch)["loss"])
                prepared_optimizer.step()
                prepared_optimizer.zero_grad()
            if checkpoints and accelerator.sync_gradients and steps.count % 2 == 0:
                accelerator.save_state()
    finally:
        if tracker is not None:
            tracker.detach()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return twin_end(model, optimizer, steps.count)


@pytest.mark.parametrize("mode", list(MODES))
def test_accelerate_twins(mode: str, tmp_path: Path) -> None:
    _both(lambda config, folder: _accelerate(config, folder, mode == "checkpoints", "fused" in mode), mode, tmp_path)


# ---------------------------------------------------------------------------------------------------- HF Trainer


def _hf_trainer(config: dict[str, Any] | None, folder: Path, checkpoints: bool) -> TwinEnd:
    from transformers import Trainer, TrainingArguments

    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    class Wrapped(CausalRegressor):
        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return super().forward(x, labels)

    seed_everything(0)
    model = Wrapped()
    arguments = TrainingArguments(
        output_dir=str(folder),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=1e-2,
        save_strategy="steps" if checkpoints else "no",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callbacks = [] if config is None else [OverflowTrainerCallback(report_dir=folder / "reports", **config)]
    trainer = Trainer(model=model, args=arguments, train_dataset=Pairs(), callbacks=callbacks)
    trainer.train()
    return twin_end(model, trainer.optimizer, trainer.state.global_step)


@pytest.mark.parametrize("mode", [mode for mode in MODES if mode != "sentinel-fused"])  # its default is fused
def test_hf_trainer_twins(mode: str, tmp_path: Path) -> None:
    _both(lambda config, folder: _hf_trainer(config, folder, mode == "checkpoints"), mode, tmp_path)
