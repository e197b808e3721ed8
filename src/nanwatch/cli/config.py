"""`nanwatch config [NAME]`: print a config file installed with nanwatch, so `nanwatch config > my.yaml` starts one.

`default` (every `WatchConfig` field at its default, each explained in a comment) and `trace` (a first look at a run
that goes inf/nan) are package data, `nanwatch/configs/*.yaml`; the repository's `configs/` holds the same files
(a test keeps them equal, and checks that each one loads as a `WatchConfig`). Reading them imports neither pydantic
nor torch.

Exit status: 0, or 2 for a name that is not one of them.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from typing import Any

from nanwatch.cli import COMMANDS
from nanwatch.cli.usage import CliError

__all__ = ["register", "preset_names", "preset_text"]


def preset_names() -> list[str]:
    """The config files installed with nanwatch, by name (`default`, `trace`)."""
    folder = resources.files("nanwatch").joinpath("configs")
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def preset_text(name: str = "default") -> str:
    """The text of the installed config file `name`.

    Raises:
        CliError: no config file of that name is installed.
    """
    names = preset_names()
    if name not in names:
        raise CliError(f"no config named {name!r}", f"the installed ones are {', '.join(names)}")
    return resources.files("nanwatch").joinpath("configs", f"{name}.yaml").read_text(encoding="utf-8")


def _run(args: argparse.Namespace) -> int:
    sys.stdout.write(preset_text(args.name))
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "config",
        help=COMMANDS["config"].summary,
        description=(
            "Print a config file installed with nanwatch: `default` lists every WatchConfig field at its default, "
            "each explained; `trace` is a first look at a run that goes inf/nan. `nanwatch config > my.yaml`, edit, "
            "then pass my.yaml to watch(), any adapter, or --config FILE. Exit status: 0, or 2 for an unknown NAME."
        ),
    )
    parser.add_argument("name", nargs="?", default="default", metavar="NAME", help="default (the default) or trace")
    parser.set_defaults(func=_run)
