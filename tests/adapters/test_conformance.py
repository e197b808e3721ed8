"""Adapter conformance: the same scenarios on all four adapters (plain loop, Lightning, Accelerate, HF Trainer).

Each adapter has a harness in tests/adapters/conformance/ that trains the same tiny float32 model through its
framework for real, on the CPU, with a `Fault` module that adds inf (or raises the user's error) at a chosen
micro-batch, and returns an `Outcome`. Every test below is parametrized over the harnesses and asserts the same thing
on each: inf at micro-batch k; gradient accumulation; evaluation not counted; rank 1 only under 2-process DDP; resume
from a checkpoint; the user's exception passing through unchanged.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import pytest
from tests.adapters.conformance.common import EVAL_BATCHES, Outcome, Scenario, report_dir, same_weights

from nanwatch import NanwatchError, NonFiniteError

pytestmark = [
    pytest.mark.usefixtures("fresh_accelerate_state"),
    pytest.mark.filterwarnings(
        "ignore:.*does not have many workers.*",
        "ignore:.*isinstance\\(treespec, LeafSpec\\).*",
        "ignore:.*smaller than the logging interval.*",
        "ignore:.*defined a `validation_step` but have no `val_dataloader`.*",
        "ignore:.*Checkpoint directory .* exists and is not empty.*",
    ),
]

REPO = Path(__file__).resolve().parents[2]
CONFORMANCE = Path(__file__).parent / "conformance"
ADAPTERS = ["plain", "lightning", "accelerate", "hf_trainer"]
K = 3  # the micro-batch that goes bad
DDP_TIMEOUT_S = 120


@pytest.fixture(params=ADAPTERS)
def harness(request: pytest.FixtureRequest) -> ModuleType:
    return importlib.import_module(f"tests.adapters.conformance.{request.param}_harness")


def _detection(outcome: Outcome) -> NonFiniteError:
    assert isinstance(outcome.error, NonFiniteError), f"expected NonFiniteError, the run ended with {outcome.error!r}"
    return outcome.error


def _report(workdir: Path, name: str) -> str:
    return (report_dir(workdir) / name).read_text(encoding="utf-8")


def test_inf_at_micro_batch_k_stops_before_the_step_that_would_apply_it(harness: ModuleType, tmp_path: Path) -> None:
    outcome = harness.run(Scenario(inf_at=K), tmp_path)

    error = _detection(outcome)
    assert (error.batch_number, error.rank, error.module_name, error.phase) == (K, 0, harness.FAULT_NAME, "train")
    assert error.optimizer_step == K  # one micro-batch per step: steps 0 .. K-1 ran
    assert outcome.counters["batch_number"] == K
    assert outcome.fault.count == K + 1, "the run went on past the bad micro-batch"
    assert f"nanwatch-report-rank0-batch{K}.txt" in outcome.reports
    assert _report(tmp_path, f"nanwatch-report-rank0-batch{K}.txt").rstrip("\n") == error.report
    # The steps before it ran and changed the weights; the step that would have applied micro-batch K never ran.
    assert outcome.steps_done == K
    assert not same_weights(outcome.weights[K], outcome.weights[0])
    assert outcome.final_weights_are_after_step(K)
    assert outcome.hooks_left == 0, "hooks left on the model or its optimizer"


def test_gradient_accumulation_counts_every_micro_batch(harness: ModuleType, tmp_path: Path) -> None:
    # Two micro-batches per optimizer step: micro-batches 2 and 3 make step 1, which never runs.
    outcome = harness.run(Scenario(inf_at=3, accumulation=2), tmp_path)

    error = _detection(outcome)
    assert (error.batch_number, error.rank, error.module_name) == (3, 0, harness.FAULT_NAME)
    assert error.optimizer_step == 1
    assert outcome.counters["batch_number"] == 3
    assert outcome.fault.count == 4, "the run went on past the bad micro-batch"
    assert "nanwatch-report-rank0-batch3.txt" in outcome.reports
    assert outcome.steps_done == 1
    assert not same_weights(outcome.weights[1], outcome.weights[0])
    assert outcome.final_weights_are_after_step(1)
    assert outcome.hooks_left == 0, "hooks left on the model or its optimizer"


def test_evaluation_is_not_counted_and_watched_only_when_asked(harness: ModuleType, tmp_path: Path) -> None:
    # An evaluation (EVAL_BATCHES forwards) after every optimizer step; the very first eval forward holds inf.
    default = harness.run(Scenario(inf_at=K, eval_inf_at=0, evaluate=True), tmp_path / "default")

    error = _detection(default)
    assert default.fault.eval_hits == 1, "the eval forward was not given inf"
    assert default.fault.eval_count == K * EVAL_BATCHES  # an evaluation after each of the K steps that ran
    # Neither stopped by the eval inf nor shifted by the eval forwards: training's own inf, at its own number.
    assert (error.phase, error.batch_number, error.module_name) == ("train", K, harness.FAULT_NAME)
    assert default.counters["eval_batch_number"] == 0
    # The training detection's report, and the repro capsule of its culprit's call (block.fault's, captured by the
    # cause's rerun); nothing of the eval forward's.
    assert default.reports == [
        f"nanwatch-capsule-rank0-batch{K}.pt",
        *(f"nanwatch-report-rank0-batch{K}.{suffix}" for suffix in ("json", "jsonl", "txt")),
    ]
    assert error.capsule == str(report_dir(tmp_path / "default") / f"nanwatch-capsule-rank0-batch{K}.pt")
    frames = json.loads(_report(tmp_path / "default", f"nanwatch-report-rank0-batch{K}.json"))["frames"]
    assert {frame["phase"] for frame in frames} == {"train"}, "eval forwards were recorded"
    assert default.steps_done == K
    assert default.final_weights_are_after_step(K)
    assert default.hooks_left == 0, "hooks left on the model or its optimizer"

    watched = harness.run(Scenario(eval_inf_at=1, evaluate=True, watch_eval=True), tmp_path / "watched")

    error = _detection(watched)
    assert (error.phase, error.batch_number, error.rank) == ("eval", 1, 0)  # batch_number: eval_batch_number
    assert error.module_name == harness.FAULT_NAME
    assert watched.fault.eval_count == 2, "the run went on past the bad eval forward"
    report = _report(tmp_path / "watched", "nanwatch-report-eval-rank0-batch1.txt")
    assert report.startswith("Detected inf/nan during eval_batch_number=1\n")
    assert report.rstrip("\n") == error.report
    assert watched.hooks_left == 0, "hooks left on the model or its optimizer"


def _run_two_ranks(adapter: str, scenario: Scenario, out: Path) -> tuple[int, str]:
    """torchrun with 2 CPU processes in a session of their own, killed whole if it outlives DDP_TIMEOUT_S."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(CONFORMANCE / "ddp_rank.py"),
        adapter,
        json.dumps(asdict(scenario)),
        str(out),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    log = out / "torchrun.log"
    with log.open("w", encoding="utf-8") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        try:
            code = process.wait(timeout=DDP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"{adapter}: still running after {DDP_TIMEOUT_S} s:\n{log.read_text(encoding='utf-8')[-4000:]}")
    return code, log.read_text(encoding="utf-8")


@pytest.mark.multiprocess
def test_rank_1_only_under_two_process_ddp(harness: ModuleType, tmp_path: Path) -> None:
    code, log = _run_two_ranks(harness.NAME, Scenario(inf_at=K, inf_rank=1), tmp_path)

    assert code == 0, log[-4000:]  # both ranks ended and wrote their record
    records = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]
    for rank, record in enumerate(records):
        assert (record["rank"], record["world_size"]) == (rank, 2)
        error = record["error"]
        assert error is not None, f"rank {rank} ended without an error"
        assert error["type"] == "NonFiniteError", f"rank {rank} ended with {error}"
        assert (error["batch_number"], error["rank"], error["phase"]) == (K, 1, "train"), error
        # No rank took the step that would have applied rank 1's micro-batch K.
        assert record["steps_done"] == K, f"rank {rank}"
        assert record["steps_changed_the_weights"], f"rank {rank}"
        assert record["final_weights_are_after_last_step"], f"rank {rank}"
        assert record["finite"], f"rank {rank}"
        assert record["hooks_left"] == 0, f"rank {rank}"
    assert records[1]["error"]["module_name"] == harness.FAULT_NAME
    assert records[0]["error"]["module_name"] is None  # rank 0 saw nothing itself
    written = sorted(path.name for path in report_dir(tmp_path).iterdir())
    # Rank 1's only: its report, and the repro capsule of its culprit's call (block.fault's, captured by the cause's
    # rerun of the micro-batch, which runs the model inside DDP and issues no collective).
    assert written == [
        f"nanwatch-capsule-rank1-batch{K}.pt",
        *(f"nanwatch-report-rank1-batch{K}.{suffix}" for suffix in ("json", "jsonl", "txt")),
    ]


def test_resume_from_a_checkpoint_keeps_counting_from_the_start(harness: ModuleType, tmp_path: Path) -> None:
    # A first run trains micro-batches 0-3 (one epoch) and checkpoints; a fresh one resumes; micro-batch 5 goes bad.
    outcome = harness.run(Scenario(inf_at=5, resume_after=4), tmp_path)

    error = _detection(outcome)
    assert (error.batch_number, error.rank, error.module_name) == (5, 0, harness.FAULT_NAME)
    assert outcome.fault.count == 6, "the resumed run did not start at micro-batch 4"
    assert outcome.counters["batch_number"] == 5
    assert "nanwatch-report-rank0-batch5.txt" in outcome.reports
    assert outcome.hooks_left == 0, "hooks left on the model or its optimizer"


def test_the_users_exception_passes_through_unchanged(harness: ModuleType, tmp_path: Path) -> None:
    outcome = harness.run(Scenario(raise_at=2), tmp_path)

    raised = outcome.fault.raised
    assert raised is not None, "the model never raised"
    error = outcome.error
    assert error is not None, "the user's exception did not reach the caller"
    reached = error if error is raised else error.__cause__  # a framework may wrap it, as it always does
    assert reached is raised, f"the caller got {error!r}"
    assert type(reached) is RuntimeError
    assert str(reached) == "user bug at batch 2"
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    assert not any(isinstance(link, NanwatchError) for link in chain), chain
    assert outcome.reports == []
    assert outcome.hooks_left == 0, "hooks left on the model or its optimizer"
