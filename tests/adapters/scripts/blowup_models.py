"""Small models for the adapter tests and scripts: an inf appears at a chosen training micro-batch on a chosen rank.

The multi-process scripts in this folder import it as `blowup_models` (they run with only this folder on the import
path); in-process tests that share one of its models import it as `tests.adapters.scripts.blowup_models`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class Boost(torch.nn.Module):
    """Multiplies by the micro-batch's own `boost` input: a spike that comes with the data, in this module only."""

    def forward(self, x: torch.Tensor, boost: torch.Tensor) -> torch.Tensor:
        return x * boost


class Boosted(torch.nn.Module):
    """Linear(4, 8) -> Tanh -> Boost -> Linear(8, 1), seeded; `boost` reaches the Boost module alone (the sentinel
    spike tests, tests/adapters/test_spikes_sentinel.py and spike_ddp_run.py)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.act = torch.nn.Linear(4, 8), torch.nn.Tanh()
        self.boost, self.out = Boost(), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, boost: torch.Tensor) -> torch.Tensor:
        return self.out(self.boost(self.act(self.inp(x)), boost))


class Blowup(torch.nn.Module):
    """Passes its input through, except on training forward number `at` (0-indexed) on `rank`, where it adds inf.

    It stands in for an activation that overflowed; it counts its own forwards (training and evaluation apart), so
    a test knows exactly which micro-batch goes bad without depending on the data order. `eval_at` does the same
    for evaluation forwards.
    """

    def __init__(self, at: int | None, rank: int | None = None, eval_at: int | None = None) -> None:
        super().__init__()
        self.at = at
        self.rank = rank
        self.eval_at = eval_at
        self.count = 0
        self.eval_count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            hit = self.count == self.at
            self.count += 1
        else:
            hit = self.eval_count == self.eval_at
            self.eval_count += 1
        hit = hit and (self.rank is None or _rank() == self.rank)
        return x + float("inf") if hit else x


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ArmedBlowup(torch.nn.Module):
    """Passes its input through; multiplies it by inf while `armed`, which the caller sets: the frames of that rank
    hold the inf from that forward on (agreement_faults_run.py, and the two ranks in one process of
    tests/core/test_ranks.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("inf") if self.armed else x


class TinyRegressor(torch.nn.Module):
    """Linear -> ReLU -> Blowup -> Linear, returning {"loss", "logits"} as a transformers model does."""

    def __init__(
        self, inject_at: int | None = None, inject_rank: int | None = None, inject_eval_at: int | None = None
    ) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()
        self.blowup = Blowup(inject_at, inject_rank, inject_eval_at)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.out(self.blowup(self.act(self.inp(x))))
        result = {"logits": logits}
        if labels is not None:
            result["loss"] = torch.nn.functional.mse_loss(logits, labels)
        return result


class SumDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """`n` random 4-vectors, each labelled with the sum of its entries, as dicts {"x", "labels"} (what HF's collator
    and a transformers-style model's keyword arguments expect; the other frameworks' loops read the same keys).

    The scripts here, the checkpoint guard's tests and the conformance harnesses (tests/adapters/conformance/common.py)
    all draw their data from it.
    """

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


def hook_count(model: torch.nn.Module) -> int:
    """Forward and forward-pre hooks left on any module of `model`."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def same_weights(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())


def finish_rank(out: Path, rank: int, record: dict[str, Any], error: BaseException | None) -> int:
    """End a torchrun rank: write DIR/outcome-rank{R}.json, leave the process group, then let `error` end the process
    (non-zero exit) so the launcher sees it, as an uncaught error would."""
    (out / f"outcome-rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    dist.destroy_process_group()
    if error is not None:
        raise error
    return 0
