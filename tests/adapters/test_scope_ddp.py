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
    # Watched: 0, 3, 6, 9. Rank 1's micro-batch 4 goes inf unseen (4 still agrees on what 3 may have left pending;
    # 5 runs no check and no all-reduce, on either rank); step 2 (after micro-batch 5) spreads non-finite weights to
    # both ranks; micro-batch 6 sees them on both, and the lowest rank is the one named.
    result = run_torchrun("scope_ddp_run.py", "--out", str(tmp_path), "--inject-at", "4", "--inject-rank", "1")

    assert set(failed_workers(result.stderr)) == {0, 1}, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    for outcome in outcomes:
        assert outcome["error"]["batch_number"] == 6
        assert outcome["error"]["rank"] == 0
        assert outcome["micro_batches_run"] == 7
    assert outcomes[0]["error"]["module"] == "inp"  # rank 0 is the agreed detector: its first module's weights
    reports = {path.name for path in (tmp_path / "reports").iterdir()}
    assert {"nanwatch-report-rank0-batch6.txt", "nanwatch-report-rank1-batch6.txt"} <= reports
    assert "batch_numbers 4..5 before this one were not watched" in result.stderr
