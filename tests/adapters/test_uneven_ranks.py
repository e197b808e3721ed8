"""Uneven data across ranks, a final barrier, a rank that goes on after its own error: two real processes under
torchrun (gloo). nanwatch runs no collective of its own, so none of these can pair with the user's (or
`ddp.join()`'s) collectives or hold a rank in one; ranks learn of a detection through the process group's store."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torchrun_launch import failed_workers, run_torchrun  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _run(tmp_path: Path, *args: str) -> tuple[int, float, list[dict[str, Any] | None], str]:
    start = time.monotonic()
    result = run_torchrun("uneven_run.py", "--out", str(tmp_path), "--batches", "6", "4", *args, timeout=120)
    took = time.monotonic() - start
    outcomes = []
    for rank in (0, 1):
        path = tmp_path / f"outcome-rank{rank}.json"
        outcomes.append(json.loads(path.read_text()) if path.exists() else None)
    return result.returncode, took, outcomes, result.stderr


def _reports(tmp_path: Path) -> set[str]:
    folder = tmp_path / "reports"
    return {path.name for path in folder.iterdir()} if folder.exists() else set()


def test_a_clean_run_on_uneven_data_in_ddp_join_finishes(tmp_path: Path) -> None:
    # Before: nanwatch's all-reduce paired with Join's shadow collectives and a healthy run died with a nonsense
    # NonFiniteError (batch_number=69930657513472), 3 runs of 3.
    code, _, outcomes, stderr = _run(tmp_path, "--ddp")
    assert code == 0, stderr[-3000:]
    assert [(o["ran"], o["error"]) for o in outcomes if o] == [(6, None), (4, None)]
    assert _reports(tmp_path) == set()


def test_a_clean_run_on_uneven_data_with_a_final_barrier_finishes(tmp_path: Path) -> None:
    # Before: rank 0's extra micro-batches ran nanwatch all-reduces that rank 1's barrier never matched: both
    # ranks hung until the process group's timeout.
    code, took, outcomes, stderr = _run(tmp_path)
    assert code == 0, stderr[-3000:]
    assert [(o["ran"], o["error"]) for o in outcomes if o] == [(6, None), (4, None)]
    assert took < 60


def test_a_nan_on_rank_1_in_ddp_join_stops_both_ranks_with_its_batch_and_rank(tmp_path: Path) -> None:
    code, _, outcomes, stderr = _run(tmp_path, "--ddp", "--inject-at", "2", "--inject-rank", "1")
    assert all(o is not None for o in outcomes), stderr[-3000:]
    for outcome in outcomes:
        assert outcome is not None
        assert (outcome["error"]["batch_number"], outcome["error"]["rank"]) == (2, 1)
        assert outcome["ran"] == 2  # micro-batch 2's step never ran, on either rank
        assert outcome["hooks_left"] == 0
    assert _reports(tmp_path) == {f"nanwatch-report-rank1-batch2.{suffix}" for suffix in ("txt", "json", "jsonl")} | {
        "nanwatch-capsule-rank1-batch2.pt"  # the capsule of the culprit's call
    }
    assert code != 0  # both ranks left join() on the error


def test_a_nan_after_the_other_rank_joined_is_reported_in_bounded_time(tmp_path: Path) -> None:
    # Rank 1 ran out of data after 4 micro-batches and waits in join(); rank 0's micro-batch 5 goes inf. Rank 0
    # waits rank_wait_s (3 s here) for a word from rank 1, which cannot come, then reports it alone.
    code, took, outcomes, stderr = _run(tmp_path, "--ddp", "--inject-at", "5", "--inject-rank", "0")
    rank0 = outcomes[0]
    assert rank0 is not None, stderr[-3000:]
    assert (rank0["error"]["batch_number"], rank0["error"]["rank"]) == (5, 0)
    assert 3 <= rank0["error"]["after_s"] < 30
    assert _reports(tmp_path) == {f"nanwatch-report-rank0-batch5.{suffix}" for suffix in ("txt", "json", "jsonl")} | {
        "nanwatch-capsule-rank0-batch5.pt"  # the capsule of the culprit's call
    }
    # Rank 1 waits in torch's own shadow collective, which rank 0 leaving ends (a connection error): not a hang.
    assert set(failed_workers(stderr)) == {0, 1}
    assert code != 0
    assert took < 60


def test_a_rank_that_goes_on_after_its_own_error_holds_no_one(tmp_path: Path) -> None:
    # Each rank trains its own copy (no DDP). Rank 1 sees inf at micro-batch 2, catches the error and goes on without
    # nanwatch; rank 0 learns of it through the store at its next check and stops too. Nobody waits in a collective.
    code, took, outcomes, stderr = _run(tmp_path, "--inject-at", "2", "--inject-rank", "1", "--keep-going-rank", "1")
    assert code == 0, stderr[-3000:]
    rank0, rank1 = outcomes
    assert rank0 is not None
    assert rank1 is not None
    assert (rank1["error"]["batch_number"], rank1["error"]["rank"], rank1["went_on"]) == (2, 1, 1)
    assert (rank0["error"]["batch_number"], rank0["error"]["rank"]) == (2, 1)  # rank 1's verdict, on rank 0 too
    assert rank0["ran"] < 6
    assert took < 60
