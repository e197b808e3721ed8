"""Two gloo ranks under torchrun, in one of the scenarios tests/adapters/test_agreement_launch.py runs:

- restart (with `--max-restarts 1`): attempt 0 (TORCHELASTIC_RESTART_COUNT 0) overflows on rank 1 at micro-batch 3 and
  both ranks stop (non-zero exit: torchrun starts the workers again, on the same agent store); attempt 1 has no inf
  and must train to the end (exit 0).
- one_rank: rank 0 also watches an evaluation model of its own (rank 1 never watches it), which overflows; rank 0 must
  raise at once, not after waiting `rank_wait_s` (60 s) for a rank that never attached. Both ranks then train the DDP
  model to the end.

    torchrun --nproc_per_node 2 agreement_launch_run.py SCENARIO OUT_DIR
Each rank writes OUT_DIR/outcome-attempt{A}-rank{R}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from blowup_models import Blowup, SumDataset, TinyRegressor
from torch.nn.parallel import DistributedDataParallel

import nanwatch

MICRO_BATCHES = 6
RANK_WAIT_S = 60.0


def _train(rank: int, inject_at: int | None, record: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = TinyRegressor(inject_at, 1)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = SumDataset(4 * MICRO_BATCHES, seed=rank)
    with nanwatch.watch(ddp, optimizer=optimizer, rank_wait_s=RANK_WAIT_S, report_dir=None) as handle:
        for micro in range(MICRO_BATCHES):
            batch = data[slice(4 * micro, 4 * micro + 4)]
            ddp(batch["x"], labels=batch["labels"])["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
            record["steps_done"] = micro + 1


def _evaluate_alone(record: dict[str, Any]) -> None:
    """Rank 0 only: a watcher of a model no other rank watches (another structure than the trained model's: its keys
    are its own), whose forward overflows."""
    helper = torch.nn.Sequential(torch.nn.Linear(4, 4), Blowup(None, None, eval_at=0))
    helper.eval()
    began = time.monotonic()
    try:
        with nanwatch.watch(helper, rank_wait_s=RANK_WAIT_S, report_dir=None, watch_eval=True) as handle:
            with torch.no_grad():
                helper(torch.ones(2, 4))
            handle.step()
    except nanwatch.NonFiniteError as error:
        record["eval_error"] = {"rank": error.rank, "batch_number": error.batch_number, "phase": error.phase}
    record["eval_took_s"] = time.monotonic() - began


def _clear_gloo_keys_of_earlier_attempts(attempt: int) -> None:
    """Torch's own restart race, kept out of the test: the agent store still holds the gloo addresses of the previous
    attempt, and a rank whose gloo rendezvous reads the other's before it is rewritten connects to a dead address.
    Rank 0 deletes the process group's keys of earlier attempts (not nanwatch's: what the test is about) before
    either rank starts its gloo rendezvous."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=30), False
    )
    if int(os.environ["RANK"]) == 0:
        for key in store.list_keys():
            if key.startswith("default_pg/") and "/nanwatch/" not in key:
                store.delete_key(key)
        store.set(f"test/cleared/{attempt}", "1")
    else:
        store.wait([f"test/cleared/{attempt}"])


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt > 0:
        _clear_gloo_keys_of_earlier_attempts(attempt)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    record: dict[str, Any] = {"rank": rank, "attempt": attempt, "error": None, "steps_done": 0}
    failed = False
    try:
        if scenario == "restart":
            _train(rank, 3 if attempt == 0 else None, record)
        elif scenario == "one_rank":
            if rank == 0:
                _evaluate_alone(record)
            _train(rank, None, record)
        else:
            raise ValueError(scenario)
    except nanwatch.NonFiniteError as error:
        record["error"] = {"rank": error.rank, "batch_number": error.batch_number, "message": str(error)}
        failed = True
    (out / f"outcome-attempt{attempt}-rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    if not failed:
        dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
