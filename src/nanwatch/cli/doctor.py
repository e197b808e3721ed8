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
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from nanwatch.cli import COMMANDS
from nanwatch.cli._doctor_common import (
    _DEBUG_ENV,
    _STARTED_DIR_ENV,
    _WATCHDOG_GRACE_S,
    SIMULATE_ABSENT_RANK_ENV,
    SUMMARY_STEM,
    _err,
    _rank_args,
    _ranks_phrase,
    _say,
    verdict_name,
)
from nanwatch.cli._doctor_common import (
    _compact as _compact,  # tests reach it here
)
from nanwatch.cli.options import ToolHelpFormatter, add_config_arguments, fields_epilog, tool_config
from nanwatch.cli.usage import CliError
from nanwatch.cli.validators import PORT, POSITIVE_FLOAT, RANK, RANK_COUNT, SECONDS

__all__ = [
    "register",
    "find_free_port",
    "torchrun_command",
    "verdict_name",
    "USED_FIELDS",
    "SUMMARY_STEM",
    "SIMULATE_ABSENT_RANK_ENV",
]

DEFAULT_TIMEOUT_S = 60.0

_SEE_HELP = "see nanwatch doctor --help"

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
        help=COMMANDS["doctor"].summary,
        description=(
            "Distributed health check. Under torchrun (torchrun --nproc_per_node N -m nanwatch doctor) every rank "
            "joins the process group, passes a barrier, checks an all_reduce and allocates memory on its device. "
            "Outside torchrun, `nanwatch doctor --nproc N` starts torchrun itself, keeps torchrun's output in a log "
            "file it names on stderr, and prints the verdict last, alone on stdout: one line per rank, then the "
            "summary. Exit status 0 when every rank is OK, 1 when a check failed or a rank never arrived (named), "
            "2 on bad input (one line on stderr)."
        ),
        epilog=fields_epilog("doctor", USED_FIELDS),
        formatter_class=ToolHelpFormatter,
    )
    launch = parser.add_argument_group("launching (ignored when already started by torchrun)")
    launch.add_argument(
        "--nproc",
        type=RANK_COUNT,
        default=None,
        metavar="N",
        help="processes on this node (default: one per GPU, or 1)",
    )
    launch.add_argument("--nnodes", type=RANK_COUNT, default=1, metavar="N", help="number of nodes (default: 1)")
    launch.add_argument("--node-rank", type=RANK, default=0, metavar="R", help="this node's rank (default: 0)")
    launch.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="HOST",
        help="address of the node with --node-rank 0 (default: 127.0.0.1)",
    )
    launch.add_argument(
        "--master-port",
        type=PORT,
        default=None,
        metavar="PORT",
        help="rendezvous port on the master node (default: a free port when --nnodes is 1, else 29500)",
    )
    check = parser.add_argument_group("checks")
    check.add_argument(
        "--timeout",
        type=SECONDS,
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
        type=POSITIVE_FLOAT,
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
    settings = tool_config(args)
    args.report_dir = settings.config.report_dir
    if os.environ.get("RANK", "0") == "0":  # once, not once per rank
        for flag in settings.unused_options(USED_FIELDS):
            _err(f"nanwatch doctor: note: {flag} is not used by doctor (see nanwatch doctor --help)")
    if _started_by_launcher(os.environ):
        if args.nproc is not None:
            _err("nanwatch doctor: --nproc is ignored: this process was already started by a launcher (RANK is set)")
        from nanwatch.cli._doctor_rank import run_rank  # torch.distributed: only on a rank

        return run_rank(args)
    return _launch(args)


def _started_by_launcher(env: Mapping[str, str]) -> bool:
    return "RANK" in env and "WORLD_SIZE" in env


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
        raise CliError(f"--node-rank must be below --nnodes={args.nnodes}, got {args.node_rank}", _SEE_HELP)
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
    log = _log_path(args.report_dir)
    _err(f"nanwatch doctor: running {' '.join(command)}")
    _err(f"nanwatch doctor: torchrun's own output goes to {log}")
    with tempfile.TemporaryDirectory(prefix="nanwatch-doctor-") as started_dir:
        env = {**os.environ, _STARTED_DIR_ENV: started_dir}
        if args.debug:
            env.update(_DEBUG_ENV)
        # Every rank's stages are bounded by their own watchdogs and torchrun's rendezvous by its timeout; this
        # outer bound only catches torchrun itself misbehaving.
        deadline_s = 6 * (args.timeout + _WATCHDOG_GRACE_S) + 60
        returncode = _run_bounded(command, env, deadline_s, log)
        found = {path.name: path for path in Path(started_dir).iterdir()}
        started = sorted(int(name[len("rank") :]) for name in found if name.startswith("rank"))
        verdicts = [_read(found[verdict_name(rank)]) for rank in started if verdict_name(rank) in found]
        silent = [rank for rank in started if verdict_name(rank) not in found]
        summary = _read(found[verdict_name(None)]) if verdict_name(None) in found else None
    # The verdict comes last, and alone on stdout: each rank's line in rank order, then rank 0's summary or why not.
    lines = [*verdicts, *([summary] if summary is not None else [])]
    if returncode is None:
        lines.append(f"nanwatch doctor: FAILED: torchrun did not finish within {deadline_s:g} s and was stopped")
    elif returncode != 0 and not started:
        where = f"{args.master_addr}:{port}"
        if args.nnodes > 1:
            lines.append(
                f"nanwatch doctor: FAILED: no worker started on this node (node rank {args.node_rank}): torchrun's "
                f"rendezvous at {where} did not see all {args.nnodes} nodes within {math.ceil(args.timeout)} s. "
                f"Start `nanwatch doctor` on every node with the same --nnodes, --master-addr and --master-port and "
                f"a distinct --node-rank, and check that node 0 accepts connections on port {port}"
            )
        else:
            lines.append(
                f"nanwatch doctor: FAILED: torchrun exited with status {returncode} before any worker started; "
                f"is port {port} on {args.master_addr} already in use? torchrun's own error is in {log}"
            )
    elif returncode != 0:
        gone = f"; {_ranks_phrase(silent)} ended with no verdict (crashed?)" if silent else ""
        lines.append(
            f"nanwatch doctor: FAILED (torchrun exit status {returncode}){gone}; the FAIL lines name the rank and "
            f"stage, torchrun's own output is in {log}"
        )
    for line in lines:
        _say(line)
    return 0 if returncode == 0 else 1


def _log_path(report_dir: Path | None) -> Path:
    """Where torchrun's output goes: report_dir when the config names one (it is kept with the summary), else a
    fresh file in the temporary directory, kept for reading."""
    if report_dir is not None:
        with contextlib.suppress(OSError):
            report_dir.mkdir(parents=True, exist_ok=True)
            path = report_dir / f"{SUMMARY_STEM}-torchrun.log"
            path.write_bytes(b"")
            return path
    handle, name = tempfile.mkstemp(prefix=f"{SUMMARY_STEM}-torchrun-", suffix=".log")
    os.close(handle)
    return Path(name)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8").rstrip("\n")


def _run_bounded(command: list[str], env: dict[str, str], deadline_s: float, log: Path) -> int | None:
    # A new session, so that on overrun the whole tree we started (torchrun and its workers) can be stopped together.
    with log.open("ab") as output:
        process = subprocess.Popen(command, env=env, start_new_session=True, stdout=output, stderr=subprocess.STDOUT)
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
    import torch  # only to count GPUs: `nanwatch doctor --help` never imports it

    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
