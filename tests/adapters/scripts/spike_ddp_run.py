"""A hand-written DDP loop in sentinel mode with spike warnings: one micro-batch of rank 1 alone carries data that
makes one module's output x100. The gradients, averaged by DDP's all-reduce, spike on both ranks; each rank replays
its own micro-batch (forward only, on the model inside DDP: no collective), so rank 1 names the module and rank 0 says
its own data moved nothing. Both train on to the end with equal weights.

Run by tests/adapters/test_spikes_sentinel.py as
    torchrun --nproc_per_node 2 spike_ddp_run.py --out DIR --spike-at 12
Each rank writes DIR/outcome-rank{R}.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from blowup_models import Boosted, finish_rank
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nanwatch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--spike-at", type=int, required=True)
    parser.add_argument("--micro-batches", type=int, default=16)
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = Boosted()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank + 1)
    error: BaseException | None = None
    record: dict[str, Any] = {"rank": rank, "error": None, "steps": 0}
    config = {"mode": "sentinel", "spike_window": 10, "report_dir": options.out / "reports"}
    try:
        with nanwatch.watch(ddp, optimizer=optimizer, **config) as handle:
            for micro in range(options.micro_batches):
                x, y = torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)
                boost = torch.tensor(100.0 if micro == options.spike_at and rank == 1 else 1.0)
                optimizer.zero_grad()
                handle.watch_loss(nn.functional.mse_loss(ddp(x, boost), y)).backward()
                optimizer.step()
                handle.step()
                record["steps"] += 1
    except nanwatch.NanwatchError as caught:
        error = caught
        record["error"] = str(caught)
    record["weights"] = [float(param.detach().double().sum()) for param in model.parameters()]
    return finish_rank(options.out, rank, record, error)


if __name__ == "__main__":
    sys.exit(main())
