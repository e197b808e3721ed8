"""What the long-run tests (test_spikes, test_skip, test_checkpoint_guard) share: seeded regression batches, a
weight snapshot, and the frameworks' warnings that small CPU runs raise."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models import small_mlp
from torch import nn

__all__ = [
    "FRAMEWORK_NOISE",
    "batches",
    "hf_training_arguments",
    "lightning_regressor",
    "lightning_trainer",
    "same",
    "snapshot",
]

# What Lightning says about a tiny run on the CPU: nothing the tests look at.
FRAMEWORK_NOISE = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*isinstance\\(treespec, LeafSpec\\).*",
    "ignore:.*smaller than the logging interval.*",
    "ignore:.*Checkpoint directory .* exists and is not empty.*",
)


def batches(count: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (inputs, targets) pairs for `small_mlp`: `size` rows of 4 features, one target each, seeded."""
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 4, generator=generator), torch.randn(size, 1, generator=generator)) for _ in range(count)
    ]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


def lightning_trainer(max_steps: int, callbacks: list[Any], *, checkpointing: bool = False) -> Any:
    """A quiet Lightning `Trainer` on the CPU: no logger, no progress bar, no summary, `max_steps` steps."""
    import lightning.pytorch as pl

    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpointing,
    )


def lightning_regressor(optimizer: Callable[[Any], torch.optim.Optimizer], factor: Callable[[int], float]) -> Any:
    """A LightningModule over `small_mlp` (as `net`) regressing `batches()`: its Scale module (`net.2`) multiplies by
    `factor(batch_idx)` in each training step; `optimizer(parameters)` is what `configure_optimizers` returns."""
    import lightning.pytorch as pl

    class LitRegressor(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = small_mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.net[2].factor = factor(batch_idx)
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self.parameters())

    return LitRegressor()


def hf_training_arguments(output_dir: Path, max_steps: int) -> Any:
    """Quiet HF `TrainingArguments` on the CPU for the long-run tests: batch 1, plain SGD at a constant 1e-4, no
    clipping, no saving, no logging, `max_steps` steps."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=1,
        max_steps=max_steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        optim="sgd",
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
