"""`nanwatch.watch(ddp_model, optimizer=opt)` in a hand-written DDP loop: two real processes under torchrun (gloo)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torchrun_launch import failed_workers, run_torchrun  # noqa: E402


@pytest.mark.multiprocess
def test_only_rank_1_sees_inf_and_both_ranks_stop_before_the_step(tmp_path: Path) -> None:
    # Gradient accumulation 2 with ddp.no_sync() on the first micro-batch of each step; micro-batch 3 is the last
    # of optimizer step 1, so nanwatch agrees and raises in the optimizer's step pre-hook.
    result = run_torchrun("plain_ddp_run.py", "--out", str(tmp_path), "--inject-at", "3", "--inject-rank", "1")
    finished = time.time()

    assert result.returncode != 0, result.stderr[-3000:]
    exit_codes = failed_workers(result.stderr)
    assert set(exit_codes) == {0, 1}, result.stderr[-3000:]
    assert all(code != 0 for code in exit_codes.values())
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, outcome in enumerate(outcomes):
        assert outcome["world_size"] == 2
        assert outcome["error"] is not None, f"rank {rank} did not stop"
        assert outcome["error"]["batch_number"] == 3
        assert outcome["error"]["rank"] == 1
        assert outcome["error"]["optimizer_step"] == 1
        assert outcome["weights_unchanged"], f"the failed step changed rank {rank}'s weights"
        assert outcome["steps_done"] == 1
        assert outcome["hooks_left"] == 0
        assert outcome["optimizer_hooks_left"] == 0
        assert finished - outcome["detected_at"] < 60
    assert outcomes[1]["error"]["module_name"] == "blowup"
    assert outcomes[0]["error"]["module_name"] is None
    assert "See that rank's report" in outcomes[0]["error"]["message"]
    reports = tmp_path / "reports"
    written = {path.name for path in reports.iterdir()}
    assert {"nanwatch-report-rank1-batch3.json", "nanwatch-report-rank1-batch3.txt"} <= written
    # Only rank 1's: its report, and the capsule of its culprit's call.
    assert all(
        name.startswith(("nanwatch-report-rank1-batch3.", "nanwatch-capsule-rank1-batch3.")) for name in written
    ), written
    text = (reports / "nanwatch-report-rank1-batch3.txt").read_text(encoding="utf-8")
    assert text.startswith("Detected inf/nan during batch_number=3 on rank 1\n")
    assert "blowup Blowup" in text
    data = json.loads((reports / "nanwatch-report-rank1-batch3.json").read_text(encoding="utf-8"))
    assert (data["rank"], data["world_size"], data["batch_number"]) == (1, 2, 3)
    assert "Detected inf/nan during batch_number=3 on rank 1" in result.stderr


@pytest.mark.multiprocess
def test_an_evaluation_on_rank_0_only_leaves_the_ranks_collectives_in_step(tmp_path: Path) -> None:
    # Before the fix, ending the eval batch cleared the training micro-batch's agreement on rank 0, whose step() then
    # ran one all-reduce more than rank 1's: the ranks fell out of step and one waited in a collective until timeout.
    result = run_torchrun("plain_eval_on_rank0_run.py", "--out", str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(o["batch_number"], o["eval_batch_number"]) for o in outcomes] == [(6, 6), (6, 0)]


@pytest.mark.slow
def test_the_plain_loop_example_overflows_in_float16_and_shows_the_report(tmp_path: Path) -> None:
    config = tmp_path / "nanwatch.json"
    config.write_text(json.dumps({"max_frames_to_save": 5, "report_dir": str(tmp_path / "reports")}), encoding="utf-8")
    example = SCRIPTS.parents[2] / "examples" / "plain_loop.py"

    result = subprocess.run(
        [sys.executable, str(example), "--config", str(config)], capture_output=True, text=True, timeout=120
    )

    assert result.returncode == 1, result.stderr[-3000:]  # the example exits 1 when nanwatch stopped it
    pattern = r"\[rank 0\] stopped: inf/nan in batch_number=(\d+) on rank 0, first in module '([\w.]+)'; "
    stopped = re.search(pattern + r"optimizer step (\d+) never ran; weights still finite: True", result.stdout)
    assert stopped is not None, result.stdout
    batch, module, step = stopped.groups()
    assert int(step) == int(batch) // 2  # gradient accumulation 2
    assert f"optimizer step {int(step) - 1:3d}  loss" in result.stdout  # the last step that ran
    assert f"Detected inf/nan during batch_number={batch}\nLast 5 forward frames:\n" in result.stderr
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
