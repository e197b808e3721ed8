"""Modules the AMP tests of every adapter share (core, plain, Lightning, Accelerate, HF Trainer)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _InfBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class InfInBackward(nn.Module):
    """The identity forward; an inf gradient backward, whatever the loss scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _InfBackward.apply(x)
        return out
