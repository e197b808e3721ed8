"""A DDP loop watched every 3rd micro-batch: rank 1 goes inf in an unwatched one; every rank must stop together later.

Run by tests/adapters/test_scope_ddp.py as
    torchrun --nproc_per_node 2 scope_ddp_run.py --out DIR --inject-at 4 --inject-rank 1
Unwatched micro-batches run no check and no collective, decided from the batch number alone, so both ranks skip the
same ones. Each rank writes DIR/outcome-rank{R}.json, then lets the error end the process (non-zero exit).
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
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyRegressor(options.inject_at, options.inject_rank)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = SumDataset(48, seed=rank)
    record: dict[str, Any] = {"rank": rank, "error": None, "micro_batches_run": 0}
    error: nanwatch.NonFiniteError | None = None
    config = {"watch_every_n_batches": 3, "report_dir": options.out / "reports"}
    try:
        with nanwatch.watch(ddp, config, optimizer=optimizer) as handle:
            for micro in range(12):
                batch = data[slice(4 * micro, 4 * micro + 4)]
                last = (micro + 1) % ACCUMULATION == 0
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = ddp(batch["x"], labels=batch["labels"])["loss"] / ACCUMULATION
                    loss.backward()
                if last:
                    optimizer.step()
                    optimizer.zero_grad()
                record["micro_batches_run"] = micro + 1
                handle.step()
    except nanwatch.NonFiniteError as caught:
        error = caught
        record["error"] = {"batch_number": caught.batch_number, "rank": caught.rank, "module": caught.module_name}
    return finish_rank(options.out, rank, record, error)


if __name__ == "__main__":
    sys.exit(main())
