"""`nanwatch replay FILE --model MODULE:FACTORY`: run the forward that went inf/nan again (see `nanwatch.replay`)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

from nanwatch.cli.options import add_config_arguments, config_from_args
from nanwatch.errors import ConfigError, ReplayError

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    # The console script, unlike `python -m`, does not put the current directory on the path; a factory in the
    # project being debugged (`tests.models:factory`, `train:build_model`) is expected to import from there.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    from nanwatch.replay import UserCodeFailed, replay, write_replay_outputs  # torch: only when a replay runs

    try:
        config = config_from_args(args)
        result = replay(
            args.file,
            args.model,
            device=args.device,
            max_frames_to_save=config.max_frames_to_save,
            trusted=args.trusted,
        )
    except (ReplayError, ConfigError) as error:
        if isinstance(error, UserCodeFailed) and error.__cause__ is not None:
            traceback.print_exception(error.__cause__, file=sys.stderr)
        print(f"nanwatch replay: error: {error}", file=sys.stderr)
        return 2
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


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="run the forward that went inf/nan again from its replay file, with every module traced",
        description=(
            "Rebuild the model, restore the weights, buffers, inputs and RNG states saved by capture_on_detect=True, "
            "and run that one forward with every module traced. Exit status: 0 when the replay matches the original "
            "report value for value, 1 when it differs or stays finite, 2 on bad input. Of the watch config, a "
            "replay uses max_frames_to_save (frames in its report) and report_dir (where its text and JSON go, as "
            "nanwatch-replay-rank{R}-batch{N}.txt/.json); the other fields do not apply to it."
        ),
    )
    parser.add_argument("file", help="a replay-rank{R}-batch{N}.pt file from report_dir")
    parser.add_argument(
        "--model", required=True, metavar="MODULE:FACTORY", help="a callable returning the model, e.g. train:build"
    )
    parser.add_argument("--device", default=None, help="where to run (default: where the forward first ran)")
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="allow inputs that are Python objects (unpickling runs their code: only for files you trust)",
    )
    add_config_arguments(parser)
    parser.set_defaults(func=_run)
