"""How a config mistake reads: pydantic's validation errors as one line naming each field, and received values echoed
cut short.

Apart from `WatchConfig` because every entry point (the model, file reading, the CLI's options) says a mistake the same
way, and none of that wording is the model's.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Sequence

from pydantic import ValidationError

__all__ = ["describe", "echo", "shorten", "unknown_field"]

# Echoed inputs are cut to this many characters: a message must fit on a screen, whatever was passed in.
_ECHO = 120


def describe(error: ValidationError, source: str, fields: Sequence[str]) -> str:
    """One line for every problem in `error`, after `source`; an unknown field gets a "did you mean" among `fields`."""
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(root)"
        if item["type"] == "extra_forbidden":
            problems.append(unknown_field(field, fields))
        elif not item["loc"]:  # a rule across fields (capture_on_detect needs report_dir)
            problems.append(item["msg"].removeprefix("Value error, "))
        else:
            message = item["msg"].removeprefix("Value error, ")
            problems.append(f"field {field!r}: {message} (got {echo(item.get('input'))})")
    return f"{source}: " + "; ".join(problems)


def unknown_field(field: str, fields: Sequence[str]) -> str:
    """What an unknown field's mistake says: the field (cut short), and the known field it was likely meant to be, or
    where the known fields are listed; one short line, not the whole list."""
    near = difflib.get_close_matches(field, list(fields), n=1)
    hint = f"did you mean {near[0]!r}?" if near else "`nanwatch config` lists the fields"
    return f"unknown field {shorten(repr(field), 60)} ({hint})"


def echo(value: object) -> str:
    """A received value as a message shows it: its repr, cut short (a shared YAML alias can be enormous)."""
    return shorten(_REPR.repr(value), _ECHO)


_REPR = reprlib.Repr()  # attributes set one by one: Python 3.10 and 3.11 take no keywords here
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 6, 6, 60, 60


def shorten(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters (the last three "...") when it is longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
