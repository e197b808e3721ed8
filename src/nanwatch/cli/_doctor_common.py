"""What `nanwatch doctor`'s launcher (`doctor`) and each rank it starts (`_doctor_rank`) share: the environment
variables between them, the names of the files a rank leaves, the options a rank runs with, and the line helpers.

Below both, so neither imports the other for it (the rank's module, which imports torch, stays out of `--help`).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["SIMULATE_ABSENT_RANK_ENV", "SUMMARY_STEM", "verdict_name"]

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


def verdict_name(rank: int | None) -> str:
    """The file a rank started by `--nproc` leaves its verdict line in (rank None: rank 0's summary)."""
    return "verdict-summary.txt" if rank is None else f"verdict-rank{rank}.txt"


def _rank_args(args: argparse.Namespace) -> list[str]:
    """The options each rank runs with: everything but the launcher's own."""
    rank_args = ["--timeout", f"{args.timeout:g}", "--backend", args.backend, "--alloc-mb", f"{args.alloc_mb:g}"]
    # The config was read here already: each rank gets the fields doctor uses, not the file.
    if args.report_dir is not None:
        rank_args += ["--report-dir", str(args.report_dir)]
    return [*rank_args, "--debug"] if args.debug else rank_args


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
