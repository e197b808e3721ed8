"""A hand-written DDP loop with `on_detect="skip"` where the inf never reaches the gradients: rank 1's diagnostic
submodule (its output only logged, computed from a detached copy) goes inf at micro-batch `--inject-at`. Every rank
must skip that same optimizer step; then the same processes train an unwatched twin that leaves out exactly the steps
the watched run listed, and the weights must match bit for bit.

Run by tests/adapters/test_skip_agreement.py as
    torchrun --nproc_per_node 2 skip_vote_ddp_run.py --out DIR --inject-at 3 --inject-rank 1
Each rank writes DIR/outcome-rank{R}.json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from blowup_models import Blowup, SumDataset, finish_rank
from torch.nn.parallel import DistributedDataParallel

import nanwatch

ACCUMULATION = 2


class Probed(torch.nn.Module):
    """Linear -> ReLU -> Linear, and a probe on a detached copy of the hidden layer whose output is only logged: an
    inf there (Blowup, on one rank) never reaches the loss nor the gradients."""

    def __init__(self, inject_at: int | None, inject_rank: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.act, self.out = torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        self.probe = torch.nn.Sequential(torch.nn.Linear(8, 2), Blowup(inject_at, inject_rank))
        self.probe.requires_grad_(False)
        self.logged: list[float] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.act(self.inp(x))
        self.logged.append(float(self.probe(hidden.detach()).abs().max()))  # a diagnostic, logged only
        return {"loss": torch.nn.functional.mse_loss(self.out(hidden), labels)}


def train(options: argparse.Namespace, rank: int, *, watched: bool, leave_out: set[int]) -> dict[str, Any]:
    """Train `--micro-batches` micro-batches (Adam, 2 per optimizer step); watched with skip, or unwatched leaving out
    the optimizer steps `leave_out` (no `optimizer.step()` there, the gradients cleared as after any step)."""
    model = Probed(options.inject_at if watched else None, options.inject_rank)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam([p for p in ddp.parameters() if p.requires_grad], lr=0.01)
    data = SumDataset(4 * options.micro_batches, seed=rank)
    config = {"report_dir": options.out / "reports", "on_detect": "skip", "rank_wait_s": options.rank_wait_s}
    record: dict[str, Any] = {}
    with nanwatch.watch(ddp, optimizer=optimizer, **config) if watched else contextlib.nullcontext() as handle:
        step = 0
        for micro in range(options.micro_batches):
            batch = data[slice(4 * micro, 4 * micro + 4)]
            last = (micro + 1) % ACCUMULATION == 0
            with contextlib.nullcontext() if last else ddp.no_sync():
                (ddp(batch["x"], labels=batch["labels"])["loss"] / ACCUMULATION).backward()
            if last:
                if step not in leave_out:
                    optimizer.step()
                optimizer.zero_grad()
                step += 1
            if handle is not None:
                handle.step()
        if handle is not None:
            record["skipped"] = handle.skipped
    weights = torch.cat([param.detach().flatten() for param in model.parameters()])
    record["weights"] = weights.double().tolist()  # float32 values, exactly
    record["finite"] = bool(torch.isfinite(weights).all())
    return record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject-at", type=int, required=True)
    parser.add_argument("--inject-rank", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=10)
    parser.add_argument("--rank-wait-s", type=float, default=30.0)
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    error: BaseException | None = None
    record: dict[str, Any] = {"rank": rank, "error": None}
    try:
        record["watched"] = train(options, rank, watched=True, leave_out=set())
        listed = {int(entry["optimizer_step"]) for entry in record["watched"]["skipped"]}
        record["twin"] = train(options, rank, watched=False, leave_out=listed)
    except nanwatch.NanwatchError as caught:
        error = caught
        record["error"] = str(caught)
    return finish_rank(options.out, rank, record, error)


if __name__ == "__main__":
    sys.exit(main())
