"""Watching every Nth micro-batch in a real two-rank DDP loop (torchrun, gloo): the ranks skip the same checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torchrun_launch import failed_workers, run_torchrun  # noqa: E402


@pytest.mark.multiprocess
def test_an_inf_in_an_unwatched_micro_batch_stops_both_ranks_at_the_next_watched_one(tmp_path: Path) -> None:
    # Watched: 0, 3, 6, 9. Rank 1's micro-batch 4 goes inf unseen (no frames are recorded in 4 and 5, on either
    # rank). But the guard reads the gradients before every step, watched or not: step 2 (after micro-batch 5) would
    # apply the nan DDP all-reduced to both ranks, and both stop there, before it runs. Neither saw where it came
    # from, so the lowest rank reports the gradients, and the note says which micro-batches went unwatched.
    result = run_torchrun("scope_ddp_run.py", "--out", str(tmp_path), "--inject-at", "4", "--inject-rank", "1")

    assert set(failed_workers(result.stderr)) == {0, 1}, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    for outcome in outcomes:
        assert outcome["error"]["batch_number"] == 5
        assert outcome["error"]["rank"] == 0
        assert outcome["micro_batches_run"] == 5  # the step of micro-batch 5 never ran
    assert outcomes[0]["error"]["module"] == "inp"  # the first parameter whose gradient is not finite
    assert outcomes[1]["error"]["module"] is None  # rank 1 is not the one reporting
    reports = {path.name for path in (tmp_path / "reports").iterdir()}
    assert reports == {f"nanwatch-report-rank0-batch5.{suffix}" for suffix in ("txt", "json", "jsonl")}
    text = (tmp_path / "reports" / "nanwatch-report-rank0-batch5.txt").read_text()
    assert "non-finite gradients about to be applied by optimizer step 2: inp.weight nan" in text
    assert "batch_numbers 4..5 up to this one were not watched" in result.stderr
