"""How the ranks' agreement (core/board.py) scales: N simulated ranks against one real TCPStore server.

The server runs in a process of its own (so its CPU time is its own: read from /proc); each simulated rank is a
thread of this process with its own client connection and its own `DetectionBoard`, whose listener thread holds one
more connection (`store.clone()`), as a real rank's would. For each N:

- idle: 100 micro-batches per rank of what the hot path asks (`posted_elsewhere()`), counting the calls that reach
  the store through each rank's connection, and the server's CPU meanwhile; the same with the fallback (a polled
  bell, at most one look per second);
- detection: every rank posts at once (as under DDP, where a nan on one rank reaches every rank's gradients: one rank
  "frames", the others "gradients"), and settles: round trips per rank, the server's CPU, and the time from the posts
  to the last rank's verdict (acknowledgements included).

    python benchmarks/agreement.py                       # N = 16, 64, 256
    python benchmarks/agreement.py --ranks 16 64 256 1024 --output benchmarks/results/agreement.json

Connecting is timed apart: on this project's machine one local TCP connect in about thirty takes 5 s, so a
thousand simulated ranks (two thousand connections) take minutes to set up; a cluster connects once per rank.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from nanwatch.core import listener as listener_module
from nanwatch.core.board import DetectionBoard
from nanwatch.core.listener import BellListener, PolledBell
from nanwatch.core.ranks import Detection

_SERVER = """
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
"""


class Counted:
    """A rank's store: counts the calls that reach the server through this connection."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls = 0

    def clone(self) -> Any:
        return self._store.clone()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return call


def server_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connect(port: int, count: int, prefix: str) -> list[tuple[DetectionBoard, Counted]]:
    def one(member: int) -> tuple[DetectionBoard, Counted]:
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=600))
        counted = Counted(client)
        return DetectionBoard(counted, member, count, 30.0, prefix=prefix), counted

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        made = list(pool.map(one, range(count)))
    for board, _ in made:
        bell = board._bell
        if isinstance(bell, BellListener):
            bell.ready.wait(600)
    return made


def idle(made: list[tuple[DetectionBoard, Counted]], pid: int, micro_batches: int, seconds: float) -> dict[str, float]:
    before_calls = sum(counted.calls for _, counted in made)
    before_cpu = server_cpu_s(pid)
    began = time.monotonic()
    pace = seconds / micro_batches
    for _ in range(micro_batches):
        for board, _ in made:
            board.posted_elsewhere()
        time.sleep(pace)
    took = time.monotonic() - began
    calls = sum(counted.calls for _, counted in made) - before_calls
    return {
        "ops_per_micro_batch_per_rank": calls / (micro_batches * len(made)),
        "ops_per_second_per_rank": calls / (took * len(made)),
        "server_cpu_s_per_s": (server_cpu_s(pid) - before_cpu) / took,
    }


def detection(made: list[tuple[DetectionBoard, Counted]], pid: int) -> dict[str, Any]:
    count = len(made)
    frames_rank = count // 3
    verdicts: list[Any] = [None] * count
    finished = [0.0] * count
    start = threading.Event()
    before = [counted.calls for _, counted in made]

    def rank(member: int) -> None:
        board = made[member][0]
        mine = Detection(7, member, "train", "frames" if member == frames_rank else "gradients")
        start.wait()
        try:
            verdicts[member] = board.settle(mine)
        except BaseException as error:
            verdicts[member] = error
        finished[member] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(member,), daemon=True) for member in range(count)]
    for thread in threads:
        thread.start()
    cpu_before = server_cpu_s(pid)
    began = time.monotonic()
    start.set()
    for thread in threads:
        thread.join(600)
    trips = [counted.calls - b for (_, counted), b in zip(made, before, strict=True)]
    expected = Detection(7, frames_rank, "train", "frames")
    return {
        "agreed": all(verdict == expected for verdict in verdicts),
        "last_verdict_s": max(finished) - began,
        "median_verdict_s": statistics.median(f - began for f in finished),
        "round_trips_per_rank_max": max(trips),
        "round_trips_per_rank_median": statistics.median(trips),
        "ranks_over_5_round_trips": sum(trip > 5 for trip in trips),
        "server_cpu_s": server_cpu_s(pid) - cpu_before,
    }


def choreography_floor(count: int) -> float:
    """The simulation's own cost: the same waves of thread wake-ups as a detection (every rank thread starts, its
    listener thread wakes and wakes it, the acknowledgements gather and release them all), with no store at all."""
    start, all_acked = threading.Event(), threading.Event()
    bells = [threading.Event() for _ in range(count)]
    heard = [threading.Event() for _ in range(count)]
    acks = [0]
    lock = threading.Lock()
    finished = [0.0] * count

    def listen(member: int) -> None:
        bells[member].wait()
        heard[member].set()

    def rank(member: int) -> None:
        start.wait()
        with lock:
            acks[0] += 1
            last = acks[0] == count
        if last:  # as the rank completing the count: rings every bell
            for bell in bells:
                bell.set()
        heard[member].wait()
        with lock:
            acks[0] += 1
            done = acks[0] == 2 * count
        if done:
            all_acked.set()
        all_acked.wait()
        finished[member] = time.monotonic()

    threads = [threading.Thread(target=listen, args=(m,), daemon=True) for m in range(count)]
    threads += [threading.Thread(target=rank, args=(m,), daemon=True) for m in range(count)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    began = time.monotonic()
    start.set()
    for thread in threads:
        thread.join(600)
    return max(finished) - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    rows = []
    try:
        for count in args.ranks:
            began = time.monotonic()
            made = connect(port, count, f"bench/{count}")
            connected = time.monotonic() - began
            listening = idle(made, server.pid, micro_batches=100, seconds=2.0)
            listeners = [board._bell for board, _ in made]
            for board, counted in made:  # the fallback, for a while: a polled bell, at most one look per second
                board._bell = PolledBell(counted, board._bell.key)
            listener_module.POLL_INTERVAL_S = 1.0
            polling = idle(made, server.pid, micro_batches=100, seconds=3.0)
            for (board, _), bell in zip(made, listeners, strict=True):
                board._bell = bell
            found = detection(made, server.pid)
            found["simulation_floor_s"] = choreography_floor(count)
            row = {"ranks": count, "connect_s": connected, "idle_listener": listening, "idle_polled": polling, **found}
            rows.append(row)
            idle_text = (
                f"idle, listener: {listening['ops_per_micro_batch_per_rank']:.2f} ops/micro-batch/rank, server "
                f"{listening['server_cpu_s_per_s'] * 100:.2f} % CPU | idle, polled: "
                f"{polling['ops_per_second_per_rank']:.2f} ops/s/rank"
            )
            found_text = (
                f"detection: agreed {found['agreed']}, round trips/rank median "
                f"{found['round_trips_per_rank_median']:.0f} max {found['round_trips_per_rank_max']} "
                f"({found['ranks_over_5_round_trips']} over 5), server {found['server_cpu_s'] * 1000:.0f} ms CPU, "
                f"last verdict {found['last_verdict_s'] * 1000:.0f} ms (the same thread wake-ups with no store: "
                f"{found['simulation_floor_s'] * 1000:.0f} ms)"
            )
            print(f"N={count:5d}  connect {connected:6.1f} s | {idle_text} | {found_text}", flush=True)
            for board, _ in made:
                board.close()
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump({"command": " ".join(["python", *sys.argv]), "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
