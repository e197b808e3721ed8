"""`watch_gradients=True` in a hand-written DDP loop: two real processes under torchrun (gloo), a backward-only nan."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torchrun_launch import failed_workers, run_torchrun  # noqa: E402


@pytest.mark.multiprocess
def test_a_backward_nan_on_rank_1_stops_both_ranks_before_the_step(tmp_path: Path) -> None:
    result = run_torchrun(
        "plain_ddp_gradients_run.py", "--out", str(tmp_path), "--inject-at", "2", "--inject-rank", "1"
    )

    assert result.returncode != 0, result.stderr[-3000:]
    assert set(failed_workers(result.stderr)) == {0, 1}, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, outcome in enumerate(outcomes):
        # Rank 1's backward made the nan; DDP's all-reduce would have spread it to rank 0's weights too.
        assert outcome["error"] == {"batch_number": 2, "rank": 1, "module": "poison" if rank == 1 else None}
        assert outcome["steps_done"] == 2
        assert outcome["weights_unchanged"], f"the failed step changed rank {rank}'s weights"
        assert outcome["weights_finite"]
        assert outcome["parameter_hooks_left"] == 0
    text = (tmp_path / "reports" / "nanwatch-report-rank1-batch2.txt").read_text(encoding="utf-8")
    assert "poison Poison (backward)" in text
