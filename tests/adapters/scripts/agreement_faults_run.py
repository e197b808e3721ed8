"""Two gloo ranks started by `torch.multiprocessing.spawn`, rank 0's process hosting the store (tcp:// init), in one
of the scenarios tests/adapters/test_agreement_faults.py runs:

- destroy: three clean DDP steps, then `destroy_process_group()` on both ranks and rank 0 exits (the store goes with
  it); rank 1 trains on under the same watcher, and its forward is made to overflow at micro-batch 6: it stops on what
  it saw itself, and nothing of nanwatch's fails before that.
- host_leaves: as destroy, but rank 1 goes on only once rank 0's store no longer takes connections (and its bell has
  the news): rank 1 stops on what it saw itself at micro-batch 6, says so in exactly one NanwatchWarning (recorded),
  and nothing of torch's store client reaches stderr.
- extra: rank 1 makes a watcher of another model first (an evaluation helper, say); rank 1's forward overflows at
  micro-batch 3 of the DDP model: both ranks raise the same error, naming rank 1, without waiting out rank_wait_s.
- listener_dies: rank 1's listener fails as it starts (its connection dropped), so rank 1 polls its bell; rank 0's
  forward overflows at micro-batch 3: both ranks raise the same error, naming rank 0.
- two_models: each rank trains a model of its own (no DDP, models of different structures); rank 1's overflows at
  micro-batch 3: rank 1 stops (at once: no other rank watches its model), rank 0 trains to the end.

    python agreement_faults_run.py SCENARIO OUT_DIR PORT
Each rank writes OUT_DIR/outcome-rank{R}.json.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from blowup_models import ArmedBlowup
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nanwatch
from nanwatch.core.distributed import listener

WAIT_S = 3.0


def _step(
    model: nn.Module, optimizer: Any, handle: Any, record: dict[str, Any], step: int, *, armed: tuple[ArmedBlowup, bool]
) -> None:
    """One training step of micro-batch `step`, the blowup armed or not; the record says how far the run got."""
    armed[0].armed = armed[1]
    record["detected_at"] = time.monotonic()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    handle.step()
    record["steps_done"] = step + 1


def _train(model: nn.Module, blowup: ArmedBlowup, arm_at: int | None, steps: int, record: dict[str, Any]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, optimizer=optimizer, rank_wait_s=WAIT_S, report_dir=None) as handle:
        _LAST.append(handle)
        for step in range(steps):
            _step(model, optimizer, handle, record, step, armed=(blowup, step == arm_at))


def _dies(self: Any) -> None:
    self.failure = ConnectionResetError("the listener's connection dropped")
    self.ready.set()
    self._done.set()


_LAST: list[Any] = []


def _bell_of_last_watcher() -> Any:
    board = _LAST[-1].watcher._arbiter._board
    return None if board is None else board._bell


def _model(width: int = 4) -> tuple[nn.Module, ArmedBlowup]:
    blowup = ArmedBlowup()
    if width != 4:  # another model: another structure (keys come from module classes and names, not from shapes)
        return nn.Sequential(nn.Linear(4, width), blowup, nn.ReLU(), nn.Linear(width, 1)), blowup
    return nn.Sequential(nn.Linear(4, width), blowup, nn.Linear(width, 1)), blowup


def _destroy_then_train(rank: int, record: dict[str, Any]) -> None:
    """One watcher across the end of the process group: the store vanishes under it."""
    model, blowup = _model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    handle = nanwatch.watch(ddp, optimizer=optimizer, rank_wait_s=WAIT_S, report_dir=None)
    for step in range(3):
        _step(ddp, optimizer, handle, record, step, armed=(blowup, False))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        handle.close()
        return  # and the process exits: the store it hosted is gone
    time.sleep(1.5)
    for step in range(3, 10):  # the inner model from now on, still watched by the same handle
        _step(model, optimizer, handle, record, step, armed=(blowup, step == 6))


def _takes_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0):
            return True
    except OSError:
        return False


def _host_leaves(rank: int, record: dict[str, Any], port: int) -> None:
    """One watcher across the end of the process group, whose store goes with rank 0's process."""
    model, blowup = _model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    handle = nanwatch.watch(ddp, optimizer=optimizer, rank_wait_s=WAIT_S, report_dir=None)
    for step in range(3):
        _step(ddp, optimizer, handle, record, step, armed=(blowup, False))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        _LAST.append(handle)  # still open as the process exits: the store goes at exit
        return
    _LAST.append(handle)
    deadline = time.monotonic() + 60
    while _takes_connections(port) and time.monotonic() < deadline:  # rank 0's process and its store are gone
        time.sleep(0.05)
    while _bell_of_last_watcher().rung() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    record["store_gone"] = not _takes_connections(port)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(3, 10):  # the inner model from now on, still watched by the same handle
                _step(model, optimizer, handle, record, step, armed=(blowup, step == 6))
        finally:
            handle.close()
            record["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]


def run(rank: int, scenario: str, out: Path, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    record: dict[str, Any] = {"rank": rank, "error": None, "steps_done": 0, "other_error": None}
    torch.manual_seed(0)
    try:
        if scenario == "destroy":
            _destroy_then_train(rank, record)
        elif scenario == "host_leaves":
            _host_leaves(rank, record, port)
        elif scenario == "extra":
            if rank == 1:
                helper = nn.Sequential(nn.Conv1d(1, 1, 3))
                nanwatch.watch(helper, report_dir=None)  # never closed: it keeps its keys
            model, blowup = _model()
            ddp = DistributedDataParallel(model)
            _train(ddp, blowup, 3 if rank == 1 else None, 8, record)
        elif scenario == "listener_dies":
            if rank == 1:  # its listener's connection fails at once: the bell is polled from then on
                listener.BellListener._listen = _dies  # type: ignore[method-assign]
            model, blowup = _model()
            ddp = DistributedDataParallel(model)
            _train(ddp, blowup, 3 if rank == 0 else None, 8, record)
        elif scenario == "two_models":
            model, blowup = _model(4 if rank == 0 else 6)
            _train(model, blowup, 3 if rank == 1 else None, 8, record)
        else:
            raise ValueError(scenario)
    except nanwatch.NonFiniteError as error:
        record["error"] = {"rank": error.rank, "batch_number": error.batch_number, "message": str(error)}
        record["took_s"] = time.monotonic() - record["detected_at"]
        record["polled"] = bool(_LAST) and isinstance(_bell_of_last_watcher(), listener.PolledBell)
    except BaseException as error:
        record["other_error"] = "".join(traceback.format_exception(error))
    (out / f"outcome-rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    scenario_name, out_dir, free_port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    mp.spawn(run, args=(scenario_name, out_dir, free_port), nprocs=2, join=True)
