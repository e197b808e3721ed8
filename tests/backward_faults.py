"""Modules whose fault exists only in backward: the identity forward, a non-finite gradient backward.

Shared by the gradient tests and the AMP tests of every adapter (core, plain, Lightning, Accelerate, HF Trainer).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class InfInBackward(nn.Module):
    """The identity forward; an inf gradient backward, whatever the loss scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _ScaleGradient.apply(x, math.inf)
        return out


class NanInBackward(nn.Module):
    """The identity forward; a nan gradient backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _ScaleGradient.apply(x, math.nan)
        return out
