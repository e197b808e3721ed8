"""Run by `accelerate launch --cpu --num_processes 2`: only rank 1 sees inf, in micro-batch 3.

Usage: accelerate_two_ranks.py REPORT_DIR MARKER_DIR. Each rank writes what it caught to MARKER_DIR/rank{R}.json,
then lets the error propagate so the process exits non-zero.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from nanwatch import NonFiniteError
from nanwatch.adapters.accelerate import OverflowTracker

INF_RANK = 1
INF_MICRO_BATCH = 3


def main() -> None:
    report_dir, marker_dir = Path(sys.argv[1]), Path(sys.argv[2])
    tracker = OverflowTracker(report_dir=report_dir)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True, log_with=[tracker])
    rank = accelerator.process_index
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    tracker.attach(accelerator, model)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of data
    try:
        for micro_batch in range(8):
            x, y = torch.randn(2, 4, generator=generator), torch.randn(2, 1, generator=generator)
            if rank == INF_RANK and micro_batch == INF_MICRO_BATCH:
                x[0, 0] = float("inf")
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    except NonFiniteError as error:
        caught = {
            "process": rank,
            "rank": error.rank,
            "batch_number": error.batch_number,
            "optimizer_step": error.optimizer_step,
            "hooks_left": tracker.watcher is not None and tracker.watcher.attached,
            "time": time.time(),
        }
        (marker_dir / f"rank{rank}.json").write_text(json.dumps(caught))
        raise


if __name__ == "__main__":
    main()
