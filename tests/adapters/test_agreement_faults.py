"""The ranks' agreement (core/distributed/board.py) around faults of the store and of the launch: two real gloo
processes (`torch.multiprocessing.spawn`, rank 0 hosting the store), each bounded by a timeout. Scenarios:
tests/adapters/scripts/agreement_faults_run.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "agreement_faults_run.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(scenario: str, out: Path) -> tuple[list[dict[str, Any]], str]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), scenario, str(out), str(_free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    written = [out / f"outcome-rank{rank}.json" for rank in (0, 1)]
    assert all(path.exists() for path in written), f"a rank wrote no outcome:\n{result.stderr[-4000:]}"
    outcomes = [json.loads(path.read_text(encoding="utf-8")) for path in written]
    for outcome in outcomes:
        assert outcome["other_error"] is None, outcome["other_error"]
    return outcomes, result.stderr


@pytest.mark.multiprocess
def test_after_destroy_process_group_the_watcher_goes_on_and_stops_on_what_the_rank_sees(tmp_path: Path) -> None:
    (rank0, rank1), stderr = _run("destroy", tmp_path)
    assert rank0["error"] is None
    assert rank0["steps_done"] == 3
    assert rank1["error"] is not None
    assert (rank1["error"]["rank"], rank1["error"]["batch_number"]) == (1, 6)
    assert rank1["steps_done"] == 6
    assert stderr.count("the process group's store failed") <= 1


@pytest.mark.multiprocess
def test_a_store_whose_host_left_says_one_warning_and_nothing_of_torchs_client_reaches_stderr(tmp_path: Path) -> None:
    # Before: the listener's dropped connection and the polled bell's first look each put a C++ stack trace from the
    # store client on stderr ("recvValue failed ... Exception raised from recvBytes ... frame #0"), and the warning was
    # a log line, not a NanwatchWarning.
    (rank0, rank1), stderr = _run("host_leaves", tmp_path)
    assert rank0["error"] is None
    assert rank1["store_gone"]
    assert rank1["error"] is not None
    assert (rank1["error"]["rank"], rank1["error"]["batch_number"]) == (1, 6)  # what rank 1 saw itself
    assert rank1["steps_done"] == 6
    warned = [message for message in rank1["warnings"] if message.startswith("NanwatchWarning")]
    assert len(warned) == 1, rank1["warnings"]
    assert "the process group's store failed" in warned[0]
    for text in ("TCPStore.cpp", "Exception raised from", "frame #", "DistNetworkError"):
        assert text not in stderr, stderr[-4000:]


@pytest.mark.multiprocess
def test_a_watcher_of_another_model_on_one_rank_shifts_no_key(tmp_path: Path) -> None:
    outcomes, _ = _run("extra", tmp_path)
    for outcome in outcomes:
        assert outcome["error"] is not None, f"rank {outcome['rank']} did not stop"
        assert (outcome["error"]["rank"], outcome["error"]["batch_number"]) == (1, 3)
        assert outcome["took_s"] < 3.0, "a rank waited out rank_wait_s: the ranks' keys differed"


@pytest.mark.multiprocess
def test_a_rank_whose_listener_died_polls_its_bell_and_stops_with_the_others(tmp_path: Path) -> None:
    outcomes, _ = _run("listener_dies", tmp_path)
    for outcome in outcomes:
        assert outcome["error"] is not None, f"rank {outcome['rank']} did not stop"
        assert (outcome["error"]["rank"], outcome["error"]["batch_number"]) == (0, 3)
    assert [outcome["polled"] for outcome in outcomes] == [False, True]  # rank 1 took the fallback


@pytest.mark.multiprocess
def test_ranks_training_independent_models_do_not_stop_each_other(tmp_path: Path) -> None:
    rank0, rank1 = _run("two_models", tmp_path)[0]
    assert rank0["error"] is None
    assert rank0["steps_done"] == 8
    assert rank1["error"] is not None
    assert (rank1["error"]["rank"], rank1["error"]["batch_number"]) == (1, 3)
