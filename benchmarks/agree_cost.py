"""What distributed agreement costs per micro-batch, on 2 gloo processes: what the hot path asks, against a collective.

nanwatch runs no collective of its own. Each rank asks, once per training micro-batch (as it starts) and at each
optimizer step, whether a verdict reached it (`DetectionBoard.posted_elsewhere`): a Python attribute its listener
thread sets (core/listener.py), no call to the store (before issue 23: one round trip to the store). This starts
`--world-size` processes with the gloo backend, warms up, then times `--calls` back-to-back asks on each rank and
prints the per-call figure (the slowest rank's mean and median). For comparison it times a plain `dist.all_reduce`
of a one-element tensor: what nanwatch paid per micro-batch before that. benchmarks/agreement.py shows the store's
side, for many ranks.

    python benchmarks/agree_cost.py                    # 2 processes, 1000 calls
    python benchmarks/agree_cost.py --calls 5000 --world-size 2

This is a benchmark, not a test: it asserts nothing about speed, it reports.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanwatch.core.board import DetectionBoard


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _time_calls(call: Any, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, world_size: int, port: int, calls: int, results: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        flag = torch.zeros(1, dtype=torch.int64)
        board = DetectionBoard.for_model(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), rank, world_size, wait_s=10.0)
        assert board is not None
        for _ in range(100):  # warm-up: connections
            board.posted_elsewhere()
        dist.barrier()
        agree = _time_calls(board.posted_elsewhere, calls)
        dist.barrier()
        floor = _time_calls(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN), calls)
        results[rank] = (agree, floor)
        board.close()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args.world_size, _free_port(), args.calls, results), nprocs=args.world_size)
        per_rank = dict(results)

    def figures(index: int) -> tuple[float, float]:
        means = [statistics.fmean(per_rank[r][index]) * 1e6 for r in per_rank]
        medians = [statistics.median(per_rank[r][index]) * 1e6 for r in per_rank]
        return max(means), max(medians)

    agree_mean, agree_median = figures(0)
    floor_mean, floor_median = figures(1)
    print(f"{args.world_size} gloo processes on the CPU, {args.calls} calls each (torch {torch.__version__})")
    print(f"posted_elsewhere():            mean {agree_mean:.2f} us, median {agree_median:.2f} us per call")
    print(f"all_reduce of one int64:       mean {floor_mean:.0f} us, median {floor_median:.0f} us per call")


if __name__ == "__main__":
    main()
