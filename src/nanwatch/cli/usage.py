"""How the `nanwatch` command fails: one line on stderr, exit status 2, no usage block and no traceback.

Every error a command meets, a mistyped option or a file of the wrong kind alike, ends as

    nanwatch <command>: <what was wrong>; <what to do>

with exit status 2 (`USAGE_ERROR`), which no command uses for anything else: 1 keeps its meaning per command
("replay differs", "diff diverges", "a doctor check failed", "the demo did not overflow"). A bug in nanwatch itself
is one line too, with exit status 3 (`INTERNAL_ERROR`). `NANWATCH_DEBUG=1` adds the traceback above the line.

Imports nothing heavy: `nanwatch --help` builds its parser from this module and the command table alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn

__all__ = [
    "OK",
    "USAGE_ERROR",
    "INTERNAL_ERROR",
    "INTERRUPTED",
    "CliError",
    "CommandParser",
    "debug_enabled",
    "error_line",
    "report_error",
]

OK = 0
USAGE_ERROR = 2  # bad input of any kind: an option, a config, a file; never a command's own verdict
INTERNAL_ERROR = 3  # nanwatch itself failed: a bug to report
INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
DEBUG_ENV = "NANWATCH_DEBUG"
_MAX_MESSAGE = 1200  # characters: a line must fit in a terminal's scrollback, whatever an error holds


class CliError(Exception):
    """A command cannot go on: `what` was wrong, and `todo` says what to do about it.

    Args:
        what: what was received and why it does not do (one sentence, no full stop).
        todo: what the user can do instead (one sentence, no full stop).
    """

    def __init__(self, what: str, todo: str) -> None:
        super().__init__(f"{what}; {todo}")
        self.what = what
        self.todo = todo


class CommandParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are a `CliError` (one line, see `--help`) instead of a usage block and exit."""

    def error(self, message: str) -> NoReturn:
        raise CliError(_clean(message), f"see {self.prog} --help")


def debug_enabled() -> bool:
    """Whether `NANWATCH_DEBUG` asks for tracebacks (any value but empty, 0, false, no)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in {"", "0", "false", "no"}


def error_line(prog: str, error: BaseException) -> str:
    """The one line that says what went wrong and what to do, for an error a command ended with."""
    if isinstance(error, CliError):
        what, todo = error.what, error.todo
    else:
        what, todo = _clean(str(error)) or type(error).__name__, _todo_for(prog, error)
    line = f"{prog}: {_clean(what)}; {_clean(todo)}"
    return line if len(line) <= _MAX_MESSAGE else line[: _MAX_MESSAGE - 3] + "..."


def report_error(prog: str, error: BaseException, *, internal: bool = False) -> int:
    """Print the error's line on stderr (the traceback above it with `NANWATCH_DEBUG=1`); return the exit status."""
    if debug_enabled():
        traceback.print_exception(error, file=sys.stderr)
    if internal:
        line = (
            f"{prog}: nanwatch failed with {type(error).__name__}: {_clean(str(error))}; this is a bug in nanwatch: "
            f"run again with {DEBUG_ENV}=1 for the traceback, and report it"
        )
        print(line[:_MAX_MESSAGE], file=sys.stderr)
        return INTERNAL_ERROR
    print(error_line(prog, error), file=sys.stderr)
    return USAGE_ERROR


def _todo_for(prog: str, error: BaseException) -> str:
    # Imported here: the error classes are light, but this module is on the path of `nanwatch --help`.
    from nanwatch.errors import ConfigError, JsonlError, PlotError, ReplayError

    if isinstance(error, ConfigError):
        return "fix the config file or the option (nanwatch config prints every field with its default)"
    if isinstance(error, JsonlError):
        return "give a .jsonl file nanwatch wrote in report_dir (nanwatch-report-*.jsonl or nanwatch-trace-rank*.jsonl)"
    if isinstance(error, PlotError | ReplayError):
        return f"see {prog} --help"
    if isinstance(error, OSError):
        return "check the path and its permissions"
    return f"see {prog} --help"


def _clean(text: str) -> str:
    """One line: newlines and runs of spaces become one space; no trailing full stop or semicolon."""
    return " ".join(text.split()).rstrip(".;")
