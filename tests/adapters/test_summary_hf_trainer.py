"""Summary mode and scope with a real transformers `Trainer`: the abs max per module joins the Trainer's logs."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from transformers import TrainerCallback  # noqa: E402

from nanwatch.adapters.hf_trainer import OverflowTrainerCallback  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from blowup_models import hook_count  # noqa: E402
from hf_trainer_run import build, train  # noqa: E402
from torchrun_launch import run_torchrun  # noqa: E402

MODULE_KEYS = {f"nanwatch/absmax/{name}" for name in ("inp", "act", "blowup", "out", "(root)")}


class LogsSeen(TrainerCallback):
    """A callback placed after nanwatch's: what a reporting integration there would receive in `on_log`."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs or {}))


def summaries(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in history if "nanwatch/batch_number" in entry]


def test_the_summary_joins_log_history_and_the_logs_later_callbacks_see(tmp_path: Path) -> None:
    # Gradient accumulation 2, 6 optimizer steps, no logging of the Trainer's own: a summary every 4 micro-batches
    # makes it log at the end of steps 2, 4 and 6.
    callback = OverflowTrainerCallback(summary_every_n_batches=4)
    seen = LogsSeen()
    trainer, model = build(tmp_path, inject_at=None, callbacks=[callback, seen])
    trainer.train()

    entries = summaries(trainer.state.log_history)
    assert [(entry["step"], entry["nanwatch/batch_number"]) for entry in entries] == [(2, 3.0), (4, 7.0), (6, 11.0)]
    for entry in entries:
        assert set(entry) >= MODULE_KEYS
        assert "loss" in entry  # the Trainer's own log event, which the summary joined
        assert entry["nanwatch/absmax_global"] == max(entry[key] for key in MODULE_KEYS)
    assert summaries(seen.logs) == [{k: v for k, v in entry.items() if k != "step"} for entry in entries]
    assert hook_count(model) == 0


def test_with_the_trainers_own_logging_every_step_the_summary_joins_its_interval(tmp_path: Path) -> None:
    callback = OverflowTrainerCallback(summary_every_n_batches=6)
    trainer, _ = build(
        tmp_path, inject_at=None, callbacks=[callback], training_args={"logging_strategy": "steps", "logging_steps": 1}
    )
    trainer.train()
    losses = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses == [1, 2, 3, 4, 5, 6]
    assert [(entry["step"], entry["nanwatch/batch_number"]) for entry in summaries(trainer.state.log_history)] == [
        (3, 5.0),
        (6, 11.0),
    ]


def test_watching_every_other_micro_batch_misses_an_inf_there_and_says_so(
    tmp_path: Path, nanwatch_log: pytest.LogCaptureFixture
) -> None:
    # Micro-batch 3 (unwatched, the last of step 1) goes inf: no frame of it is recorded, but the guard reads the
    # gradients before every step, watched or not, so step 1 never runs; the log says which batches went unwatched.
    outcome = train(tmp_path, inject_at=3, config={"watch_every_n_batches": 2})
    error = outcome.error
    assert error is not None
    assert error.batch_number == 3
    assert error.module_name == "inp"  # the first parameter whose gradient is not finite
    assert "non-finite gradients about to be applied by optimizer step 1: inp.weight" in error.report
    warnings = [r.getMessage() for r in nanwatch_log.records if r.levelno == logging.WARNING]
    assert any("batch_number=3 up to this one were not watched" in message for message in warnings)
    assert hook_count(outcome.model) == 0


@pytest.mark.multiprocess
def test_two_ranks_log_the_summary_at_the_same_steps_without_hanging(tmp_path: Path) -> None:
    # The Trainer gathers the loss across ranks whenever it logs: a summary asked for on one rank only would hang.
    result = run_torchrun("summary_hf_ddp_run.py", "--out", str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads((tmp_path / f"summaries-rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, record in enumerate(records):
        assert (record["rank"], record["world_size"]) == (rank, 2)
        steps = [(entry["step"], entry["nanwatch/batch_number"]) for entry in record["entries"]]
        assert steps == [(1, 1.0), (2, 3.0), (3, 5.0), (4, 7.0)]
        assert all(set(entry) >= MODULE_KEYS for entry in record["entries"])
