"""`OverflowTrainerCallback` in real transformers `Trainer` runs on the CPU: one process, then two under torchrun."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from transformers import TrainerCallback  # noqa: E402

from nanwatch import BatchLimitReached, ConfigError, WatchConfig  # noqa: E402
from nanwatch.adapters.hf_trainer import OverflowTrainerCallback  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from blowup_models import hook_count  # noqa: E402
from hf_trainer_run import build, train  # noqa: E402
from torchrun_launch import failed_workers, run_torchrun  # noqa: E402


@pytest.mark.parametrize(
    ("inject_at", "step_that_never_ran"),
    [
        (3, 1),  # the last micro-batch of step 1: caught in on_pre_optimizer_step
        (4, 2),  # the first micro-batch of step 2: caught in on_substep_end
    ],
)
def test_stops_before_the_step_that_would_apply_the_bad_micro_batch(
    tmp_path: Path, inject_at: int, step_that_never_ran: int
) -> None:
    outcome = train(tmp_path / "out", inject_at=inject_at, config={"report_dir": tmp_path / "reports"})

    error = outcome.error
    assert error is not None
    assert error.batch_number == inject_at
    assert error.optimizer_step == step_that_never_ran
    assert error.epoch == 0
    assert error.rank == 0
    assert error.module_name == "blowup"
    assert error.report.startswith(f"Detected inf/nan during batch_number={inject_at}\n")
    assert outcome.steps_done == step_that_never_ran
    assert outcome.weights_unchanged, "the failed step changed the weights"
    assert hook_count(outcome.model) == 0
    assert outcome.callback.watcher is None
    written = (tmp_path / "reports" / f"nanwatch-report-rank0-batch{inject_at}.txt").read_text(encoding="utf-8")
    assert written.rstrip("\n") == error.report


def test_evaluation_is_neither_counted_nor_watched_by_default(tmp_path: Path) -> None:
    # An evaluation after every optimizer step, whose first forward holds inf: ignored; training's inf is caught.
    outcome = train(tmp_path, inject_at=3, inject_eval_at=0, eval_steps=1)

    assert outcome.error is not None
    assert outcome.error.phase == "train"
    assert outcome.error.batch_number == 3
    assert hook_count(outcome.model) == 0


def test_watch_eval_checks_each_evaluation_batch(tmp_path: Path) -> None:
    outcome = train(tmp_path, inject_at=None, inject_eval_at=1, eval_steps=1, config={"watch_eval": True})

    error = outcome.error
    assert error is not None
    assert error.phase == "eval"
    assert error.batch_number == 1  # eval_batch_number: evaluation batches are counted apart
    assert error.optimizer_step == 1  # the first evaluation runs after the first optimizer step
    assert error.module_name == "blowup"
    assert hook_count(outcome.model) == 0


def test_a_clean_run_leaves_no_hooks(tmp_path: Path) -> None:
    outcome = train(tmp_path, inject_at=None, max_steps=3)

    assert outcome.error is None
    assert outcome.steps_done == 3
    assert hook_count(outcome.model) == 0


def test_trace_batch_nums_count_micro_batches(tmp_path: Path) -> None:
    outcome = train(tmp_path, inject_at=None, max_steps=2, config={"trace_batch_nums": [1], "report_dir": tmp_path})

    assert outcome.error is None
    trace = (tmp_path / "nanwatch-trace-rank0.txt").read_text(encoding="utf-8")
    assert trace.count("*** Starting batch number=") == 1
    assert "*** Starting batch number=1 ***" in trace
    assert trace.count("blowup Blowup") == 1  # one micro-batch: each module once


def test_abort_after_batch_num_stops_after_that_micro_batch(tmp_path: Path) -> None:
    callback = OverflowTrainerCallback(abort_after_batch_num=2)
    trainer, model = build(tmp_path, inject_at=None, callbacks=[callback])

    with pytest.raises(BatchLimitReached) as caught:
        trainer.train()

    assert caught.value.batch_number == 2
    assert model.blowup.count == 3  # micro-batches 0, 1 and 2 ran
    assert hook_count(model) == 0


class _Crash(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        raise RuntimeError("the user's own failure")


def test_after_a_foreign_exception_the_next_train_removes_the_stale_hooks(tmp_path: Path) -> None:
    callback = OverflowTrainerCallback()
    trainer, crashed_model = build(tmp_path / "first", inject_at=None, callbacks=[callback, _Crash()])
    with pytest.raises(RuntimeError, match="the user's own failure"):
        trainer.train()
    assert hook_count(crashed_model) > 0  # the Trainer tells callbacks nothing about an exception

    outcome = train(tmp_path / "second", callback=callback, inject_at=1)

    assert hook_count(crashed_model) == 0
    assert outcome.error is not None
    assert outcome.error.batch_number == 1  # counting starts afresh with a new train()
    assert hook_count(outcome.model) == 0


def test_close_removes_the_hooks_left_by_a_foreign_exception(tmp_path: Path) -> None:
    callback = OverflowTrainerCallback()
    trainer, model = build(tmp_path, inject_at=None, callbacks=[callback, _Crash()])
    with pytest.raises(RuntimeError, match="the user's own failure"):
        trainer.train()

    callback.close()
    callback.close()

    assert hook_count(model) == 0


def test_resume_from_a_checkpoint_keeps_counting_micro_batches(tmp_path: Path) -> None:
    # 64 samples / batch 4 = 16 micro-batches per epoch = 8 optimizer steps. Stop at step 10 (epoch 1), resume.
    first = train(tmp_path, inject_at=None, max_steps=10, training_args={"save_strategy": "steps", "save_steps": 10})
    assert first.error is None

    # The new model's Blowup counts from 0: its forward 1 is micro-batch 16 + 2 * 2 + 1 = 21 of the whole run.
    resumed = train(tmp_path, inject_at=1, max_steps=14, resume_from_checkpoint=str(tmp_path / "checkpoint-10"))

    assert resumed.error is not None
    assert resumed.error.batch_number == 21
    assert resumed.error.optimizer_step == 10
    assert resumed.error.epoch == 1


def test_config_from_a_file_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "nanwatch.yaml"
    path.write_text("max_frames_to_save: 5\nwatch_eval: true\n", encoding="utf-8")

    callback = OverflowTrainerCallback(path, max_frames_to_save=7)

    assert callback.config == WatchConfig(max_frames_to_save=7, watch_eval=True)


def test_a_bad_override_names_the_field() -> None:
    with pytest.raises(ConfigError, match="max_frames"):
        OverflowTrainerCallback(max_frames=3)


@pytest.mark.slow
def test_without_transformers_constructing_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "import nanwatch\n"
        "print('transformers' in sys.modules)\n"
        "sys.modules['transformers'] = None\n"  # makes `import transformers` fail as if it were not installed
        "from nanwatch.adapters.hf_trainer import OverflowTrainerCallback\n"
        "try:\n"
        "    OverflowTrainerCallback()\n"
        "except ImportError as error:\n"
        "    print(type(error.__cause__).__name__)\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)

    imported_by_nanwatch, cause, message = result.stdout.splitlines()
    assert imported_by_nanwatch == "False"
    assert cause in {"ImportError", "ModuleNotFoundError"}
    assert "OverflowTrainerCallback" in message
    assert "transformers" in message
    assert 'pip install "nanwatch[transformers]"' in message


@pytest.mark.multiprocess
def test_two_processes_under_torchrun_stop_together(tmp_path: Path) -> None:
    result = run_torchrun("hf_trainer_run.py", "--out", str(tmp_path), "--inject-at", "3", "--inject-rank", "1")
    finished = time.time()

    assert result.returncode != 0, result.stderr[-3000:]
    exit_codes = failed_workers(result.stderr)
    assert set(exit_codes) == {0, 1}, result.stderr[-3000:]
    assert all(code != 0 for code in exit_codes.values())
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, outcome in enumerate(outcomes):
        assert outcome["world_size"] == 2
        # Each rank raised NonFiniteError itself (it wrote this file, then let the error end the process).
        assert outcome["error"] is not None, f"rank {rank} did not stop"
        assert outcome["error"]["batch_number"] == 3
        assert outcome["error"]["rank"] == 1
        assert outcome["error"]["optimizer_step"] == 1
        assert outcome["weights_unchanged"], f"the failed step changed rank {rank}'s weights"
        assert outcome["steps_done"] == 1
        assert outcome["hooks_left"] == 0
        assert finished - outcome["detected_at"] < 60
    assert "on rank 1, first in module 'blowup'" in outcomes[1]["error"]["message"]
    assert outcomes[0]["error"]["module_name"] is None  # rank 0 saw nothing: it only learned of rank 1's detection
    report = (tmp_path / "reports" / "nanwatch-report-rank1-batch3.txt").read_text(encoding="utf-8")
    assert report.startswith("Detected inf/nan during batch_number=3 on rank 1\n")
    assert not list((tmp_path / "reports").glob("*rank0*"))
    assert "Detected inf/nan during batch_number=3 on rank 1" in result.stderr


@pytest.mark.slow
def test_the_example_overflows_in_float16_and_shows_the_report(tmp_path: Path) -> None:
    config = tmp_path / "nanwatch.yaml"
    config.write_text(f"max_frames_to_save: 6\nreport_dir: {tmp_path / 'reports'}\n", encoding="utf-8")
    example = SCRIPTS.parents[2] / "examples" / "hf_trainer.py"

    result = subprocess.run(
        [sys.executable, str(example), "--config", str(config)], capture_output=True, text=True, timeout=120
    )

    assert result.returncode == 1, result.stderr[-3000:]  # the example exits 1 when nanwatch stopped it
    stopped = re.search(
        r"stopped: inf/nan in batch_number=(\d+) \(epoch 0\), first in module '([\w.]+)'", result.stdout
    )
    assert stopped is not None, result.stdout
    batch, module = stopped.groups()
    assert "weights still finite: True" in result.stdout
    assert f"Detected inf/nan during batch_number={batch}\nLast 6 forward frames:\n" in result.stderr
    report = (tmp_path / "reports" / f"nanwatch-report-rank0-batch{batch}.txt").read_text(encoding="utf-8")
    assert re.search(rf"^ +{re.escape(module)} \w+$", report, re.MULTILINE)  # the culprit's frame
    # The frames end at the culprit's inf output; after a blank line, the line naming the module that made it.
    frames, trailing = report.rstrip().split("\n\n")
    assert frames.endswith(" inf output")
    # After a blank line: the cause (the example overflows float16's range), the capsule written for it, then the
    # culprit.
    cause, capsule, culprit = trailing.splitlines()[:3]
    assert cause.startswith("cause: precision: "), cause
    assert "float16's range overflowed" in cause
    assert capsule.startswith("repro capsule: "), capsule
    assert culprit.startswith(f"first non-finite value produced by {module} (")
