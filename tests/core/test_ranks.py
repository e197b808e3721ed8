"""core/distributed/board.py and the engine's use of it: ranks agree on who saw inf/nan first, whatever the scheduling.

Two ranks in one process: threads (or one thread acting in a fixed order) against one real in-memory c10d store
(`HashStore`, the same protocol as the TCPStore of a real run; tests/core/test_board.py runs many ranks against a
real TCPStore). No mocks.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from tests.adapters.scripts.blowup_models import ArmedBlowup
from tests.engine_helpers import use_board
from torch import nn
from torch._C._distributed_c10d import HashStore

from nanwatch import NonFiniteError, WatchConfig
from nanwatch.core.distributed.board import DetectionBoard
from nanwatch.core.distributed.ranks import Detection
from nanwatch.core.watcher import Watcher

WAIT_S = 2.0


@pytest.fixture
def store() -> Any:
    # In a real run each rank's board derives its keys from the group and the model (core/distributed/board.py
    # board_prefix); here both ranks' boards are given the same keys, the default prefix.
    return HashStore()


class Settling(threading.Thread):
    """A rank with only a board (no model): it posts `mine` and settles, as a rank whose guard saw only gradients."""

    def __init__(self, board: DetectionBoard, mine: Detection | None) -> None:
        super().__init__(daemon=True)
        self.board, self.mine = board, mine
        self.verdict: Detection | BaseException | None = None
        self.took: float | None = None

    def run(self) -> None:
        began = time.monotonic()
        try:
            self.verdict = self.board.settle(self.mine)
        except BaseException as error:
            self.verdict = error
        self.took = time.monotonic() - began


def _wait_for_post(store: Any) -> None:
    deadline = time.monotonic() + 10
    while not store.check(["nanwatch/0/posts"]):
        assert time.monotonic() < deadline, "the other rank never posted"
        time.sleep(0.005)


def test_the_rank_whose_frames_hold_the_inf_is_named_even_when_the_gradients_rank_posts_first(store: Any) -> None:
    # The HF Trainer flake, made deterministic. Rank 1's forward of micro-batch 3 holds an inf; DDP's all-reduce made
    # rank 0's gradients inf too, and rank 0's guard posted a "gradients" detection before rank 1 ended its
    # micro-batch. The Trainer's adapter then calls start_batch() again (after the forward, frames still unchecked):
    # no verdict has been fixed (rank 0 waits for every rank's post), so it goes on; rank 1's check holds its frames
    # for the optimizer step, where it posts them, completes the count and fixes the verdict: its own frames.
    blowup = ArmedBlowup()
    model = nn.Sequential(nn.Linear(4, 4), blowup, nn.Linear(4, 2))
    watcher = Watcher(model, WatchConfig(rank_wait_s=WAIT_S), rank=1, world_size=2)
    use_board(watcher, DetectionBoard(store, 1, 2, WAIT_S))  # what DetectionBoard.for_model gives in a real run
    watcher.on_optimizer_step("guarded")
    watcher.attach()
    for _ in range(3):  # micro-batches 0-2: clean
        watcher.start_batch("train")
        model(torch.ones(2, 4))
        watcher.end_batch()
    watcher.start_batch("train")
    blowup.armed = True
    model(torch.ones(2, 4))  # micro-batch 3: inf in rank 1's frames

    rank0 = Settling(DetectionBoard(store, 0, 2, WAIT_S), Detection(3, 0, "train", "gradients"))
    rank0.start()
    _wait_for_post(store)  # rank 0's gradients are on the board first
    began = time.monotonic()
    watcher.start_batch("train")  # as the HF Trainer adapter does before end_batch(): no verdict yet
    watcher.end_batch()  # held for the optimizer step
    with pytest.raises(NonFiniteError) as caught:
        watcher.on_optimizer_step("before")
    took = time.monotonic() - began
    rank0.join(timeout=3 * WAIT_S)

    assert (caught.value.rank, caught.value.batch_number, caught.value.module_name) == (1, 3, "1")
    assert rank0.verdict == Detection(3, 1, "train", "frames")
    # Neither rank waited out rank_wait_s: every rank had posted and acknowledged.
    assert took < WAIT_S / 2
    assert rank0.took is not None
    assert rank0.took < WAIT_S / 2
    watcher.close(check=False)


def test_a_held_detection_is_posted_at_the_step_when_another_rank_posts_first(store: Any) -> None:
    # Rank 1 saw inf in micro-batch 2 and holds it for the optimizer step (gradient accumulation); rank 0 posts before
    # that step. Rank 1 goes on to micro-batch 3 (no verdict yet) and posts its own detection at the step: the
    # verdict names micro-batch 2 on rank 1 on both ranks.
    blowup = ArmedBlowup()
    model = nn.Sequential(nn.Linear(4, 4), blowup, nn.Linear(4, 2))
    watcher = Watcher(model, WatchConfig(rank_wait_s=WAIT_S), rank=1, world_size=2)
    use_board(watcher, DetectionBoard(store, 1, 2, WAIT_S))
    watcher.on_optimizer_step("guarded")
    watcher.attach()
    for _ in range(2):
        watcher.start_batch("train")
        model(torch.ones(2, 4))
        watcher.end_batch()
    watcher.start_batch("train")
    blowup.armed = True
    model(torch.ones(2, 4))
    watcher.end_batch()  # micro-batch 2: held (guarded), published, not posted yet
    blowup.armed = False

    rank0 = Settling(DetectionBoard(store, 0, 2, WAIT_S), Detection(3, 0, "train", "gradients"))
    rank0.start()
    _wait_for_post(store)
    watcher.start_batch("train")  # micro-batch 3's forward pre-hook: no verdict yet
    model(torch.ones(2, 4))
    with pytest.raises(NonFiniteError) as caught:
        watcher.on_optimizer_step("before")
    rank0.join(timeout=3 * WAIT_S)

    assert (caught.value.rank, caught.value.batch_number) == (1, 2)
    assert rank0.verdict == Detection(2, 1, "train", "frames")
    watcher.close(check=False)


def test_frames_posted_after_gradients_still_win_within_the_wait(store: Any) -> None:
    # The gradients rank posts first; the frames rank is descheduled for a while (publishing its report, under load)
    # and posts later, within rank_wait_s: both ranks name the frames rank, whatever the order of posting.
    gradients = Settling(DetectionBoard(store, 0, 2, WAIT_S), Detection(3, 0, "train", "gradients"))
    frames = Settling(DetectionBoard(store, 1, 2, WAIT_S), Detection(3, 1, "train", "frames"))  # both attached
    gradients.start()
    _wait_for_post(store)
    time.sleep(WAIT_S / 4)
    frames.start()
    for rank in (gradients, frames):
        rank.join(timeout=3 * WAIT_S)
        assert rank.verdict == Detection(3, 1, "train", "frames")


def test_a_gradients_only_rank_does_not_decide_early_without_waiting(store: Any) -> None:
    # wait=False is for evaluation (ranks need not meet); a gradients-only detection is made at an optimizer step,
    # where the ranks do meet, and is never evidence of where the nan began: it still waits for the others' posts.
    board = DetectionBoard(store, 0, 2, WAIT_S)
    other = DetectionBoard(store, 1, 2, WAIT_S)  # attached: its post is waited for
    result: list[Detection] = []
    waiting = threading.Thread(
        target=lambda: result.append(board.settle(Detection(3, 0, "train", "gradients"), wait=False)), daemon=True
    )
    waiting.start()
    _wait_for_post(store)
    time.sleep(0.1)
    assert not result, "a gradients-only rank decided before the other rank posted"
    frames = Settling(other, Detection(3, 1, "train", "frames"))
    frames.start()
    waiting.join(timeout=3 * WAIT_S)
    frames.join(timeout=3 * WAIT_S)
    assert result == [Detection(3, 1, "train", "frames")]
    assert frames.verdict == Detection(3, 1, "train", "frames")


def test_no_rank_waits_unboundedly_when_the_other_never_posts(store: Any) -> None:
    # Rank 1 attached, then died (or waits in a collective): rank 0 decides alone after rank_wait_s, and a rank that saw
    # nothing and hears nothing gives up after rank_wait_s too.
    alone = Settling(DetectionBoard(store, 0, 2, 0.5), Detection(3, 0, "train", "gradients"))
    DetectionBoard(store, 1, 2, 0.5)  # never posts
    alone.start()
    alone.join(timeout=10)
    assert alone.verdict == Detection(3, 0, "train", "gradients")
    assert alone.took is not None
    assert 0.5 <= alone.took < 5

    other = HashStore()
    DetectionBoard(other, 0, 2, 0.5)  # attached, never posts
    silent = Settling(DetectionBoard(other, 1, 2, 0.5), None)
    silent.start()
    silent.join(timeout=10)
    assert isinstance(silent.verdict, TimeoutError)
    assert silent.took is not None
    assert 0.5 <= silent.took < 5


def test_a_rank_that_never_attached_or_has_closed_is_not_waited_for(store: Any) -> None:
    # A watcher on one rank only (an evaluation model): its rank decides and acknowledges at once. A rank that closed
    # (it finished) no longer counts: the other rank's post completes the count without waiting for it.
    lonely = Settling(DetectionBoard(HashStore(), 0, 2, 60.0), Detection(2, 0, "train", "gradients"))
    lonely.start()
    lonely.join(timeout=30)
    assert lonely.verdict == Detection(2, 0, "train", "gradients")
    assert lonely.took is not None
    assert lonely.took < 10

    finished = DetectionBoard(store, 0, 2, 60.0)
    stopping = Settling(DetectionBoard(store, 1, 2, 60.0), Detection(4, 1, "train", "frames"))
    finished.close()
    stopping.start()
    stopping.join(timeout=30)
    assert stopping.verdict == Detection(4, 1, "train", "frames")
    assert stopping.took is not None
    assert stopping.took < 10


def test_a_rank_that_closes_while_another_waits_completes_the_count_and_decides(store: Any) -> None:
    waiting = Settling(DetectionBoard(store, 0, 2, 60.0), Detection(4, 0, "train", "gradients"))
    leaving = DetectionBoard(store, 1, 2, 60.0)
    waiting.start()
    _wait_for_post(store)
    leaving.close()  # its close completes the count: it decides, and rank 0 hears the verdict
    waiting.join(timeout=30)
    assert waiting.verdict == Detection(4, 0, "train", "gradients")
    assert waiting.took is not None
    assert waiting.took < 10
