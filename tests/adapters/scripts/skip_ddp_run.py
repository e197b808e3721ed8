"""A hand-written DDP loop with `on_detect="skip"`: inf on one rank only, in one micro-batch; every rank must skip that
same optimizer step (the weights stay equal across ranks) and train on to the end.

Run by tests/adapters/test_skip.py as
    torchrun --nproc_per_node 2 skip_ddp_run.py --out DIR --inject-at 3 --inject-rank 1 --inject-again 6
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
from blowup_models import SumDataset, TinyRegressor, finish_rank
from torch.nn.parallel import DistributedDataParallel

import nanwatch

ACCUMULATION = 2


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject-at", type=int, required=True)
    parser.add_argument("--inject-rank", type=int, default=None)
    parser.add_argument("--inject-again", type=int, default=None, help="a second bad micro-batch, later")
    parser.add_argument("--micro-batches", type=int, default=10)
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyRegressor(options.inject_at, options.inject_rank)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    data = SumDataset(4 * options.micro_batches, seed=rank)
    changed = []  # per optimizer step: did the weights change?
    error: BaseException | None = None
    record: dict[str, Any] = {"rank": rank, "error": None}
    try:
        with nanwatch.watch(ddp, report_dir=options.out / "reports", optimizer=optimizer, on_detect="skip") as handle:
            for micro in range(options.micro_batches):
                batch = data[slice(4 * micro, 4 * micro + 4)]
                if micro == options.inject_at + 1 and options.inject_again is not None:
                    model.blowup.at = options.inject_again  # Blowup counts its forwards: a second bad one, later
                last = (micro + 1) % ACCUMULATION == 0
                with contextlib.nullcontext() if last else ddp.no_sync():
                    (ddp(batch["x"], labels=batch["labels"])["loss"] / ACCUMULATION).backward()
                if last:
                    before = [param.detach().clone() for param in model.parameters()]
                    optimizer.step()
                    optimizer.zero_grad()
                    changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)))
                handle.step()
            record["skipped"] = handle.skipped
    except nanwatch.NanwatchError as caught:
        error = caught
        record["error"] = str(caught)
    record["changed"] = changed
    record["weights"] = [float(param.detach().double().sum()) for param in model.parameters()]
    record["finite"] = all(bool(torch.isfinite(param).all()) for param in model.parameters())
    return finish_rank(options.out, rank, record, error)


if __name__ == "__main__":
    sys.exit(main())
