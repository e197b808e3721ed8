"""Two ranks with uneven data under torchrun (gloo), watched by `nanwatch.watch(..., optimizer=...)`.

Run by tests/adapters/test_uneven_ranks.py as
    torchrun --nproc_per_node 2 uneven_run.py --out DIR --batches 6 4 [--ddp] [--inject-at K --inject-rank R]
        [--keep-going-rank R]
With --ddp the model is a DistributedDataParallel and the loop runs in `ddp.join()` (PyTorch's way to train on uneven
data: a rank out of data shadows the others' collectives); without, each rank trains its own copy. Every rank ends
with the user's own `dist.barrier()`. Each rank writes DIR/outcome-rank{R}.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from blowup_models import SumDataset, TinyRegressor, hook_count
from torch.nn.parallel import DistributedDataParallel

import nanwatch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs=2, required=True, help="micro-batches of rank 0 and rank 1")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--inject-at", type=int, default=None)
    parser.add_argument("--inject-rank", type=int, default=None)
    parser.add_argument("--keep-going-rank", type=int, default=None, help="this rank catches its error and goes on")
    options = parser.parse_args()

    # A short group timeout: were nanwatch to leave a rank in a collective, the run would fail in a minute.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model = TinyRegressor(options.inject_at, options.inject_rank)
    trained: torch.nn.Module = DistributedDataParallel(model) if options.ddp else model
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.01)
    batches = options.batches[rank]
    data = SumDataset(4 * batches, seed=rank)
    record: dict[str, Any] = {"rank": rank, "error": None, "ran": 0, "went_on": 0}
    start = time.monotonic()
    handle = nanwatch.watch(trained, optimizer=optimizer, rank_wait_s=3, report_dir=options.out / "reports")
    try:
        with trained.join() if options.ddp else contextlib.nullcontext():  # type: ignore[operator]
            for micro in range(batches):
                if options.keep_going_rank not in (None, rank) and micro == options.inject_at + 1:
                    # Ranks without DDP run at their own pace: before its next micro-batch, this one waits (on a
                    # test key of the store, not through nanwatch) until the other rank caught its error.
                    store.wait(["test/caught"], timedelta(seconds=60))
                batch = data[slice(4 * micro, 4 * micro + 4)]
                trained(batch["x"], labels=batch["labels"])["loss"].backward()
                optimizer.step()
                optimizer.zero_grad()
                handle.step()
                record["ran"] = micro + 1
    except nanwatch.NonFiniteError as caught:
        record["error"] = {
            "batch_number": caught.batch_number,
            "rank": caught.rank,
            "after_s": time.monotonic() - start,
        }
        handle.close()
        if rank == options.keep_going_rank:  # it goes on, without nanwatch: the others must not wait for it
            store.set("test/caught", "1")
            for micro in range(record["ran"] + 1, batches):
                batch = data[slice(4 * micro, 4 * micro + 4)]
                model(batch["x"], labels=batch["labels"])["loss"].backward()
                record["went_on"] += 1
    handle.close()
    record["hooks_left"] = hook_count(model)
    (options.out / f"outcome-rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    if options.ddp and record["error"] is not None:
        # Out of the join() on an error: the ranks that joined wait in torch's own shadow collectives, which only
        # this process ending releases (they then fail with a connection error). An error ends a DDP script anyway.
        return 1
    dist.barrier()  # the user's own, at the end
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
