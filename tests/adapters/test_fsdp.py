"""`nanwatch.watch()` on models sharded by FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel`), blocks under
`checkpoint_wrapper`: two real processes under torchrun (gloo, CPU), one launch for both (scripts/fsdp_run.py).

Before: under FSDP2 a clean run died at the first step with a gloo "collective mismatch" (nanwatch reduced sharded
DTensor parameters, whose reads are collectives, and read them on rank 0 only for headroom), or nanwatch disabled
itself (`.tolist()` on a DTensor) and missed the nan; under FSDP1 modules were named `_fsdp_wrapped_module.0`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torchrun_launch import run_torchrun  # noqa: E402

pytestmark = pytest.mark.multiprocess

VERSIONS = pytest.mark.parametrize("version", [2, 1], ids=["fsdp2", "fsdp1"])
MODULES = {"", "inp", "blocks.0", "blocks.0.fc", "blocks.0.act", "blocks.1", "blocks.1.fc", "blocks.1.act"}
MODULES |= {"blowup", "out"}
# How each module's parameters are shown: FSDP2 keeps them as they are; FSDP1 (use_orig_params=False, its default)
# flattens those of each wrapped unit into one `_flat_param`, shown whole (weight and bias: 8*4 + 8 values for inp).
PARAMETERS = {
    2: {"inp/weight": [8, 4], "inp/bias": [8], "blocks.0.fc/weight": [8, 8], "out/weight": [1, 8], "out/bias": [1]},
    1: {"inp/_flat_param": [40], "blocks.0.fc/_flat_param": [72], "out/_flat_param": [9]},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], str]:
    out = tmp_path_factory.mktemp("fsdp")
    result = run_torchrun("fsdp_run.py", "--out", str(out), "--fsdp", "2", "1", timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    outcomes = [json.loads((out / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    return out, outcomes, result.stderr


def _clean(runs: tuple[Path, list[dict[str, Any]], str], version: int) -> list[dict[str, Any]]:
    return [outcome[f"fsdp{version}"]["clean"] for outcome in runs[1]]


@VERSIONS
def test_a_clean_run_trains_through_with_headroom_and_tracing_on_rank_0(runs: Any, version: int) -> None:
    for rank, clean in enumerate(_clean(runs, version)):
        assert (clean["ran"], clean["steps_done"], clean["error"]) == (6, 3, None), f"rank {rank}"
        assert clean["disabled_reason"] is None
        assert clean["warnings"] == []
        assert clean["hooks_left"] == 0
    written = {path.name for path in (runs[0] / f"fsdp{version}" / "clean-reports").iterdir()}
    assert written == {"nanwatch-trace-rank0.txt", "nanwatch-trace-rank0.jsonl"}  # traced on rank 0, no report


@VERSIONS
def test_modules_keep_their_own_names_and_each_call_is_one_frame(runs: Any, version: int) -> None:
    for clean in _clean(runs, version):
        frames = clean["forward"]
        assert {name for _, name, _ in frames} == MODULES  # no _fsdp_wrapped_module., no _checkpoint_wrapped_module.
        classes = {kind for _, _, kind in frames}
        assert classes == {"Net", "Linear", "Block", "ReLU", "Blowup"}  # no wrapper frame, no FSDPLinear
        # One frame per module and batch: the blocks' recompute during backward adds none.
        assert Counter((batch, name) for batch, name, _ in frames) == {
            (batch, name): 1 for batch in range(6) for name in MODULES
        }
        assert clean["backward"] > 0


@VERSIONS
def test_parameters_are_measured_whole_and_alike_on_every_rank(runs: Any, version: int) -> None:
    ranks = _clean(runs, version)
    # Gathered parameters are the same on both ranks; shards would differ (and be half the size, or empty).
    assert ranks[0]["parameters"] == ranks[1]["parameters"]
    shapes = {key: value[0] for key, value in ranks[0]["parameters"].items()}
    assert PARAMETERS[version].items() <= shapes.items()


@VERSIONS
def test_a_sharded_parameter_read_on_one_rank_alone_is_its_local_shard(runs: Any, version: int) -> None:
    # Between forwards the parameters are sharded (DTensors under FSDP2): measured, then read on rank 0 only.
    for rank, clean in enumerate(_clean(runs, version)):
        for name, _, measured, local, non_finite in clean["shards_measured"]:
            assert measured == local, f"rank {rank} {name}"
            assert non_finite is (False if rank == 0 else None)
        if version == 2:  # out.weight (1, 8) and out.bias (1,), sharded on dim 0: all on rank 0, none on rank 1
            empty = {name for name, numel, *_ in clean["shards_measured"] if numel == 0}
            assert empty == (set() if rank == 0 else {"out.weight", "out.bias"})


@VERSIONS
def test_a_nan_on_rank_1_at_micro_batch_3_stops_every_rank_before_the_step(runs: Any, version: int) -> None:
    out, outcomes, stderr = runs
    for rank, outcome in enumerate(outcomes):
        bad = outcome[f"fsdp{version}"]["bad"]
        assert bad["error"] is not None, f"rank {rank} did not stop"
        assert (bad["error"]["batch_number"], bad["error"]["rank"]) == (3, 1)
        assert bad["error"]["optimizer_step"] == 1
        assert bad["error"]["module_name"] == ("blowup" if rank == 1 else None)
        assert (bad["ran"], bad["steps_done"]) == (3, 1)
        assert bad["weights_unchanged"], f"the failed step changed rank {rank}'s weights"
        assert (bad["hooks_left"], bad["optimizer_hooks_left"]) == (0, 0)
    reports = out / f"fsdp{version}" / "reports"
    assert {path.name for path in reports.iterdir()} == {
        f"nanwatch-report-rank1-batch3.{suffix}" for suffix in ("txt", "json", "jsonl")
    }
    text = (reports / "nanwatch-report-rank1-batch3.txt").read_text(encoding="utf-8")
    assert text.startswith("Detected inf/nan during batch_number=3 on rank 1\n")
    assert "_wrapped_module" not in text
    assert "Detected inf/nan during batch_number=3 on rank 1" in stderr


@VERSIONS
def test_sentinel_mode_stops_every_rank_and_does_not_replay_a_sharded_model(runs: Any, version: int) -> None:
    # A replay on the detecting rank alone would gather the sharded parameters through collectives no other rank
    # runs: sentinel mode stops the run as full mode does and says why the micro-batch was not replayed.
    out, outcomes, _ = runs
    for rank, outcome in enumerate(outcomes):
        bad = outcome[f"fsdp{version}"]["sentinel"]
        assert bad["error"] is not None, f"rank {rank} did not stop"
        assert (bad["error"]["batch_number"], bad["error"]["rank"]) == (3, 1)
        assert (bad["ran"], bad["steps_done"]) == (3, 1)
        assert bad["weights_unchanged"], f"the failed step changed rank {rank}'s weights"
        assert (bad["hooks_left"], bad["optimizer_hooks_left"]) == (0, 0)
    text = (out / f"fsdp{version}" / "sentinel-reports" / "nanwatch-report-rank1-batch3.txt").read_text("utf-8")
    assert "the sentinel saw inf/nan in output.logits of the model" in text
    assert "not replayed: the model's parameters are sharded (FSDP)" in text
