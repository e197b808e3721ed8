"""Models for tests/test_replay.py, importable as `tests.replay_models:factory` by `nanwatch replay` in a subprocess.

`TinyNet` has everything a replay must restore to give the same numbers: weights that training changed, buffers
(BatchNorm's running statistics), a Dropout whose mask comes from the torch generator, and a keyword tensor input.
Trained by gradient ascent with a big learning rate, its weights grow until an fp32 activation overflows.
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 16


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(0.25)
        self.blocks = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.drop(self.norm(self.inp(x)))
        if scale is not None:
            hidden = hidden * scale
        return self.head(self.blocks(hidden))


class WiderNet(nn.Module):
    """Another model: same module names as TinyNet, other widths, and one more layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.25)
        self.blocks = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(32, 32), nn.ReLU())])
        self.head = nn.Linear(32, 1)
        self.extra = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.extra(self.head(self.blocks(self.drop(self.norm(self.inp(x))))))


def factory() -> TinyNet:
    """A fresh TinyNet with other initial weights than training's: the replay must restore the captured ones."""
    torch.manual_seed(1234)
    return TinyNet()


def other_factory() -> WiderNet:
    return WiderNet()


def half_factory() -> TinyNet:
    """TinyNet in float16: every parameter of another dtype than the captured fp32 ones."""
    return TinyNet().half()


def broken_factory() -> TinyNet:
    raise RuntimeError("the config file train.yaml is missing")


NOT_CALLABLE = 42
