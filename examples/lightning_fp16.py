"""Lightning on the CPU: a small float16 regressor with too high a learning rate overflows after a few steps.

Lightning's `precision="16-mixed"` needs a GPU (on the CPU it falls back to bfloat16, which hardly ever overflows),
so this runs with `precision="16-true"`: the weights themselves are float16. They grow with every optimizer step
until the squared error passes 65504, the largest float16, and the loss turns to inf. `OverflowCallback` stops
every rank before the optimizer step that would apply it, and shows the frames that led there.

    python examples/lightning_fp16.py [--config nanwatch.yaml] [--report-dir reports/] [--max-frames-to-save N]
"""

from __future__ import annotations

import argparse
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nanwatch import NonFiniteError
from nanwatch.adapters.lightning import OverflowCallback
from nanwatch.cli.options import add_config_arguments, config_from_args


class Regressor(pl.LightningModule):
    """Linear/GELU layers and the loss as a module, so the loss is watched too."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        self.loss_fn = nn.MSELoss()
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = self.loss_fn(self.body(x), y)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.02, help="0.01 trains without overflowing")
    add_config_arguments(parser)  # --config FILE and one option per WatchConfig field (--report-dir, ...)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(64, 16)
    y = x.sum(dim=1, keepdim=True) * 10  # targets of size ~40: the errors grow fast once the weights diverge
    loader = DataLoader(TensorDataset(x, y), batch_size=16)  # 4 micro-batches per epoch, 2 optimizer steps
    model = Regressor(args.lr)
    trainer = pl.Trainer(
        accelerator="cpu",
        precision="16-true",
        max_epochs=args.epochs,
        accumulate_grad_batches=2,
        callbacks=[OverflowCallback(config_from_args(args, parser))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model, loader)
    except NonFiniteError as error:
        weights_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        print(
            f"stopped: inf/nan in batch_number={error.batch_number} (optimizer step {error.optimizer_step}, "
            f"epoch {error.epoch}) on rank {error.rank}, first in module {error.module_name!r}; "
            f"weights still finite: {weights_finite}",
            file=sys.stderr,
        )
        return 1
    print("training ended without inf/nan", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
