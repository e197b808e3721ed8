"""core/distributed/board.py at scale and under faults: many ranks as threads, each with its own connection to
one real TCPStore.

What is counted is real: each simulated rank talks to the store through `Counted`, which passes every call on and
counts it (the listener's connection, from `clone()`, is the store's own and is not counted: it makes one blocking
`get`). benchmarks/agreement.py runs the same for up to 1,024 ranks and prints the figures.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import itertools
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests.counted_store import Counted
from torch import nn
from torch._C._distributed_c10d import HashStore

from nanwatch import NanwatchWarning, NonFiniteError, WatchConfig
from nanwatch.core.distributed import board as board_module
from nanwatch.core.distributed import listener as listener_module
from nanwatch.core.distributed.board import DetectionBoard, StoreLost, board_prefix
from nanwatch.core.distributed.listener import BellListener, PolledBell
from nanwatch.core.distributed.ranks import Detection
from nanwatch.core.watcher import Watcher

WAIT_S = 5.0

# Real TCP connections to a real store (on this machine one local connect in about thirty takes 5 s): not quick.
pytestmark = pytest.mark.slow


@pytest.fixture
def server() -> Iterator[Any]:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    yield store
    # Every listener still blocked ends before the server goes (else each would log the lost connection).
    listener_module._close_at_exit()


def _client(server: Any) -> Any:
    return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=30))


def _boards(server: Any, count: int, prefix: str) -> list[tuple[DetectionBoard, Counted]]:
    def one(member: int) -> tuple[DetectionBoard, Counted]:
        counted = Counted(_client(server))
        return DetectionBoard(counted, member, count, WAIT_S, prefix=prefix), counted

    # Connected side by side: on this machine one local TCP connect in about thirty takes 5 s.
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        made = list(pool.map(one, range(count)))
    for board, counted in made:  # every listener connected and blocked in its get, as in a run long under way
        assert getattr(board._bell, "ready", threading.Event()).wait(60) or not isinstance(board._bell, BellListener)
        assert counted.calls == ["add", "add"]  # attaching: the two counts
        counted.calls.clear()
    return made


def _settle_all(
    boards: list[DetectionBoard], detections: dict[int, Detection], *, wait: bool = True
) -> list[Detection | BaseException]:
    results: list[Detection | BaseException] = [TimeoutError("never ran")] * len(boards)

    def rank(member: int) -> None:
        board = boards[member]
        try:
            mine = detections.get(member)
            if mine is None:  # a rank that saw nothing hears the verdict at its next check
                while not board.posted_elsewhere():
                    threading.Event().wait(0.005)
            results[member] = board.settle(mine, wait=wait)
        except BaseException as error:
            results[member] = error

    threads = [threading.Thread(target=rank, args=(member,), daemon=True) for member in range(len(boards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=4 * WAIT_S)
    return results


def test_64_ranks_agree_on_the_frames_rank_with_a_bounded_number_of_round_trips(server: Any) -> None:
    # Under DDP a nan on one rank reaches every rank's gradients: 63 ranks post "gradients", rank 17 "frames".
    made = _boards(server, 64, "nanwatch/scale")
    boards = [board for board, _ in made]
    detections = {m: Detection(5, m, "train", "frames" if m == 17 else "gradients") for m in range(64)}
    results = _settle_all(boards, detections)
    assert results == [Detection(5, 17, "train", "frames")] * 64
    trips = sorted(len(counted.calls) for _, counted in made)
    # append, add, ack add, ack wait (or set): 4 for every rank; the one that completed the count also read the
    # posts, wrote the verdict key once and rang every bell: 7 (core/distributed/board.py's docstring).
    assert trips[:-1] == [4] * 63
    assert trips[-1] == 7
    for board in boards:
        board.close()


def test_ranks_that_saw_nothing_hear_the_verdict_without_asking_the_store(server: Any) -> None:
    made = _boards(server, 8, "nanwatch/quiet")
    boards = [board for board, _ in made]
    assert all(isinstance(board._bell, BellListener) for board in boards)
    for _ in range(100):  # idle micro-batches: nothing goes to the store
        assert not any(board.posted_elsewhere() for board in boards)
    assert sum(len(counted.calls) for _, counted in made) == 0
    # One rank detects in evaluation (no waiting): it decides at once; the others hear it through their bells.
    results = _settle_all(boards, {3: Detection(9, 3, "eval", "frames")}, wait=False)
    assert results == [Detection(9, 3, "eval", "frames")] * 8
    quiet = [len(counted.calls) for member, (_, counted) in enumerate(made) if member != 3]
    assert quiet == [2] * 7  # the acknowledgement: add, then wait (or set)


def test_ranks_that_may_not_wait_closing_the_count_together_write_one_verdict(server: Any) -> None:
    # Two ranks detect in evaluation at once (no waiting) while the others post gradients: one decider, one verdict.
    made = _boards(server, 8, "nanwatch/closers")
    boards = [board for board, _ in made]
    results: list[Detection | BaseException] = [TimeoutError("never ran")] * 8
    start = threading.Event()

    def rank(member: int) -> None:
        start.wait()
        eval_rank = member in (2, 5)
        mine = Detection(4, member, "eval" if eval_rank else "train", "frames" if eval_rank else "gradients")
        try:
            results[member] = boards[member].settle(mine, wait=not eval_rank)
        except BaseException as error:
            results[member] = error

    threads = [threading.Thread(target=rank, args=(member,), daemon=True) for member in range(8)]
    for thread in threads:
        thread.start()
    start.set()
    for thread in threads:
        thread.join(timeout=4 * WAIT_S)
    assert len(set(map(repr, results))) == 1, results
    assert isinstance(results[0], Detection)
    assert sum(len(counted.calls) == 7 for _, counted in made) == 1  # one rank decided


def test_a_rank_whose_watcher_attached_after_another_decided_alone_takes_that_verdict(server: Any) -> None:
    # Rank 0's watcher is made, detects and posts before rank 1's watcher exists: rank 0's count completes with its
    # own post and it decides alone. Rank 1 then attaches, detects something else and completes the count again: it
    # must act on rank 0's verdict, and no bell may ring with a second one.
    first = DetectionBoard(Counted(_client(server)), 0, 2, WAIT_S, prefix="nanwatch/late")
    early = first.settle(Detection(3, 0, "train", "frames"))
    second = DetectionBoard(Counted(_client(server)), 1, 2, WAIT_S, prefix="nanwatch/late")
    late = second.settle(Detection(2, 1, "train", "frames"))  # earlier, so it would win a second decision
    assert early == late == Detection(3, 0, "train", "frames")
    assert server.get("nanwatch/late/bell/1").decode() == server.get("nanwatch/late/bell/0").decode() == early.encode()
    first.close()
    second.close()


def test_a_verdict_is_reached_when_a_rank_never_posts(server: Any) -> None:
    made = _boards(server, 4, "nanwatch/missing")
    boards = [board for board, _ in made]
    for board in boards:
        board.wait_s = 0.5
    detections = {m: Detection(2, m, "train", "gradients") for m in range(3)}  # rank 3 is stuck elsewhere
    results = _settle_all(boards[:3], detections)
    assert results == [Detection(2, 0, "train", "gradients")] * 3
    assert boards[3].posted_elsewhere()  # and rank 3 hears it when it comes back


def test_a_lost_store_turns_the_agreement_off_with_one_warning_and_the_rank_stops_on_its_own(
    server: Any, nanwatch_log: pytest.LogCaptureFixture
) -> None:
    counted = Counted(_client(server))
    board = DetectionBoard(counted, 1, 2, WAIT_S, prefix="nanwatch/lost")
    board._bell.close()
    board._bell = PolledBell(counted, board._bell.key)  # what a rank without a listener has
    counted.broken = True  # destroy_process_group() on the store's host, or that rank exited
    with pytest.warns(NanwatchWarning, match="the process group's store failed"):
        assert not board.posted_elsewhere()
    assert not board.posted_elsewhere()
    with pytest.raises(StoreLost):
        board.settle(Detection(1, 1, "train", "frames"))

    model = nn.Sequential(nn.Linear(2, 2))
    watcher = Watcher(model, WatchConfig(rank_wait_s=WAIT_S), rank=1, world_size=2)
    watcher._arbiter._board = board
    watcher.attach()
    watcher.start_batch("train")
    model(torch.full((1, 2), float("inf")))
    with pytest.raises(NonFiniteError) as caught:
        watcher.end_batch()
    assert (caught.value.rank, caught.value.batch_number) == (1, 0)  # what this rank saw itself
    warnings = [r.getMessage() for r in nanwatch_log.records if "store failed" in r.getMessage()]
    assert len(warnings) == 1
    watcher.close(check=False)


def test_a_listener_whose_connection_dies_falls_back_to_polling(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nanwatch.core.distributed.listener.POLL_INTERVAL_S", 0.0)
    main = _client(server)

    class DeadConnection:
        def set_timeout(self, timeout: datetime.timedelta) -> None:
            pass

        def get(self, key: str) -> bytes:
            raise dist.DistNetworkError("the listener's connection dropped")

    class DyingClone(Counted):
        def clone(self) -> Any:
            return DeadConnection()

    board = DetectionBoard(DyingClone(main), 0, 2, WAIT_S, prefix="nanwatch/dying")
    assert isinstance(board._bell, BellListener)
    board._bell._thread.join(timeout=5)  # type: ignore[attr-defined]
    assert not board.posted_elsewhere()  # the listener is gone: from now on the bell is polled
    assert isinstance(board._bell, PolledBell)
    other = DetectionBoard(_client(server), 1, 2, WAIT_S, prefix="nanwatch/dying")
    assert other.settle(Detection(4, 1, "eval", "frames"), wait=False) == Detection(4, 1, "eval", "frames")
    assert board.posted_elsewhere()
    assert board.settle(None) == Detection(4, 1, "eval", "frames")


def test_keys_come_from_the_group_and_the_model_not_from_how_many_watchers_a_process_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(board_module, "_generations", collections.defaultdict(itertools.count))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    other = nn.Sequential(nn.Conv1d(1, 1, 3))
    first = board_prefix(model, [0, 1])
    board_prefix(other, [0, 1])  # a watcher of another model, on this rank only
    second = board_prefix(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), [0, 1])  # this model's next board
    assert first.endswith("/0")
    assert second.endswith("/1")
    assert first.rsplit("/", 1)[0] == second.rsplit("/", 1)[0]
    assert board_prefix(model, [2, 3]).rsplit("/", 1)[0] != first.rsplit("/", 1)[0]  # another group
    assert board_prefix(other, [0, 1]).rsplit("/", 1)[0] != first.rsplit("/", 1)[0]  # another model


def test_closing_ends_the_listener(server: Any) -> None:
    board = DetectionBoard(_client(server), 0, 2, WAIT_S, prefix="nanwatch/closing")
    listener = board._bell
    assert isinstance(listener, BellListener)
    time.sleep(0.2)  # blocked in its get by now
    board.close()
    listener.join(5)
    assert not listener._thread.is_alive()
    assert not board.posted_elsewhere()


def test_the_store_host_leaving_rings_the_other_bells_gone_and_they_say_one_warning(server: Any) -> None:
    # The process that hosts the store's server (this one: `server`) rings every other member's bell before its
    # server goes: their listeners end on a value (a dropped connection would end them with a C++ stack trace).
    assert board_module._hosts(server)
    assert not board_module._hosts(HashStore())
    leaving = DetectionBoard(_client(server), 0, 2, WAIT_S, prefix="nanwatch/gone")
    counted = Counted(_client(server))
    staying = DetectionBoard(counted, 1, 2, WAIT_S, prefix="nanwatch/gone")
    listener = staying._bell
    assert isinstance(listener, BellListener)
    leaving._host_exit(True)  # what interpreter exit does
    listener.join(5)
    assert listener.rung() == listener_module.GONE
    calls = len(counted.calls)
    with pytest.warns(NanwatchWarning, match="the process group's store failed") as warned:
        staying.posted_elsewhere()
    assert len(warned) == 1
    assert staying.lost is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: no second warning
        assert not staying.posted_elsewhere()
        with pytest.raises(StoreLost):
            staying.settle(Detection(1, 1, "train", "frames"))
        staying.close()
    assert len(counted.calls) == calls  # nothing more asked of a store that is going
    leaving.close()
