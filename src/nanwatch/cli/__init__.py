"""The `nanwatch` command. Each subcommand lives in its own module and registers itself here.

Only the module of the command being run is imported: `nanwatch --help` and `--version` import none of them (no
pydantic, no torch), `nanwatch show FILE` imports `show` alone. Errors are one line each (`nanwatch.cli.usage`).

Exit status, for every command: 0 when it did what it was asked, 2 for bad input of any kind (an option, a config, a
file), 3 when nanwatch itself failed (a bug), 130 when interrupted. 1 means something of its own to each command
(`diff`: the two diverge; `replay`: the replay differs from the original; `repro`: the last run is not finite;
`doctor`: a check failed; `demo`: no inf/nan within --steps); `show`, `plot` and `config` never exit 1.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from nanwatch._version import __version__
from nanwatch.cli.usage import INTERRUPTED, USAGE_ERROR, CliError, CommandParser, report_error

__all__ = ["main", "build_parser", "COMMANDS", "SUBCOMMAND_MODULES", "Command", "version_text"]


@dataclass(frozen=True)
class Command:
    """A subcommand: the module that defines `register(subparsers)`, and the line `nanwatch --help` shows for it."""

    module: str
    summary: str


# In the order `nanwatch --help` lists them: a new user's first command first.
COMMANDS: dict[str, Command] = {
    "demo": Command("nanwatch.cli.demo", "train a small fp16 model on the CPU until it overflows, and show the report"),
    "config": Command("nanwatch.cli.config", "print the default config file, every field explained (> my.yaml)"),
    "show": Command("nanwatch.cli.show", "print a report or trace .jsonl as the text nanwatch wrote"),
    "diff": Command("nanwatch.cli.diff", "show where two traced batches (or two runs) first diverge"),
    "plot": Command("nanwatch.cli.plot", "draw abs max per module per batch: a heatmap, or lines near the dtype's max"),
    "replay": Command(
        "nanwatch.cli.replay", "run the forward that went inf/nan again from its replay file, every module traced"
    ),
    "repro": Command(
        "nanwatch.cli.repro",
        "run the module that went inf/nan again alone, from its capsule, in another dtype or backend",
    ),
    "doctor": Command("nanwatch.cli.doctor", "check that the processes of a distributed job can reach each other"),
}
SUBCOMMAND_MODULES: tuple[str, ...] = tuple(command.module for command in COMMANDS.values())


def version_text() -> str:
    """`nanwatch X (torch Y, Python Z)`: what a bug report needs, read without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = f"torch {version('torch')}"
    except PackageNotFoundError:
        torch_version = "torch not installed"
    python = ".".join(str(part) for part in sys.version_info[:3])
    return f"nanwatch {__version__} ({torch_version}, Python {python})"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print nanwatch's version (and torch's) and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(version_text())
        parser.exit()


def build_parser(only: str | None = None, *, lazy: bool = False) -> argparse.ArgumentParser:
    """The `nanwatch` parser with every subcommand in full; with `only` or `lazy`, only `only` in full.

    Args:
        only: the one command whose module is imported and whose options are added (the others are listed by
            `--help` but parse nothing).
        lazy: with `only` None, no command in full: what `nanwatch --help` needs, without importing any of them.
    """
    parser = CommandParser(
        prog="nanwatch",
        description="Find where a PyTorch run goes inf/nan, and show the numbers that led there.",
        epilog="Run nanwatch COMMAND --help for a command's options. Tracebacks: NANWATCH_DEBUG=1.",
    )
    parser.add_argument("--version", action=_VersionAction)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for name, command in COMMANDS.items():
        if name == only or (only is None and not lazy):
            importlib.import_module(command.module).register(subparsers)
        else:
            subparsers.add_parser(name, help=command.summary, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `nanwatch` with `argv` (default: the process's arguments); return the exit status, never raise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((token for token in argv if not token.startswith("-")), None)
    prog = f"nanwatch {name}" if name in COMMANDS else "nanwatch"
    try:
        if name is not None and name not in COMMANDS and argv and argv[0] == name:
            raise CliError(f"unknown command {name!r}{_near(name)}", f"the commands are {', '.join(COMMANDS)}")
        parser = build_parser(only=name if name in COMMANDS else None, lazy=True)
        args, extra = parser.parse_known_args(argv)
        if extra:  # said here, with the command's own name: argparse would name the top-level parser
            raise CliError(f"unrecognized arguments: {' '.join(extra)}", f"see {prog} --help")
        if getattr(args, "func", None) is None:
            raise CliError("no command given", f"the commands are {', '.join(COMMANDS)} (see nanwatch --help)")
        return int(args.func(args) or 0)
    except SystemExit as stop:  # --help and --version end here, as does a command that exits on its own
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else USAGE_ERROR)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as error:
        from nanwatch.errors import NanwatchError  # light; imported only when something failed

        expected = isinstance(error, CliError | NanwatchError | OSError)
        return report_error(prog, error, internal=not expected)


def _near(name: str) -> str:
    match = difflib.get_close_matches(name, list(COMMANDS), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


if __name__ == "__main__":
    sys.exit(main())
