"""Accelerate on the CPU: a small float16 regressor with too high a learning rate overflows after a few steps.

Accelerate's fp16 autocast needs a GPU (on the CPU `mixed_precision="fp16"` runs in float32), so the model itself is
cast to float16 with `.half()`: the weights grow with every step until the squared error passes 65504, the largest
float16, and the loss turns to inf. nanwatch stops the run before the optimizer step that would apply it.

    python examples/accelerate_loop.py [--config nanwatch.yaml] [--report-dir reports/] [--max-frames-to-save N]
"""

from __future__ import annotations

import argparse
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nanwatch import NonFiniteError
from nanwatch.adapters.accelerate import OverflowTracker
from nanwatch.cli.options import add_config_arguments, config_from_args


class Regressor(nn.Module):
    """Returns (loss, prediction), like a transformers model given labels: the loss is watched too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        self.loss_fn = nn.MSELoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = self.body(x)
        return self.loss_fn(prediction, y), prediction


def make_model() -> Regressor:
    """The model as trained (float16); also the factory for `nanwatch replay --model accelerate_loop:make_model`."""
    return Regressor().half()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    add_config_arguments(parser)  # --config FILE and one option per WatchConfig field (--report-dir, ...)
    args = parser.parse_args(argv)

    tracker = OverflowTracker(config_from_args(args, parser))
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True, log_with=[tracker])

    torch.manual_seed(0)
    x = torch.randn(32, 16)
    y = x.sum(dim=1, keepdim=True) * 10  # targets of size ~40: the errors grow fast once the weights diverge
    loader = DataLoader(TensorDataset(x.half(), y.half()), batch_size=8)  # 4 micro-batches per epoch
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    tracker.attach(accelerator, model)  # on every rank, after prepare()

    try:
        for epoch in range(args.epochs):
            for inputs, targets in loader:
                with accelerator.accumulate(model):
                    loss, _ = model(inputs, targets)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            accelerator.print(f"epoch {epoch}: loss {loss.item():.1f}")
    except NonFiniteError as error:
        weights_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        accelerator.print(
            f"stopped: inf/nan in batch_number={error.batch_number} (optimizer step {error.optimizer_step}, "
            f"epoch {error.epoch}) on rank {error.rank}, first in module {error.module_name!r}; "
            f"weights still finite: {weights_finite}"
        )
        return 1
    finally:
        tracker.detach()
    accelerator.print("finished without inf/nan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
