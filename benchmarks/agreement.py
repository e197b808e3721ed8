"""What the ranks' agreement costs: N simulated ranks against one real TCPStore server (or, with --per-call, a
rank's ask per micro-batch on real gloo processes).

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
    python benchmarks/agreement.py --ranks 16 64 256 1024 --processes 32 \\
        --output benchmarks/results/agreement-processes.json

With `--processes P` the ranks are spread over P worker processes (N/P rank threads each, every rank still with its
own connections and board): closer to real ranks, which share no interpreter lock; all workers start the detection at
one instant of the system's monotonic clock, which every process reads alike, and report when each rank had its
verdict.

Connecting is timed apart: on a loaded machine one local TCP connect in about thirty can take 5 s, so a thousand
simulated ranks (two thousand connections) take minutes to set up; a cluster connects once per rank.

With `--per-call`, the hot path's side instead: `--world-size` real processes with the gloo backend, each timing
`--calls` back-to-back asks of `posted_elsewhere()` (once per training micro-batch and at each optimizer step: an
attribute the rank's listener thread sets, no call to the store), against an `all_reduce` of one int64 (what a
watcher that agreed through a collective would pay per micro-batch); the slowest rank's mean and median per call.

    python benchmarks/agreement.py --per-call            # 2 processes, 1000 calls each
    python benchmarks/agreement.py --per-call --calls 5000 --world-size 4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The agreement's internals are what this benchmark measures, and no public API reaches them: the board each rank
# holds, its listener (swapped for the polled fallback, and back), and a detection to post.
from nanwatch.core.distributed import listener as listener_module
from nanwatch.core.distributed.board import DetectionBoard
from nanwatch.core.distributed.listener import BellListener, PolledBell
from nanwatch.core.distributed.ranks import Detection

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


def connect(port: int, world: int, members: range, prefix: str) -> list[tuple[DetectionBoard, Counted]]:
    """Boards for `members` of a run of `world` ranks, each on its own connection, their listeners ready."""

    def one(member: int) -> tuple[DetectionBoard, Counted]:
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=600))
        counted = Counted(client)
        return DetectionBoard(counted, member, world, 30.0, prefix=prefix), counted

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        made = list(pool.map(one, members))
    for board, _ in made:
        bell = board._bell
        if isinstance(bell, BellListener):
            bell.ready.wait(600)
    return made


def idle_calls(made: list[tuple[DetectionBoard, Counted]], micro_batches: int, seconds: float) -> int:
    """What the hot path asks of the store over `micro_batches` micro-batches paced across `seconds`: store calls."""
    before = sum(counted.calls for _, counted in made)
    pace = seconds / micro_batches
    for _ in range(micro_batches):
        for board, _ in made:
            board.posted_elsewhere()
        time.sleep(pace)
    return sum(counted.calls for _, counted in made) - before


def use_polled_bells(made: list[tuple[DetectionBoard, Counted]]) -> list[Any]:
    """Swap every listener for the fallback (a polled bell, at most one look per second); the listeners, to put back."""
    listeners = [board._bell for board, _ in made]
    for board, counted in made:
        board._bell = PolledBell(counted, board._bell.key)
    listener_module.POLL_INTERVAL_S = 1.0
    return listeners


def settle_all(made: list[tuple[DetectionBoard, Counted]], world: int, start_at: float) -> dict[str, Any]:
    """Every rank posts at `start_at` (the system's monotonic clock) and settles, each in a thread of its own (as
    under DDP, where a nan on one rank reaches every rank's gradients: one rank "frames", the others "gradients")."""
    frames_rank = world // 3
    expected = Detection(7, frames_rank, "train", "frames")
    agreed = [False] * len(made)
    finished = [0.0] * len(made)
    before = [counted.calls for _, counted in made]

    def rank(index: int) -> None:
        board = made[index][0]
        mine = Detection(7, board.member, "train", "frames" if board.member == frames_rank else "gradients")
        time.sleep(max(0.0, start_at - time.monotonic()))
        try:
            agreed[index] = board.settle(mine) == expected
        except BaseException:
            agreed[index] = False
        finished[index] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(index,), daemon=True) for index in range(len(made))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    trips = [counted.calls - b for (_, counted), b in zip(made, before, strict=True)]
    return {"agreed": all(agreed), "finished": finished, "trips": trips}


class Workers:
    """The ranks spread over worker processes (this script with `--worker`), driven by lines on their stdin."""

    def __init__(self, port: int, world: int, processes: int, prefix: str) -> None:
        share = -(-world // processes)
        self._procs = []
        for first in range(0, world, share):
            count = min(share, world - first)
            command = [sys.executable, __file__, "--worker", str(port), str(world), str(first), str(count), prefix]
            self._procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        self.ask("ready")

    def ask(self, *words: Any) -> list[Any]:
        for proc in self._procs:
            assert proc.stdin is not None
            proc.stdin.write(" ".join(map(str, words)) + "\n")
            proc.stdin.flush()
        answers = []
        for proc in self._procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker ended (rc {proc.wait()})")
            answers.append(json.loads(line))
        return answers

    def close(self) -> None:
        for proc in self._procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in self._procs:
            proc.wait(120)


def worker(port: int, world: int, first: int, count: int, prefix: str) -> int:
    """One worker process: its ranks' boards; answers one JSON line per command read from stdin."""
    made = connect(port, world, range(first, first + count), prefix)
    listeners: list[Any] = []
    for line in sys.stdin:
        words = line.split()
        answer: Any = None
        if words[0] == "idle":
            answer = idle_calls(made, int(words[1]), float(words[2]))
        elif words[0] == "polled":
            listeners = use_polled_bells(made)
        elif words[0] == "listen":
            for (board, _), bell in zip(made, listeners, strict=True):
                board._bell = bell
        elif words[0] == "settle":
            answer = settle_all(made, world, float(words[1]))
        print(json.dumps(answer), flush=True)
    for board, _ in made:
        board.close()
    return 0


def measure(port: int, pid: int, count: int, processes: int) -> dict[str, Any]:
    """One N: connect, idle with listeners, idle polled, one detection; in this process's threads or in workers."""
    prefix = f"bench/{count}/{processes}"
    began = time.monotonic()
    if processes > 1:
        workers = Workers(port, count, processes, prefix)
    else:
        made = connect(port, count, range(count), prefix)
    connected = time.monotonic() - began

    def idle(micro_batches: int, seconds: float) -> dict[str, float]:
        cpu, began = server_cpu_s(pid), time.monotonic()
        if processes > 1:
            calls = sum(workers.ask("idle", micro_batches, seconds))
        else:
            calls = idle_calls(made, micro_batches, seconds)
        took = time.monotonic() - began
        return {
            "ops_per_micro_batch_per_rank": calls / (micro_batches * count),
            "ops_per_second_per_rank": calls / (took * count),
            "server_cpu_s_per_s": (server_cpu_s(pid) - cpu) / took,
        }

    listening = idle(100, 2.0)
    if processes > 1:
        workers.ask("polled")
    else:
        listeners = use_polled_bells(made)
    polling = idle(100, 3.0)
    if processes > 1:
        workers.ask("listen")
    else:
        for (board, _), bell in zip(made, listeners, strict=True):
            board._bell = bell
    cpu = server_cpu_s(pid)
    start_at = time.monotonic() + (1.0 if processes > 1 else 0.2)  # every rank thread started and asleep by then
    parts = workers.ask("settle", start_at) if processes > 1 else [settle_all(made, count, start_at)]
    finished = [f for part in parts for f in part["finished"]]
    trips = [t for part in parts for t in part["trips"]]
    found = {
        "agreed": all(part["agreed"] for part in parts),
        "last_verdict_s": max(finished) - start_at,
        "median_verdict_s": statistics.median(f - start_at for f in finished),
        "round_trips_per_rank_max": max(trips),
        "round_trips_per_rank_median": statistics.median(trips),
        "ranks_over_5_round_trips": sum(trip > 5 for trip in trips),
        "server_cpu_s": server_cpu_s(pid) - cpu,
    }
    if processes > 1:
        workers.close()
    else:
        for board, _ in made:
            board.close()
    return {
        "ranks": count,
        "processes": processes,
        "connect_s": connected,
        "idle_listener": listening,
        "idle_polled": polling,
        **found,
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


# ---------------------------------------------------------------------------------------- --per-call: gloo ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _time_calls(call: Any, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _per_call_rank(rank: int, world_size: int, port: int, calls: int, results: Any) -> None:
    """One gloo process of `--per-call`: its board's `posted_elsewhere()` and an `all_reduce`, each `calls` times."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        flag = torch.zeros(1, dtype=torch.int64)
        board = DetectionBoard.for_model(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), rank, world_size, wait_s=10.0)
        assert board is not None
        for _ in range(100):  # warm-up: connections
            board.posted_elsewhere()
        dist.barrier()
        agree = _time_calls(board.posted_elsewhere, calls)
        dist.barrier()
        collective = _time_calls(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN), calls)
        results[rank] = (agree, collective)
        board.close()
    finally:
        dist.destroy_process_group()


def per_call(calls: int, world_size: int) -> None:
    """`--per-call`: what a rank's hot path asks, per call, on `world_size` gloo processes, against a collective."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_per_call_rank, args=(world_size, _free_port(), calls, results), nprocs=world_size)
        per_rank = dict(results)

    def figures(index: int) -> tuple[float, float]:
        means = [statistics.fmean(per_rank[r][index]) * 1e6 for r in per_rank]
        medians = [statistics.median(per_rank[r][index]) * 1e6 for r in per_rank]
        return max(means), max(medians)

    agree_mean, agree_median = figures(0)
    collective_mean, collective_median = figures(1)
    print(f"{world_size} gloo processes on the CPU, {calls} calls each (torch {torch.__version__})")
    print(f"posted_elsewhere():            mean {agree_mean:.2f} us, median {agree_median:.2f} us per call")
    print(f"all_reduce of one int64:       mean {collective_mean:.0f} us, median {collective_median:.0f} us per call")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        port, world, first, count = (int(word) for word in sys.argv[2:6])
        return worker(port, world, first, count, sys.argv[6])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--processes", type=int, default=1, help="spread the ranks over this many worker processes")
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    parser.add_argument(
        "--per-call",
        action="store_true",
        help="instead: time what the hot path asks per call on --world-size gloo processes, against an all_reduce",
    )
    parser.add_argument("--calls", type=int, default=1000, help="with --per-call: calls timed on each process")
    parser.add_argument("--world-size", type=int, default=2, help="with --per-call: gloo processes")
    args = parser.parse_args()
    if args.per_call:
        if args.calls < 1 or args.world_size < 1:
            parser.error(f"--calls and --world-size must be positive, got {args.calls}, {args.world_size}")
        per_call(args.calls, args.world_size)
        return 0
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    rows = []
    try:
        for count in args.ranks:
            row = measure(port, server.pid, count, min(args.processes, count))
            if row["processes"] == 1:
                row["simulation_floor_s"] = choreography_floor(count)
            rows.append(row)
            listening, polling = row["idle_listener"], row["idle_polled"]
            idle_text = (
                f"idle, listener: {listening['ops_per_micro_batch_per_rank']:.2f} ops/micro-batch/rank, server "
                f"{listening['server_cpu_s_per_s'] * 100:.2f} % CPU | idle, polled: "
                f"{polling['ops_per_second_per_rank']:.2f} ops/s/rank"
            )
            floor = row.get("simulation_floor_s")
            floor_text = (
                f" (the same thread wake-ups with no store: {floor * 1000:.0f} ms)" if floor is not None else ""
            )
            found_text = (
                f"detection: agreed {row['agreed']}, round trips/rank median "
                f"{row['round_trips_per_rank_median']:.0f} max {row['round_trips_per_rank_max']} "
                f"({row['ranks_over_5_round_trips']} over 5), server {row['server_cpu_s'] * 1000:.0f} ms CPU, "
                f"last verdict {row['last_verdict_s'] * 1000:.0f} ms, median {row['median_verdict_s'] * 1000:.0f} ms"
                f"{floor_text}"
            )
            print(
                f"N={count:5d} in {row['processes']} process(es)  connect {row['connect_s']:6.1f} s | {idle_text} | "
                f"{found_text}",
                flush=True,
            )
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
