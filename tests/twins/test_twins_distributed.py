"""Watching a healthy distributed run changes nothing: DDP, FSDP1 and FSDP2 (per-layer and root `fully_shard`,
gradient accumulation, a `MixedPrecisionPolicy` with `reshard_after_forward=False`), in full mode, sentinel mode,
`watch_gradients`, spikes with `on_detect="skip"`, and the checkpoint guard saving every other step.

Each twin pair (scripts/twin_run.py) trains the same seeded model on the same data, unwatched and then watched, on two
real gloo processes under torchrun: both must end with bitwise-identical weights (each rank's shards), optimizer
state and RNG states (torch, Python, NumPy), the same number of optimizer steps, and the same number of collectives
on every process group (a collective nanwatch issued of its own would be one more). The FSDP runs go under
`TORCH_DISTRIBUTED_DEBUG=DETAIL`, which checks every collective's shape across ranks; the DDP run under INFO, since
torch 2.13's DDP constructor crashes (SIGSEGV, in its logger) under DETAIL on gloo, with or without nanwatch.

Before the guard read FSDP2 gradients through their local shards at every step, the FSDP2 twins issued 16 more
collectives than their unwatched twins (its reduction of the DTensor gradients), and a run whose ranks took different
paths through it crashed with gloo's "collective mismatch".
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).parents[1] / "adapters" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torchrun_launch import run_torchrun  # noqa: E402
from twin_run import ACCUMULATION, MICRO_BATCHES, MODES  # noqa: E402

pytestmark = pytest.mark.multiprocess

LAUNCHES = {"ddp": ("INFO", ["ddp"]), "fsdp": ("DETAIL", ["fsdp1", "fsdp2", "fsdp2-mixed"])}
CASES = [(launch, stack, mode) for launch, (_, stacks) in LAUNCHES.items() for stack in stacks for mode in MODES]


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each launch's per-rank results, by launch."""
    found: dict[str, list[dict[str, Any]]] = {}
    for launch, (debug, stacks) in LAUNCHES.items():
        out = tmp_path_factory.mktemp(f"twins-{launch}")
        before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug  # read by run_torchrun's child processes
        try:
            result = run_torchrun("twin_run.py", "--out", str(out), "--stacks", *stacks, timeout=240)
        finally:
            if before is None:
                del os.environ["TORCH_DISTRIBUTED_DEBUG"]
            else:
                os.environ["TORCH_DISTRIBUTED_DEBUG"] = before
        assert result.returncode == 0, result.stderr[-4000:]
        found[launch] = [json.loads((out / f"twins-rank{rank}.json").read_text()) for rank in (0, 1)]
    return found


@pytest.mark.parametrize(("launch", "stack", "mode"), CASES, ids=[f"{stack}-{mode}" for _, stack, mode in CASES])
def test_a_watched_healthy_run_ends_bit_identical_to_its_unwatched_twin(
    twins: dict[str, list[dict[str, Any]]], launch: str, stack: str, mode: str
) -> None:
    for rank, results in enumerate(twins[launch]):
        unwatched, watched = results[f"{stack}/{mode}"]["unwatched"], results[f"{stack}/{mode}"]["watched"]
        assert unwatched["error"] is None, f"rank {rank}: the unwatched twin failed:\n{unwatched['error']}"
        assert watched["error"] is None, f"rank {rank}: the watched twin failed:\n{watched['error']}"
        assert watched["steps"] == unwatched["steps"] == MICRO_BATCHES // ACCUMULATION, f"rank {rank}"
        assert watched["collectives"] == unwatched["collectives"], f"rank {rank}: nanwatch issued collectives"
        assert watched["watching"]["disabled_reason"] is None, f"rank {rank}: watching stopped"
        if mode != "sentinel":  # full mode's ring holds the last frames recorded
            assert watched["watching"]["frames"] > 0, f"rank {rank}: nothing recorded"
        for part in ("weights", "optimizer", "torch_rng", "python_rng", "numpy_rng"):
            assert watched["digest"][part] == unwatched["digest"][part], f"rank {rank}: the {part} differ"
