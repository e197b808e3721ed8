"""The guard and sentinel mode on all four adapters (plain loop, Lightning, Accelerate, HF Trainer), through the same
harnesses as test_conformance.py: a functional loss that overflows stops the run before the step that would apply it
(in both modes); in sentinel mode the failing micro-batch is replayed and its report holds, value for value, the
frames full mode records for it; a fault that fires once is not reproduced, and the report says so; gradient
accumulation, evaluation and a nan on rank 1 only under 2-process DDP.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tests.adapters import test_conformance as conformance
from tests.adapters.conformance.common import Scenario, report_dir, same_weights
from tests.adapters.test_conformance import K, _detection, _report, _run_two_ranks

# The same warnings filters and per-adapter harness fixture as test_conformance.py.
pytestmark = conformance.pytestmark
harness = conformance.harness

REPLAYED = "reproduced by replaying micro-batch"


def _json_report(workdir: Path, batch: int) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(_report(workdir, f"nanwatch-report-rank0-batch{batch}.json"))
    return report


def _frames_of(report: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    return [frame for frame in report["frames"] if frame["batch_number"] == batch]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_functional_loss_that_overflows_stops_the_run_before_the_step(
    harness: ModuleType, mode: str, tmp_path: Path
) -> None:
    # `F.mse_loss(logits * 1e30, labels)` at micro-batch K: the model's output is finite, the loss alone is inf.
    outcome = harness.run(Scenario(loss_inf_at=K, mode=mode), tmp_path)

    error = _detection(outcome)
    assert (error.batch_number, error.rank, error.phase) == (K, 0, "train")
    assert outcome.steps_done == K, "the step that applies the inf loss's gradients ran"
    assert not same_weights(outcome.weights[K], outcome.weights[0])
    assert outcome.final_weights_are_after_step(K)
    assert outcome.hooks_left == 0, "hooks left on the model or its optimizer"
    # Where the framework hands the loss over (Lightning, Accelerate), it is named; the plain loop and the HF
    # Trainer's compute_loss_func tell nanwatch nothing, and the gradients about to be applied stop the step.
    if harness.NAME in ("lightning", "accelerate"):
        assert error.module_name == "(loss)", error.report
    else:
        assert "non-finite gradients about to be applied" in error.report, error.report


def test_sentinel_replays_the_micro_batch_and_reports_what_full_mode_records(
    harness: ModuleType, tmp_path: Path
) -> None:
    full = harness.run(Scenario(inf_at=K), tmp_path / "full")
    sentinel = harness.run(Scenario(inf_at=K, mode="sentinel"), tmp_path / "sentinel")

    for outcome in (full, sentinel):
        error = _detection(outcome)
        assert (error.batch_number, error.rank, error.module_name) == (K, 0, harness.FAULT_NAME), error.report
        assert outcome.steps_done == K
        assert outcome.final_weights_are_after_step(K)
        assert outcome.fault.count == K + 1, "the replay left the fault's buffer changed"
        assert outcome.hooks_left == 0, "hooks left on the model or its optimizer"
    error = _detection(sentinel)
    assert REPLAYED in error.report, error.report
    assert "the sentinel saw inf/nan in" in error.report
    assert error.culprit is not None
    assert error.culprit.module_name == harness.FAULT_NAME
    # The replay's frames of micro-batch K are the frames full mode recorded for it, value for value.
    full_frames = _frames_of(_json_report(tmp_path / "full", K), K)
    replayed = _frames_of(_json_report(tmp_path / "sentinel", K), K)
    assert replayed == full_frames
    assert len(replayed) == 3  # block.linear, block.act, block.fault


def test_sentinel_with_a_fused_optimizer_refuses_the_step_on_the_device(harness: ModuleType, tmp_path: Path) -> None:
    """The fused optimizer is handed the check as its `found_inf`: the step of micro-batch K runs and applies
    nothing, the verdict is read as the next step is about to run, and the error names K, as of its own step."""
    outcome = harness.run(Scenario(inf_at=K, mode="sentinel", fused=True), tmp_path)

    error = _detection(outcome)
    assert (error.batch_number, error.rank, error.module_name) == (K, 0, harness.FAULT_NAME), error.report
    assert REPLAYED in error.report, error.report
    assert "the step did not run" in error.report or "the sentinel saw inf/nan in" in error.report
    assert outcome.steps_done == K + 1  # the fused step was called, told by found_inf to apply nothing
    assert same_weights(outcome.weights[K + 1], outcome.weights[K])
    assert outcome.final_weights_are_after_step(K)
    assert outcome.fault.count == K + 2  # micro-batch K + 1 ran its forward before the verdict was read
    assert outcome.hooks_left == 0, "hooks left on the model or its optimizer"


def test_sentinel_with_gradient_accumulation(harness: ModuleType, tmp_path: Path) -> None:
    # Two micro-batches per step: micro-batches 2 and 3 make step 1, which never runs.
    outcome = harness.run(Scenario(inf_at=3, accumulation=2, mode="sentinel"), tmp_path)

    error = _detection(outcome)
    assert (error.batch_number, error.module_name) == (3, harness.FAULT_NAME)
    assert f"{REPLAYED} 3 " in error.report, error.report
    assert outcome.steps_done == 1
    assert outcome.final_weights_are_after_step(1)
    assert outcome.hooks_left == 0


def test_a_fault_that_fires_once_is_not_reproduced_and_the_report_says_so(harness: ModuleType, tmp_path: Path) -> None:
    outcome = harness.run(Scenario(inf_at=K, mode="sentinel", fault_once=True), tmp_path)

    error = _detection(outcome)
    assert error.batch_number == K
    assert outcome.fault.fired == 1, "the fault fired again in the replay"
    assert "not reproduced" in error.report
    assert "the sentinel saw inf/nan in output.logits of the model" in error.report
    assert error.module_name is None  # no frame of any module holds it
    # Replayed twice, everything restored, the same bits both times: a fault of that run, not the computation.
    assert "the same bits both times" in error.report
    assert "transient fault" in error.report
    assert "non-deterministic kernel" not in error.report
    assert error.replay == "not_reproduced"
    assert outcome.steps_done == K
    assert outcome.final_weights_are_after_step(K)
    saved = _json_report(tmp_path, K)
    assert saved["replay"]["reproduced"] is False
    assert saved["replay"]["cause"] == "transient_fault"


def test_sentinel_checks_eval_forwards_without_replaying_them(harness: ModuleType, tmp_path: Path) -> None:
    outcome = harness.run(Scenario(eval_inf_at=1, evaluate=True, watch_eval=True, mode="sentinel"), tmp_path)

    error = _detection(outcome)
    assert (error.phase, error.batch_number) == ("eval", 1)
    assert "an evaluation forward is checked, not replayed" in error.report
    assert outcome.fault.eval_count == 2, "the run went on past the bad eval forward"
    assert outcome.hooks_left == 0


@pytest.mark.multiprocess
def test_sentinel_rank_1_only_under_two_process_ddp(harness: ModuleType, tmp_path: Path) -> None:
    code, log = _run_two_ranks(harness.NAME, Scenario(inf_at=K, inf_rank=1, mode="sentinel"), tmp_path)

    assert code == 0, log[-4000:]
    records = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]
    for rank, record in enumerate(records):
        error = record["error"]
        assert error is not None, f"rank {rank} ended without an error"
        assert error["type"] == "NonFiniteError", f"rank {rank} ended with {error}"
        assert (error["batch_number"], error["rank"], error["phase"]) == (K, 1, "train"), error
        assert record["steps_done"] == K, f"rank {rank}"
        assert record["final_weights_are_after_last_step"], f"rank {rank}"
        assert record["finite"], f"rank {rank}"
        assert record["hooks_left"] == 0, f"rank {rank}"
    assert records[1]["error"]["module_name"] == harness.FAULT_NAME  # the replay ran on rank 1, where it was seen
    written = sorted(path.name for path in report_dir(tmp_path).iterdir())
    report = (report_dir(tmp_path) / f"nanwatch-report-rank1-batch{K}.txt").read_text(encoding="utf-8")
    assert REPLAYED in report, report
    # Rank 1's report, and the capsule of the culprit's call its replay captured.
    assert all(
        name.startswith((f"nanwatch-report-rank1-batch{K}.", f"nanwatch-capsule-rank1-batch{K}.")) for name in written
    ), written
