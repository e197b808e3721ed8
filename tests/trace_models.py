"""Small models and real runs whose JSON Lines reports and traces the tests of show, diff, plot and jsonl read.

`AmpNet` is fc1 -> act -> amp -> fc2, where `amp` multiplies by a factor the test sets: with a factor of 1e5 its
float16 output is inf (65504 is float16's max) while everything before it is unchanged, so a diff must name `amp`.
`Inject` writes a known number of nan and inf into its output, so counts can be checked exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import nanwatch
from nanwatch.core.log import get_logger

SEED = 1234

# The nanwatch logger takes sys.stderr when first used. Take it now, at import: first used inside a test with capsys,
# it would keep that test's stream, which is closed afterwards, and every later trace would log into a closed file.
get_logger()


class Amplify(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class AmpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.amp = Amplify()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.amp(self.act(self.fc1(x))))


class Inject(nn.Module):
    """Output = input with one nan and two infs (+inf and -inf) written in, when `armed`."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        out = x.clone()
        out[0, 0] = float("nan")
        out[0, 1] = float("inf")
        out[1, 1] = float("-inf")
        return out


def build_amp_net(dtype: torch.dtype = torch.float16) -> AmpNet:
    torch.manual_seed(SEED)
    return AmpNet().to(dtype)


def run_amp_net(
    report_dir: Path, *, dtype: torch.dtype = torch.float16, overflow_at: int | None = 2, batches: int = 3
) -> None:
    """Trace every batch of AmpNet (the same input each time); at `overflow_at`, amp multiplies by 1e5."""
    model = build_amp_net(dtype)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    try:
        with nanwatch.watch(model, trace_batch_nums=list(range(batches)), report_dir=report_dir) as handle:
            for batch in range(batches):
                model.amp.factor = 1e5 if batch == overflow_at else 1.0
                model(x)
                handle.step()
    except nanwatch.NonFiniteError:
        pass  # the report is on disk; the tests read it


def trace_path(report_dir: Path, rank: int = 0) -> Path:
    return report_dir / f"nanwatch-trace-rank{rank}.jsonl"
