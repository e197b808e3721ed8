"""A DDP loop under `nanwatch.watch(model, optimizer=opt, watch_gradients=True)`: a nan born in backward on one rank.

Run by tests/adapters/test_plain_ddp_gradients.py as
    torchrun --nproc_per_node 2 plain_ddp_gradients_run.py --out DIR --inject-at 1 --inject-rank 1
On micro-batch `inject-at` of rank `inject-rank` the module `poison` makes the gradient of its input nan (its forward
is the identity, so no forward frame shows anything). Each rank writes DIR/outcome-rank{R}.json, then lets the error
end the process (non-zero exit).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from blowup_models import SumDataset, finish_rank, same_weights, snapshot
from torch.nn.parallel import DistributedDataParallel

import nanwatch


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Poison(torch.nn.Module):
    def __init__(self, at: int, rank: int) -> None:
        super().__init__()
        self.at, self.rank, self.count = at, rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hit = self.count == self.at and dist.get_rank() == self.rank
        self.count += 1
        return _NanBackward.apply(x) if hit else x


class PoisonedNet(torch.nn.Module):
    def __init__(self, at: int, rank: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU(inplace=True)
        self.poison = Poison(at, rank)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.poison(self.act(self.inp(x))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject-at", type=int, required=True)
    parser.add_argument("--inject-rank", type=int, required=True)
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = PoisonedNet(options.inject_at, options.inject_rank)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = SumDataset(32, seed=rank)
    before_step = snapshot(model)
    steps_done = 0
    record: dict[str, Any] = {"rank": rank, "error": None}
    error: nanwatch.NonFiniteError | None = None
    handle = nanwatch.watch(ddp, optimizer=optimizer, watch_gradients=True, report_dir=options.out / "reports")
    try:
        for micro in range(6):
            x, y = data.x[4 * micro : 4 * micro + 4], data.y[4 * micro : 4 * micro + 4]
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()  # nanwatch agrees across ranks in the step pre-hook
            optimizer.zero_grad()
            before_step = snapshot(model)
            steps_done += 1
            handle.step()
    except nanwatch.NonFiniteError as caught:
        error = caught
        record["error"] = {"batch_number": caught.batch_number, "rank": caught.rank, "module": caught.module_name}
    finally:
        handle.close()
    record["weights_unchanged"] = same_weights(model, before_step)
    record["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    record["steps_done"] = steps_done
    record["parameter_hooks_left"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return finish_rank(options.out, rank, record, error)


if __name__ == "__main__":
    sys.exit(main())
