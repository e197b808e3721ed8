"""One rank of `nanwatch doctor`: join the group, pass a barrier, check an all_reduce, allocate, report.

Imported only on a rank started by torchrun (`nanwatch doctor` itself, and its `--help`, never import torch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanwatch.cli._doctor_common import (
    _ALL_REDUCE_NUMEL,
    _DEBUG_ENV,
    _STARTED_DIR_ENV,
    _WATCHDOG_GRACE_S,
    SIMULATE_ABSENT_RANK_ENV,
    SUMMARY_STEM,
    _compact,
    _err,
    _one_line,
    _rank_args,
    _ranks_phrase,
    _say,
    verdict_name,
)
from nanwatch.core.formats.files import atomic_write

__all__ = ["run_rank", "CheckFailed"]

# --------------------------------------------------------------------------------------------------------------------
# One rank


class CheckFailed(Exception):
    """A stage of the check failed; the message is the diagnosis printed for this rank."""


@dataclass(frozen=True)
class _RankEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    host: str
    agent_store: bool  # torchrun's agent hosts the store; every rank is a client
    attempt: int

    @property
    def who(self) -> str:
        return f"[{self.host}:{self.rank}/{self.world_size}]"


@dataclass(frozen=True)
class _RankResult:
    rank: int
    local_rank: int
    host: str
    device: str
    all_reduce_ms: float
    memory: str


def _read_rank_env() -> _RankEnv:
    values: dict[str, int] = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        raw = os.environ.get(name)
        if raw is None:
            raise CheckFailed(f"environment variable {name} is not set (start with torchrun, or use --nproc)")
        try:
            values[name] = int(raw)
        except ValueError:
            raise CheckFailed(f"environment variable {name} must be an integer, got {raw!r}") from None
    rank, world_size = values["RANK"], values["WORLD_SIZE"]
    if world_size < 1 or not 0 <= rank < world_size:
        raise CheckFailed(f"RANK must be in [0, WORLD_SIZE), got RANK={rank} WORLD_SIZE={world_size}")
    master_addr = os.environ.get("MASTER_ADDR")
    if not master_addr:
        raise CheckFailed("environment variable MASTER_ADDR is not set (start with torchrun, or use --nproc)")
    return _RankEnv(
        rank=rank,
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        master_addr=master_addr,
        master_port=values["MASTER_PORT"],
        host=socket.gethostname(),
        agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


class _Watchdog:
    """Ends this process with a diagnosis when one stage overruns its budget, whatever it is blocked in."""

    def __init__(self, who: str, rank: int, budget_s: float, on_stuck: Callable[[str], None] | None = None) -> None:
        self._who = who
        self._rank = rank
        self._budget_s = budget_s
        self._on_stuck = on_stuck
        self._stage = "start-up"
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nanwatch-doctor-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage `name`; an unexpected error in it becomes that stage's diagnosis."""
        with self._lock:
            self._stage, self._since = name, time.monotonic()
        try:
            yield
        except CheckFailed:
            raise
        except Exception as error:
            raise CheckFailed(f"({name}): {_one_line(error)}") from error

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            with self._lock:
                stage, elapsed = self._stage, time.monotonic() - self._since
            if elapsed > self._budget_s:
                diagnosis = (
                    f"({stage}): stuck for {elapsed:.0f} s, past the timeout; "
                    f"this rank is blocked in {stage} (a peer gone, a firewall, or a hung device)"
                )
                _err(f"{self._who} FAIL {diagnosis}")
                _keep_verdict(verdict_name(self._rank), f"{self._who} FAIL {diagnosis}")
                if self._on_stuck is not None:
                    with contextlib.suppress(Exception):
                        self._on_stuck(diagnosis)
                os._exit(1)  # the main thread is blocked in C++; nothing short of this ends it


def run_rank(args: argparse.Namespace) -> int:
    try:
        rank_env = _read_rank_env()
    except CheckFailed as error:
        _err(f"nanwatch doctor: FAIL: {error}")
        return 1
    if args.debug and any(os.environ.get(name) != value for name, value in _DEBUG_ENV.items()):
        # torch reads its C++ log level and distributed debug level when it is imported, which has happened: start
        # this rank again with them set (same process id, so torchrun keeps track of it).
        sys.stdout.flush()
        sys.stderr.flush()
        command = [sys.executable, "-m", "nanwatch", "doctor", *_rank_args(args)]
        os.execve(sys.executable, command, {**os.environ, **_DEBUG_ENV})
    started_dir = os.environ.get(_STARTED_DIR_ENV)
    if started_dir:
        with contextlib.suppress(OSError):
            Path(started_dir, f"rank{rank_env.rank}").touch()
    report_dir: Path | None = args.report_dir
    if report_dir is not None:
        _remove_stale_results(report_dir, rank_env.rank)

    def record_failure(diagnosis: str) -> None:
        if report_dir is not None:
            _record_failure(report_dir, rank_env, diagnosis)

    watchdog = _Watchdog(rank_env.who, rank_env.rank, args.timeout + _WATCHDOG_GRACE_S, on_stuck=record_failure)
    try:
        return _check_rank(args, rank_env, watchdog)
    except CheckFailed as error:
        _err(f"{rank_env.who} FAIL {error}")
        _keep_verdict(verdict_name(rank_env.rank), f"{rank_env.who} FAIL {error}")
        record_failure(str(error))
        return 1
    finally:
        watchdog.stop()


def _check_rank(args: argparse.Namespace, rank_env: _RankEnv, watchdog: _Watchdog) -> int:
    timeout = timedelta(seconds=args.timeout)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = _pick_device(backend, rank_env)

    with watchdog.stage("rendezvous"):
        store = _connect_store(rank_env, timeout)
    with watchdog.stage("rendezvous"):
        _wait_for_arrivals(store, rank_env, args.timeout)
    with watchdog.stage("init_process_group"):
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", store),  # type: ignore[attr-defined]
            rank=rank_env.rank,
            world_size=rank_env.world_size,
            timeout=timeout,
        )
    try:
        with watchdog.stage("barrier"):
            # monitored_barrier exists only on gloo; a gloo group beside nccl names absent ranks there too.
            monitor = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
            _simulate_absence(rank_env, args.timeout)
            _barrier(monitor, rank_env, timeout)
        with watchdog.stage("all_reduce"):
            all_reduce_ms = _all_reduce(device, rank_env)
        with watchdog.stage("memory"):
            memory = _allocate(device, args.alloc_mb)
        if args.report_dir is not None:
            with watchdog.stage("report_dir"):
                _probe_report_dir(args.report_dir, rank_env.rank)
        verdict = f"{rank_env.who} OK ({backend}, {device}, all_reduce {all_reduce_ms:.2f} ms)"
        _say(verdict)
        _keep_verdict(verdict_name(rank_env.rank), verdict)
        with watchdog.stage("summary"):
            result = _RankResult(
                rank=rank_env.rank,
                local_rank=rank_env.local_rank,
                host=rank_env.host,
                device=str(device),
                all_reduce_ms=all_reduce_ms,
                memory=memory,
            )
            gathered: list[Any] = [None] * rank_env.world_size
            dist.all_gather_object(gathered, asdict(result), group=monitor)
        if rank_env.rank == 0:
            results = [_RankResult(**item) for item in gathered]
            summary = _summary(backend, torch.__version__, results)
            _say(summary)
            _keep_verdict(verdict_name(None), summary)
            if args.report_dir is not None:
                with watchdog.stage("summary"):
                    _write_summary(args.report_dir, summary, backend, results)
    finally:
        # A failed shutdown after a failed check must not hide the diagnosis; the watchdog bounds a hung one.
        with watchdog.stage("shutdown"), contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


def _pick_device(backend: str, rank_env: _RankEnv) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CheckFailed("(device): --backend nccl needs CUDA, but torch.cuda.is_available() is False")
    count = torch.cuda.device_count()
    if rank_env.local_rank >= count:
        raise CheckFailed(
            f"(device): LOCAL_RANK={rank_env.local_rank} but only {count} GPU(s) are visible on {rank_env.host}: "
            f"start at most {count} processes per node, or check CUDA_VISIBLE_DEVICES"
        )
    device = torch.device("cuda", rank_env.local_rank)
    torch.cuda.set_device(device)
    return device


def _connect_store(rank_env: _RankEnv, timeout: timedelta) -> Any:
    where = f"{rank_env.master_addr}:{rank_env.master_port}"
    # Under torchrun the agent already serves the store; started any other way, rank 0 serves it. Rank 0 does not wait
    # for the others in the constructor, so that the arrival check below can name the ranks that never come.
    host_it = rank_env.rank == 0 and not rank_env.agent_store
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            rank_env.master_addr,
            rank_env.master_port,
            rank_env.world_size,
            host_it,
            timeout=timeout,
            wait_for_workers=False,
        )
    except Exception as error:
        if host_it:
            raise CheckFailed(
                f"(rendezvous): rank 0 could not serve the rendezvous store on {where}: {_one_line(error)} "
                f"(port in use? choose another MASTER_PORT)"
            ) from error
        server = "torchrun's agent on node 0" if rank_env.agent_store else "rank 0"
        raise CheckFailed(
            f"(rendezvous): could not reach the rendezvous store at {where}, served by {server}, within "
            f"{timeout.total_seconds():g} s: {_one_line(error)}. Rank 0 never started, or MASTER_ADDR/MASTER_PORT "
            f"is wrong or blocked by a firewall"
        ) from error
    return dist.PrefixStore(f"nanwatch-doctor/{rank_env.attempt}", store)  # type: ignore[attr-defined]


def _wait_for_arrivals(store: Any, rank_env: _RankEnv, timeout_s: float) -> None:
    """Name the ranks that never reached the rendezvous, instead of failing later with a bare socket timeout."""
    me = {"host": rank_env.host, "pid": os.getpid(), "local_rank": rank_env.local_rank}
    store.set(f"arrived/{rank_env.rank}", json.dumps(me))
    missing = set(range(rank_env.world_size))
    deadline = time.monotonic() + timeout_s
    while True:
        missing = {rank for rank in missing if not store.check([f"arrived/{rank}"])}
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not missing:
        return
    arrived = sorted(set(range(rank_env.world_size)) - missing)
    seen = ", ".join(f"{rank} on {json.loads(store.get(f'arrived/{rank}'))['host']}" for rank in arrived[:16])
    more = f" and {len(arrived) - 16} more" if len(arrived) > 16 else ""
    raise CheckFailed(
        f"(rendezvous): {_ranks_phrase(sorted(missing))} never arrived within {timeout_s:g} s "
        f"({len(arrived)} of {rank_env.world_size} arrived: rank {seen}{more}). Was every process started, with "
        f"the same WORLD_SIZE={rank_env.world_size}, MASTER_ADDR and MASTER_PORT?"
    )


def _keep_verdict(name: str, text: str) -> None:
    """Under `nanwatch doctor --nproc`, leave this rank's verdict where the launcher prints it from, once torchrun is
    done (torchrun's own output goes to a log file); started any other way, the lines on stdout/stderr are all."""
    directory = os.environ.get(_STARTED_DIR_ENV)
    if directory:
        with contextlib.suppress(OSError):
            atomic_write(Path(directory, name), text + "\n")


def _simulate_absence(rank_env: _RankEnv, timeout_s: float) -> None:
    raw = os.environ.get(SIMULATE_ABSENT_RANK_ENV)
    if raw is None or raw.strip() != str(rank_env.rank):
        return
    _err(f"{rank_env.who} {SIMULATE_ABSENT_RANK_ENV}={raw}: this rank stays away from the barrier (testing aid)")
    # Longer than the others' timeout; the watchdog (or torchrun, once a peer fails) ends this process.
    time.sleep(timeout_s + 2 * _WATCHDOG_GRACE_S)


_MONITORED_FAILURE = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def _barrier(group: Any, rank_env: _RankEnv, timeout: timedelta) -> None:
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except Exception as error:
        seconds = f"{timeout.total_seconds():g} s"
        match = _MONITORED_FAILURE.search(str(error))
        if match:
            ranks = sorted(int(r) for r in re.findall(r"\d+", match.group(1)))
            raise CheckFailed(
                f"(barrier): {_ranks_phrase(ranks)} joined the process group but did not reach the barrier within "
                f"{seconds}: stuck or crashed after start-up"
            ) from error
        if rank_env.rank != 0:
            # torch's text here is always the same preamble; what differs is the transport error at its end.
            cause = _one_line(error).rpartition("Original exception:")[2].strip()
            raise CheckFailed(
                f"(barrier): no answer from rank 0, which checks the barrier, within {seconds}: rank 0's own line "
                f"names the rank it waited for, unless rank 0 itself is stuck or gone ({cause})"
            ) from error
        raise CheckFailed(f"(barrier): {_one_line(error)}") from error


def _all_reduce(device: torch.device, rank_env: _RankEnv) -> float:
    # Warm-up first: on nccl the first collective also builds the communicator, which is not what we time.
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)
    tensor = torch.full((_ALL_REDUCE_NUMEL,), float(rank_env.rank + 1), dtype=torch.float32, device=device)
    _synchronize(device)
    start = time.perf_counter()
    dist.all_reduce(tensor)
    _synchronize(device)
    elapsed_ms = (time.perf_counter() - start) * 1000.0
    expected = rank_env.world_size * (rank_env.world_size + 1) / 2
    wrong = int((tensor != expected).sum().item())
    if wrong or float(warm.item()) != rank_env.world_size:
        found = tensor[tensor != expected][0].item() if wrong else warm.item()
        raise CheckFailed(
            f"(all_reduce): the sum is wrong in {wrong or 1} element(s): expected {expected:g}, got {found:g} "
            f"(data corrupted in transit, or ranks disagree on WORLD_SIZE)"
        )
    return elapsed_ms


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocate(device: torch.device, alloc_mb: float) -> str:
    numel = int(alloc_mb * (1 << 20))
    try:
        block = torch.ones(numel, dtype=torch.uint8, device=device)
        total = int(block.sum(dtype=torch.int64).item())
    except RuntimeError as error:  # CUDA out of memory, or a device that cannot be used at all
        raise CheckFailed(f"(memory): could not allocate {alloc_mb:g} MiB on {device}: {_one_line(error)}") from error
    if total != numel:
        raise CheckFailed(f"(memory): {alloc_mb:g} MiB on {device} read back wrong ({total} of {numel} bytes set)")
    del block
    if device.type == "cuda":
        free, capacity = torch.cuda.mem_get_info(device)
        return f"{free / (1 << 30):.1f} of {capacity / (1 << 30):.1f} GiB free"
    return f"{alloc_mb:g} MiB allocated"


def _probe_report_dir(report_dir: Path, rank: int) -> None:
    """Create `report_dir` and write a file there, as the watcher does when it reports: fail here, not then."""
    probe = report_dir / f".{SUMMARY_STEM}-probe-rank{rank}-{os.getpid()}"
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("nanwatch doctor: can this rank write here?\n", encoding="utf-8")
        probe.unlink()
    except OSError as error:
        raise CheckFailed(
            f"(report_dir): cannot write to report_dir {str(report_dir)!r}: {error.strerror or error}; a watched run "
            f"with this config would lose its reports on this rank"
        ) from error


def _remove_stale_results(report_dir: Path, rank: int) -> None:
    # A result left by an earlier check must not pass for this one's, whatever happens to this one.
    stems = [f"{SUMMARY_STEM}-rank{rank}", *([SUMMARY_STEM] if rank == 0 else [])]
    for stem in stems:
        for suffix in (".txt", ".json"):
            with contextlib.suppress(OSError):
                (report_dir / f"{stem}{suffix}").unlink(missing_ok=True)


def _write_summary(report_dir: Path, summary: str, backend: str, results: list[_RankResult]) -> None:
    data = {
        "ok": True,
        "time": _now(),
        "world_size": len(results),
        "backend": backend,
        "torch": torch.__version__,
        "all_reduce_mib": _ALL_REDUCE_NUMEL * 4 / (1 << 20),
        "ranks": [asdict(result) for result in sorted(results, key=lambda r: r.rank)],
    }
    try:
        atomic_write(report_dir / f"{SUMMARY_STEM}.txt", summary + "\n")
        atomic_write(report_dir / f"{SUMMARY_STEM}.json", json.dumps(data, indent=2) + "\n")
    except OSError as error:
        raise CheckFailed(
            f"(summary): cannot write the summary to report_dir {str(report_dir)!r}: {error.strerror or error}"
        ) from error


def _record_failure(report_dir: Path, rank_env: _RankEnv, diagnosis: str) -> None:
    """Best effort: the diagnosis is on stderr already, and report_dir may be what failed."""
    data = {
        "ok": False,
        "time": _now(),
        "rank": rank_env.rank,
        "world_size": rank_env.world_size,
        "host": rank_env.host,
        "diagnosis": diagnosis,
    }
    stem = f"{SUMMARY_STEM}-rank{rank_env.rank}"
    with contextlib.suppress(OSError):
        report_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(report_dir / f"{stem}.txt", f"{rank_env.who} FAIL {diagnosis}\n")
        atomic_write(report_dir / f"{stem}.json", json.dumps(data, indent=2) + "\n")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _summary(backend: str, torch_version: str, results: list[_RankResult]) -> str:
    hosts: dict[str, list[_RankResult]] = {}
    for result in sorted(results, key=lambda r: r.rank):
        hosts.setdefault(result.host, []).append(result)
    fastest = min(results, key=lambda r: r.all_reduce_ms)
    slowest = max(results, key=lambda r: r.all_reduce_ms)
    lines = [
        f"nanwatch doctor: all {len(results)} ranks OK on {len(hosts)} host{'s' if len(hosts) != 1 else ''} "
        f"(backend {backend}, torch {torch_version})"
    ]
    for host, members in hosts.items():
        devices = sorted({m.device for m in members})
        lines.append(f"  {host}: ranks {_compact([m.rank for m in members])} on {', '.join(devices)}")
    lines.append(
        f"  all_reduce of {_ALL_REDUCE_NUMEL * 4 / (1 << 20):g} MiB: fastest {fastest.all_reduce_ms:.2f} ms "
        f"(rank {fastest.rank}), slowest {slowest.all_reduce_ms:.2f} ms (rank {slowest.rank})"
    )
    memories = sorted({r.memory for r in results})
    if len(memories) == 1:
        lines.append(f"  memory: {memories[0]} on every rank")
    else:
        lines.extend(f"  memory, rank {r.rank}: {r.memory}" for r in sorted(results, key=lambda r: r.rank))
    return "\n".join(lines)
