"""`nanwatch repro CAPSULE [--dtype D] [--backend B]`: run the module a capsule holds again, alone, in this process.

First as recorded (its dtype, autocast and compile backend), then, when `--dtype` or `--backend` asks for it, the
variant: one line per run, finite or not, with the output's abs max.

Exit status: 0 when the last run is finite, 1 when it is not, 2 on bad input (a file that is not a capsule, a capsule
of a newer format, a module class that does not import here, a bad option, a last run that could not run): one line
on stderr, the traceback with NANWATCH_DEBUG=1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from nanwatch.cli import COMMANDS
from nanwatch.cli.inputs import Kind, sniff
from nanwatch.cli.usage import CliError

__all__ = ["register", "DTYPES", "BACKENDS"]

DTYPES = ("float32", "float16", "bfloat16", "float64")
BACKENDS = ("eager", "aot_eager", "inductor")
_WHAT_TO_GIVE = "repro reads the nanwatch-capsule-rank{R}-batch{N}.pt file a detection writes in report_dir"


def _run(args: argparse.Namespace) -> int:
    path = Path(args.capsule)
    sniffed = sniff(path)
    if sniffed.kind is Kind.CAPTURE:
        raise CliError(f"{path} is {sniffed.what}", f"replay it with nanwatch replay {path} --model MODULE:FACTORY")
    if sniffed.kind not in (Kind.TORCH, Kind.CAPSULE):  # a capsule by its name, or any torch file to check
        raise CliError(f"{path} is {sniffed.what}", _WHAT_TO_GIVE)
    # The console script, unlike `python -m`, does not put the current directory on the path; the module's class is
    # often defined in the project being debugged, and imported from there.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    # torch: only when a capsule is run
    from nanwatch.cli._repro_run import recorded_spec, requested_spec, run_device, run_once
    from nanwatch.core.formats.capsule import CapsuleError, read_capsule

    try:
        capsule = read_capsule(path)
        name = f"module {capsule.module_name!r}" if capsule.module_name else "the model"
        print(
            f"nanwatch repro of {name} ({capsule.module_class}), batch {capsule.batch_number} on rank {capsule.rank}, "
            f"from {path}"
        )
        if capsule.note:
            print(f"note: {capsule.note}")
        for line in capsule.dropped:
            print(f"left out of the capsule: {line}")
        where = run_device(capsule)
        if where.note is not None:
            print(where.note)
        specs = [recorded_spec(capsule, where.device)]
        if args.dtype is not None or args.backend is not None:
            specs.append(requested_spec(capsule, where.device, dtype=args.dtype, backend=args.backend))
        for spec in specs:
            outcome = run_once(capsule, spec, where.device)
            print(f"{spec.label}: {spec.describe(where.device)}: {outcome.describe()}")
    except CapsuleError as error:
        what, _, todo = str(error).rpartition("; ")
        raise CliError(what or todo, todo if what else "see nanwatch repro --help") from error
    if outcome.error is not None:
        raise CliError(
            f"the last run ({spec.label}: {spec.describe(where.device)}) failed: {outcome.error}",
            "the error is the module's own or the backend's: try another --dtype or --backend",
        )
    return 0 if outcome.finite else 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "repro",
        help=COMMANDS["repro"].summary,
        description=(
            "Rebuild the module a nanwatch capsule holds (its class, weights and buffers) and call it again on the "
            "inputs it was called with, in this process, alone: first as recorded (its dtype, autocast and "
            "torch.compile backend), then as --dtype and --backend ask, each run one line: finite or not, and the "
            "output's abs max. Loading the module unpickles it: run only capsules you trust. Exit status: 0 when the "
            "last run is finite, 1 when it is not, 2 on bad input (not a capsule, a newer format, a class that does "
            "not import here, a run that cannot run; one line on stderr)."
        ),
    )
    parser.add_argument("capsule", metavar="CAPSULE", help="a nanwatch-capsule-rank{R}-batch{N}.pt file")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="run it again in this dtype too: the module and the floating-point inputs cast, autocast off",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="run it again compiled with this torch.compile backend too (eager: not compiled)",
    )
    parser.set_defaults(func=_run)
