"""`nanwatch doctor`: can every process of a distributed job reach the others?

Run it the way the real job runs (`torchrun --nproc_per_node N -m nanwatch doctor`), or let it start torchrun itself
(`nanwatch doctor --nproc N`). Every rank joins the rendezvous, initialises the process group (nccl where CUDA is
there, gloo otherwise), passes a barrier, runs an all_reduce whose sum it checks, allocates memory on its device and
prints one line `[host:rank/world] OK (backend, device, all_reduce ms)`; rank zero then prints a summary.

Nothing waits forever: every stage has the `--timeout`, a rank that never arrives is named (from the rendezvous
store before the process group exists, by `monitored_barrier` on a gloo group after), and a watchdog ends a rank
that is stuck anywhere else with a line saying where it was stuck.

With a config (`--config FILE` or the options generated from `WatchConfig`) that sets `report_dir`, every rank also
checks that it can write there, as a watched run with that config will, and the result is kept on disk: rank zero
writes the summary to `nanwatch-doctor.txt` / `.json`, and a failing rank its diagnosis to
`nanwatch-doctor-rank{R}.txt` / `.json` (each file written whole, or not at all).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanwatch.cli_config import ToolHelpFormatter, add_config_arguments, fields_epilog, tool_config

__all__ = ["register", "find_free_port", "torchrun_command", "USED_FIELDS", "SUMMARY_STEM"]

DEFAULT_TIMEOUT_S = 60.0

# Testing aid (documented in docs/doctor.md): the rank named here sleeps instead of entering the barrier, so the
# other ranks see a real process that joined the group but never arrives, and must name it.
SIMULATE_ABSENT_RANK_ENV = "NANWATCH_DOCTOR_SIMULATE_ABSENT_RANK"
# Set by `nanwatch doctor --nproc` for the workers it starts: each one touches a file there, so the launcher can tell
# "the workers never started" (torchrun's rendezvous failed) from "a worker failed a check".
_STARTED_DIR_ENV = "NANWATCH_DOCTOR_STARTED_DIR"
_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_CPP_LOG_LEVEL": "INFO"}
# A stage may overrun its own timeout by this much (process start-up, slow first CUDA call) before the watchdog ends it.
_WATCHDOG_GRACE_S = 15.0
_ALL_REDUCE_NUMEL = 1 << 20  # float32 elements: 4 MiB, big enough to exercise the transport, small enough for a CPU
# In report_dir: rank zero's summary, and each failing rank's diagnosis (`{SUMMARY_STEM}-rank{R}`), as .txt and .json.
SUMMARY_STEM = "nanwatch-doctor"

# The WatchConfig fields `nanwatch doctor` applies, and what each does here (printed by --help).
USED_FIELDS = {
    "report_dir": f"every rank checks that it can create and write this directory, as a watched run with this "
    f"config will (a rank that cannot fails, named); rank 0 writes the summary there as {SUMMARY_STEM}.txt and "
    f".json, and a failing rank its diagnosis as {SUMMARY_STEM}-rank{{R}}.txt and .json",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `doctor` subcommand."""
    parser = subparsers.add_parser(
        "doctor",
        help="check that the processes of a distributed job can reach each other",
        description=(
            "Distributed health check. Under torchrun (torchrun --nproc_per_node N -m nanwatch doctor) every rank "
            "joins the process group, passes a barrier, checks an all_reduce and allocates memory on its device. "
            "Outside torchrun, `nanwatch doctor --nproc N` starts torchrun itself. Exit status 0 when every rank is "
            "OK, 1 when a check failed or a rank never arrived (named on stderr), 2 on bad input."
        ),
        epilog=fields_epilog("doctor", USED_FIELDS),
        formatter_class=ToolHelpFormatter,
    )
    launch = parser.add_argument_group("launching (ignored when already started by torchrun)")
    launch.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        metavar="N",
        help="processes on this node (default: one per GPU, or 1)",
    )
    launch.add_argument("--nnodes", type=_positive_int, default=1, metavar="N", help="number of nodes (default: 1)")
    launch.add_argument(
        "--node-rank", type=_non_negative_int, default=0, metavar="R", help="this node's rank (default: 0)"
    )
    launch.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="HOST",
        help="address of the node with --node-rank 0 (default: 127.0.0.1)",
    )
    launch.add_argument(
        "--master-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="rendezvous port on the master node (default: a free port when --nnodes is 1, else 29500)",
    )
    check = parser.add_argument_group("checks")
    check.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"seconds each stage may take before the missing ranks are named (default: {DEFAULT_TIMEOUT_S:g})",
    )
    check.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="process group backend (default: nccl when CUDA is available, else gloo)",
    )
    check.add_argument(
        "--alloc-mb",
        type=_positive_float,
        default=64.0,
        metavar="MIB",
        help="MiB to allocate on each device (default: 64)",
    )
    check.add_argument(
        "--debug",
        action="store_true",
        help="run with NCCL_DEBUG=INFO and TORCH_DISTRIBUTED_DEBUG=DETAIL (and TORCH_CPP_LOG_LEVEL=INFO)",
    )
    add_config_arguments(parser, used=USED_FIELDS)
    parser.set_defaults(func=_handle, parser=parser)


def _handle(args: argparse.Namespace) -> int:
    # Read before anything starts: a bad config file ends the command (exit 2) with no process launched.
    settings = tool_config(args, args.parser)
    args.report_dir = settings.config.report_dir
    if os.environ.get("RANK", "0") == "0":  # once, not once per rank
        for flag in settings.unused_options(USED_FIELDS):
            _err(f"nanwatch doctor: note: {flag} is not used by doctor (see nanwatch doctor --help)")
    if _started_by_launcher(os.environ):
        if args.nproc is not None:
            _err("nanwatch doctor: --nproc is ignored: this process was already started by a launcher (RANK is set)")
        return _run_rank(args)
    return _launch(args)


# --------------------------------------------------------------------------------------------------------------------
# Launching torchrun


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def torchrun_command(
    *,
    nproc: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    timeout: float,
    doctor_args: Sequence[str] = (),
) -> list[str]:
    """The torchrun command line that `nanwatch doctor --nproc N` runs (also printed, so it can be reused by hand).

    Args:
        nproc: processes on this node.
        nnodes: number of nodes.
        node_rank: this node's rank.
        master_addr: address of node 0, which hosts the rendezvous.
        master_port: port of the rendezvous on node 0.
        timeout: seconds torchrun's rendezvous waits for the other nodes.
        doctor_args: extra arguments for `nanwatch doctor` on each rank.

    Returns:
        The argument vector, starting with the current Python interpreter.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
    ]
    if nnodes > 1:
        # The static rendezvous otherwise waits 600 s for a node that was never started.
        command.append(f"--rdzv_conf=timeout={math.ceil(timeout)}")
    return [*command, "-m", "nanwatch", "doctor", *doctor_args]


def _launch(args: argparse.Namespace) -> int:
    nproc = args.nproc if args.nproc is not None else _default_nproc()
    if args.node_rank >= args.nnodes:
        _err(f"nanwatch doctor: --node-rank must be below --nnodes={args.nnodes}, got {args.node_rank}")
        return 2
    port = args.master_port
    if port is None:
        port = find_free_port() if args.nnodes == 1 else 29500
    command = torchrun_command(
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=port,
        timeout=args.timeout,
        doctor_args=_rank_args(args),
    )
    _err("nanwatch doctor: running " + " ".join(command))
    with tempfile.TemporaryDirectory(prefix="nanwatch-doctor-") as started_dir:
        env = {**os.environ, _STARTED_DIR_ENV: started_dir}
        if args.debug:
            env.update(_DEBUG_ENV)
        # Every rank's stages are bounded by their own watchdogs and torchrun's rendezvous by its timeout; this
        # outer bound only catches torchrun itself misbehaving.
        deadline_s = 6 * (args.timeout + _WATCHDOG_GRACE_S) + 60
        returncode = _run_bounded(command, env, deadline_s)
        started = sorted(path.name for path in Path(started_dir).iterdir())
    if returncode == 0:
        return 0
    if returncode is None:
        _err(f"nanwatch doctor: FAILED: torchrun did not finish within {deadline_s:g} s and was stopped.")
        return 1
    if not started:
        where = f"{args.master_addr}:{port}"
        if args.nnodes > 1:
            _err(
                f"nanwatch doctor: FAILED: no worker started on this node (node rank {args.node_rank}): torchrun's "
                f"rendezvous at {where} did not see all {args.nnodes} nodes within {math.ceil(args.timeout)} s. "
                f"Start `nanwatch doctor` on every node with the same --nnodes, --master-addr and --master-port and "
                f"a distinct --node-rank, and check that node 0 accepts connections on port {port}."
            )
        else:
            _err(
                f"nanwatch doctor: FAILED: torchrun exited with status {returncode} before any worker started; "
                f"is port {port} on {args.master_addr} already in use? Its own error is above."
            )
        return 1
    _err(f"nanwatch doctor: FAILED (torchrun exit status {returncode}); the FAIL lines above name the rank and stage.")
    return 1


def _rank_args(args: argparse.Namespace) -> list[str]:
    """The options each rank runs with: everything but the launcher's own."""
    rank_args = ["--timeout", f"{args.timeout:g}", "--backend", args.backend, "--alloc-mb", f"{args.alloc_mb:g}"]
    # The config was read here already: each rank gets the fields doctor uses, not the file.
    if args.report_dir is not None:
        rank_args += ["--report-dir", str(args.report_dir)]
    return [*rank_args, "--debug"] if args.debug else rank_args


def _run_bounded(command: list[str], env: dict[str, str], deadline_s: float) -> int | None:
    # A new session, so that on overrun the whole tree we started (torchrun and its workers) can be stopped together.
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return process.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        process.wait()
        raise


def _default_nproc() -> int:
    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


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


def _started_by_launcher(env: Mapping[str, str]) -> bool:
    return "RANK" in env and "WORLD_SIZE" in env


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

    def __init__(self, who: str, budget_s: float, on_stuck: Callable[[str], None] | None = None) -> None:
        self._who = who
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
                if self._on_stuck is not None:
                    with contextlib.suppress(Exception):
                        self._on_stuck(diagnosis)
                os._exit(1)  # the main thread is blocked in C++; nothing short of this ends it


def _run_rank(args: argparse.Namespace) -> int:
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

    watchdog = _Watchdog(rank_env.who, args.timeout + _WATCHDOG_GRACE_S, on_stuck=record_failure)
    try:
        return _check_rank(args, rank_env, watchdog)
    except CheckFailed as error:
        _err(f"{rank_env.who} FAIL {error}")
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
        _say(f"{rank_env.who} OK ({backend}, {device}, all_reduce {all_reduce_ms:.2f} ms)")
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
        _write_whole(report_dir / f"{SUMMARY_STEM}.txt", summary + "\n")
        _write_whole(report_dir / f"{SUMMARY_STEM}.json", json.dumps(data, indent=2) + "\n")
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
        _write_whole(report_dir / f"{stem}.txt", f"{rank_env.who} FAIL {diagnosis}\n")
        _write_whole(report_dir / f"{stem}.json", json.dumps(data, indent=2) + "\n")


def _write_whole(path: Path, text: str) -> None:
    # Written beside, then renamed over: a reader never sees half a file, and a failed write leaves none.
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


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


# --------------------------------------------------------------------------------------------------------------------
# Small helpers


def _ranks_phrase(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_compact(ranks)}"


def _compact(numbers: list[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `"0-2, 5, 7-8"`."""
    parts: list[str] = []
    ordered = sorted(numbers)
    start = previous = ordered[0]
    for number in [*ordered[1:], None]:
        if number is not None and number == previous + 1:
            previous = number
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if number is not None:
            start = previous = number
    return ", ".join(parts)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = text.rstrip(".")
    return (text[:400] + "...") if len(text) > 400 else text or type(error).__name__


def _say(line: str) -> None:
    # The doctor's result is its standard output; full lines, flushed, so ranks' lines do not interleave mid-line.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def _positive_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(_number(text, float))
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(_number(text, int))
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1-65535, got {value}")
    return value
