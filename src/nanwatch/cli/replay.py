"""`nanwatch replay FILE --model MODULE:FACTORY`: run the forward that went inf/nan again (see `nanwatch.replay`).

Exit status: 0 when the replay matches the original report value for value, 1 when it differs or stays finite, 2 on
bad input (a file that is no capture, a factory that cannot be imported or raises, a device this torch cannot use):
one line on stderr, the user's traceback with NANWATCH_DEBUG=1.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanwatch.cli import COMMANDS
from nanwatch.cli.inputs import Kind, sniff
from nanwatch.cli.options import add_config_arguments, tool_config
from nanwatch.cli.usage import CliError

if TYPE_CHECKING:
    import torch

__all__ = ["register", "USED_FIELDS", "usable_device"]

# The WatchConfig fields `nanwatch replay` applies (the others do not apply to one forward run again).
USED_FIELDS = ("max_frames_to_save", "report_dir")


def usable_device(text: str) -> torch.device:
    """The device `--device` names, once torch has shown it can put a tensor there.

    Raises:
        CliError: torch does not know the name, or this torch (its build, the machine) cannot use that device.
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CliError(
            f"--device {text!r} is not a device name torch knows", "give cpu, cuda, cuda:N, or leave --device out"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a build without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU seen"
        raise CliError(
            f"--device {text}: this torch ({torch.__version__}, {build}) cannot use CUDA here",
            "leave --device out (the forward runs where it first ran, or on the CPU) or give --device cpu",
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CliError(
            f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) are visible here",
            f"give cuda:0 to cuda:{torch.cuda.device_count() - 1}, or check CUDA_VISIBLE_DEVICES",
        )
    try:
        torch.empty(1, device=device)
    except Exception as error:  # AssertionError, RuntimeError: whatever the backend raises when it is not there
        raise CliError(
            f"--device {text}: torch cannot put a tensor there ({type(error).__name__}: {error})",
            "leave --device out or give --device cpu",
        ) from None
    return device


def _run(args: argparse.Namespace) -> int:
    kind = sniff(Path(args.file))
    if kind.kind is not Kind.CAPTURE and kind.kind is not Kind.TORCH:
        raise CliError(
            f"{args.file} is {kind.what}",
            "replay reads the replay-rank{R}-batch{N}.pt file that capture_on_detect=True writes in report_dir",
        )
    config = tool_config(args).config
    device = usable_device(args.device) if args.device is not None else None
    # The console script, unlike `python -m`, does not put the current directory on the path; a factory in the
    # project being debugged (`tests.models:factory`, `train:build_model`) is expected to import from there.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    from nanwatch.replay import UserCodeFailed, replay, write_replay_outputs  # torch: only when a replay runs

    try:
        result = replay(
            args.file, args.model, device=device, max_frames_to_save=config.max_frames_to_save, trusted=args.trusted
        )
    except UserCodeFailed as error:
        raise CliError(
            f"{error}{_where(error.__cause__)}", "fix it in your code (NANWATCH_DEBUG=1 shows its traceback)"
        ) from error
    where = f" on rank {result.rank}" if result.world_size > 1 else ""
    text = "\n".join(
        [
            f"nanwatch replay of {result.counter}={result.batch_number}{where} from {result.path}",
            f"model: {result.model_class}, rebuilt by {args.model}, on {result.device}",
            "",
            result.trace_text(),
            "",
            result.summary(),
        ]
    )
    print(text)
    if config.report_dir is not None:
        for written in write_replay_outputs(config.report_dir, result, text):
            print(f"written: {written}")
    return 0 if result.matches_original else 1


def _where(cause: BaseException | None) -> str:
    """` (at train.py:12)`: the innermost line of the user's code that raised, so the one line says where to look."""
    if cause is None or cause.__traceback__ is None:
        return ""
    frames = traceback.extract_tb(cause.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay",
        help=COMMANDS["replay"].summary,
        description=(
            "Rebuild the model, restore the weights, buffers, inputs and RNG states saved by capture_on_detect=True, "
            "and run that one forward with every module traced. Exit status: 0 when the replay matches the original "
            "report value for value, 1 when it differs or stays finite, 2 on bad input (one line on stderr). Of the "
            "watch config, a replay uses max_frames_to_save (frames in its report) and report_dir (where its text "
            "and JSON go, as nanwatch-replay-rank{R}-batch{N}.txt/.json)."
        ),
    )
    parser.add_argument("file", help="a replay-rank{R}-batch{N}.pt file from report_dir")
    parser.add_argument(
        "--model", required=True, metavar="MODULE:FACTORY", help="a callable returning the model, e.g. train:build"
    )
    parser.add_argument(
        "--device", default=None, help="where to run, e.g. cpu or cuda:0 (default: where the forward first ran)"
    )
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="allow inputs that are Python objects (unpickling runs their code: only for files you trust)",
    )
    add_config_arguments(parser, used=USED_FIELDS)
    parser.set_defaults(func=_run)
