"""Modules for the repro capsule's tests, importable as `tests.capsule_models` by `nanwatch repro` in a subprocess.

Each `*_case()` gives a module in float16 and its inputs, whose output overflows float16 (its largest value is
65504) but not float32: the precision case `nanwatch repro` must reproduce as recorded and clear with
`--dtype float32`. The weights are set, not trained, so the numbers are the same on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SEED = 0


@dataclass(frozen=True)
class Case:
    """A module and what it is called with: `module(*args, **kwargs)` overflows float16."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def linear_case() -> Case:
    """`nn.Linear(8, 4)`: 8 products of 100 x 100 sum to 80000 (float32 holds it; float16 rounds it to inf)."""
    linear = nn.Linear(8, 4)
    with torch.no_grad():
        linear.weight.fill_(100.0)
        linear.bias.zero_()
    return Case(linear.half(), (torch.full((2, 8), 100.0, dtype=torch.float16),), {})


class ScaledMLP(nn.Module):
    """Linear, GELU, Linear, then a scale by a buffer: the module compiled in the tests."""

    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, width)
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x: torch.Tensor, *, gain: float = 1.0) -> torch.Tensor:
        return self.down(self.act(self.up(x))) * self.scale * gain


def mlp_case() -> Case:
    """ScaledMLP: up gives 8 x 10 x 1 = 80 per unit, down sums 16 x 80 x 10 = 12800, times a gain of 8: 102400."""
    mlp = ScaledMLP()
    with torch.no_grad():
        mlp.up.weight.fill_(10.0)
        mlp.up.bias.zero_()
        mlp.down.weight.fill_(10.0)
        mlp.down.bias.zero_()
    return Case(mlp.half(), (torch.ones(2, 8, dtype=torch.float16),), {"gain": 8.0})


def gpt2_block_case() -> Case:
    """A transformers GPT2Block from a tiny config (random weights, no download), its MLP's weights scaled by 2000
    each: the MLP's output reaches about 3e5, past float16's range; float32 and bfloat16 hold it."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(SEED)
    config = GPT2Config(
        n_embd=32,
        n_head=2,
        n_layer=1,
        n_positions=16,
        vocab_size=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    block = GPT2Block(config).eval()
    with torch.no_grad():
        block.mlp.c_fc.weight.mul_(2000.0)
        block.mlp.c_proj.weight.mul_(2000.0)
    hidden = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(SEED))
    return Case(block.half(), (hidden.half(),), {})


class Tied(nn.Module):
    """Two Linears sharing one weight, and a buffer left out of the state_dict: a capsule must keep both as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 0.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.mask


class HoldsLock(nn.Module):
    """A module that cannot be pickled: it holds a lock."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.fc = nn.Linear(2, 2)
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class RefusesFloat64(nn.Module):
    """A Linear whose forward raises in float64: a run that cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise TypeError("float64 is not supported by this module")
        return self.fc(x)


@dataclass(frozen=True)
class Options:
    """An input that is neither a tensor nor a plain value: the capsule pickles it on its own."""

    gain: float


def doubles_output(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """A forward hook that is part of what the module computes (a picklable, module-level function)."""
    return output * 2
