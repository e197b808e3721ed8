"""The plain wrapper with `watch_eval`, and an evaluation run on rank 0 only between `optimizer.step()` and
`handle.step()`: the evaluation must leave the training micro-batch's agreement as it was, so that both ranks run the
same collectives (a rank waiting in one the other never joins would hang until the process group's timeout).

Run by tests/adapters/test_plain_ddp.py as
    torchrun --nproc_per_node 2 plain_eval_on_rank0_run.py --out DIR
Each rank writes DIR/outcome-rank{R}.json.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from blowup_models import SumDataset, TinyRegressor, finish_rank
from torch.nn.parallel import DistributedDataParallel

import nanwatch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--micro-batches", type=int, default=6)
    options = parser.parse_args()

    # A short timeout: a rank left waiting in a collective fails in seconds instead of half an hour.
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyRegressor()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = SumDataset(4 * options.micro_batches, seed=rank)
    with nanwatch.watch(ddp, optimizer=optimizer, watch_eval=True) as handle:
        for micro in range(options.micro_batches):
            batch = data[slice(4 * micro, 4 * micro + 4)]
            ddp(batch["x"], labels=batch["labels"])["loss"].backward()
            optimizer.step()  # the agreement point of this micro-batch, on both ranks
            optimizer.zero_grad()
            if rank == 0:  # evaluation on rank 0 only, as validation often runs
                model.eval()
                with torch.no_grad():
                    model(batch["x"])
                model.train()
            handle.step()  # agreed already: no collective here, on either rank
    dist.barrier()  # both ranks must get here: each ran exactly as many collectives as the other
    record = {
        "rank": rank,
        "batch_number": handle.batch_number,
        "eval_batch_number": handle.watcher.counters.eval_batch_number,
    }
    return finish_rank(options.out, rank, record, None)


if __name__ == "__main__":
    sys.exit(main())
