"""A hand-written DDP training loop watched by `nanwatch.watch(model, optimizer=opt)`, with gradient accumulation 2.

Run by tests/adapters/test_plain_ddp.py as
    torchrun --nproc_per_node 2 plain_ddp_run.py --out DIR --inject-at 3 --inject-rank 1
Each rank writes DIR/outcome-rank{R}.json, then lets the error end the process (non-zero exit).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from blowup_models import SumDataset, TinyRegressor, finish_rank, hook_count, same_weights, snapshot
from torch.nn.parallel import DistributedDataParallel

import nanwatch

ACCUMULATION = 2


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject-at", type=int, required=True)
    parser.add_argument("--inject-rank", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=12)
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyRegressor(options.inject_at, options.inject_rank)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = SumDataset(4 * options.micro_batches, seed=rank)  # each rank its own shard
    before_step = snapshot(model)
    steps_done = 0
    record: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size(), "error": None, "detected_at": None}
    error: nanwatch.NonFiniteError | None = None
    try:
        with nanwatch.watch(ddp, report_dir=options.out / "reports", optimizer=optimizer) as handle:
            for micro in range(options.micro_batches):
                batch = data[slice(4 * micro, 4 * micro + 4)]
                last = (micro + 1) % ACCUMULATION == 0
                # Gradients are all-reduced only on the last micro-batch of each accumulation group.
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = ddp(batch["x"], labels=batch["labels"])["loss"] / ACCUMULATION
                    loss.backward()
                if last:
                    optimizer.step()  # nanwatch agrees across ranks here; a bad micro-batch never reaches the weights
                    optimizer.zero_grad()
                    before_step = snapshot(model)
                    steps_done += 1
                handle.step()
    except nanwatch.NonFiniteError as caught:
        error = caught
        record["detected_at"] = time.time()
        record["error"] = {
            "batch_number": caught.batch_number,
            "rank": caught.rank,
            "optimizer_step": caught.optimizer_step,
            "module_name": caught.module_name,
            "message": str(caught),
        }
    record["weights_unchanged"] = same_weights(model, before_step)
    record["steps_done"] = steps_done
    record["hooks_left"] = hook_count(model) + hook_count(ddp)
    record["optimizer_hooks_left"] = len(optimizer._optimizer_step_pre_hooks) + len(
        optimizer._optimizer_step_post_hooks
    )
    return finish_rank(options.out, rank, record, error)


if __name__ == "__main__":
    sys.exit(main())
