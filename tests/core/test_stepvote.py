"""core/distributed/stepvote.py: the vote every rank takes before each optimizer step under `on_detect="skip"`, with
ranks as threads on one in-memory store; every call to the store is counted."""

from __future__ import annotations

import concurrent.futures
import time
import warnings

import pytest
from tests.counted_store import Counted
from torch._C._distributed_c10d import HashStore

from nanwatch import NanwatchWarning
from nanwatch.core.distributed.ranks import Detection
from nanwatch.core.distributed.stepvote import StepVote, VoteLost


def _votes(members: int, wait_s: float = 10.0) -> tuple[list[StepVote], list[Counted]]:
    store = HashStore()
    counted = [Counted(store) for _ in range(members)]
    return [StepVote(one, "nanwatch/test/0", members, wait_s) for one in counted], counted


def _all_vote(votes: list[StepVote], mine: dict[int, Detection]) -> list[list[Detection]]:
    with concurrent.futures.ThreadPoolExecutor(len(votes)) as pool:
        return list(pool.map(lambda item: item[1].vote(mine.get(item[0])), enumerate(votes)))


def test_every_rank_learns_of_one_rank_s_detection_in_a_constant_number_of_round_trips() -> None:
    votes, stores = _votes(8)
    detection = Detection(3, 5, "train", "frames")

    outcomes = _all_vote(votes, {5: detection})

    assert outcomes == [[detection]] * 8
    assert max(len(store.calls) for store in stores) <= 4
    assert sum(store.calls.count("set") for store in stores) == 1, "one rank decided"
    # The next step's vote is on fresh keys: nothing is carried over.
    for store in stores:
        store.calls.clear()
    assert _all_vote(votes, {}) == [[]] * 8
    assert max(len(store.calls) for store in stores) <= 3, "without a detection: add, then wait and get (or set)"


def test_a_rank_that_never_arrives_costs_rank_wait_s_once_and_a_late_one_follows_the_decision() -> None:
    (first, late), _ = _votes(2, wait_s=0.5)
    mine = Detection(4, 0, "train", "frames")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        assert first.vote(mine) == [mine], "decided without the missing rank"
        waited = time.monotonic() - started
        assert 0.4 < waited < 5.0
        started = time.monotonic()
        assert first.vote(None) == [], "the next step: no waiting for nobody"
        assert time.monotonic() - started < 0.4
    said = [str(warning.message) for warning in caught if issubclass(warning.category, NanwatchWarning)]
    assert len(said) == 1
    assert "1 of 2 ranks did not reach the vote before an optimizer step within rank_wait_s=0.5 s" in said[0]
    # The late rank's detection of step 0 came after the decision: it follows it (and keeps its detection).
    assert late.vote(Detection(4, 1, "train", "frames")) == [mine]
    assert late.vote(None) == [], "step 1 was decided by the first rank alone: it follows that too"


def test_a_store_that_fails_is_said_once_and_each_rank_acts_on_its_own() -> None:
    votes, stores = _votes(2)
    stores[0].broken = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(VoteLost):
            votes[0].vote(None)
        with pytest.raises(VoteLost):
            votes[0].vote(None)
    said = [str(warning.message) for warning in caught if issubclass(warning.category, NanwatchWarning)]
    assert len(said) == 1
    assert "each rank now skips on what it sees itself" in said[0]
