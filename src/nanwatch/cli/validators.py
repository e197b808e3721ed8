"""The argparse `type=` checks every nanwatch command shares: text to a value, or one line saying what was wrong.

argparse puts `argument --FLAG: ` before the message, and `nanwatch.cli.usage` adds what to do, so a bad value reads
`nanwatch diff: argument --rtol: expected a finite number >= 0, got '-1'; see nanwatch diff --help`. Each check says
what it expected and echoes the text given.

The commands' own options use the named checks below (`NON_NEGATIVE_INT`, `POSITIVE_FLOAT`, ...); the options
generated from `WatchConfig` (`nanwatch.cli.options`) use `typed`, `choice` and `or_none`, and leave the fields'
bounds to the model. Light: no pydantic, no torch.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "NONE_WORDS",
    "Number",
    "NON_NEGATIVE_INT",
    "POSITIVE_INT",
    "NON_NEGATIVE_FLOAT",
    "POSITIVE_FLOAT",
    "ABS_MAX",
    "RANK_COUNT",
    "RANK",
    "PORT",
    "SECONDS",
    "choice",
    "metavar",
    "noun",
    "or_none",
    "typed",
]

# The words an optional option takes for "no value" (`--abort-after-batch-num none` clears what a config file set).
NONE_WORDS = frozenset({"none", "null"})

# What a value of each kind is called in a message, with and without its article, and its metavar.
_NOUNS: dict[Any, tuple[str, str, str]] = {
    int: ("an integer", "integers", "N"),
    float: ("a number", "numbers", "X"),
    str: ("a string", "strings", "TEXT"),
    Path: ("a path", "paths", "PATH"),
}


def noun(kind: Any, *, plural: bool = False) -> str:
    """How messages name a value of `kind` (int: `an integer`, or `integers` with `plural`); repr for others."""
    names = _NOUNS.get(kind)
    return repr(kind) if names is None else names[1 if plural else 0]


def metavar(kind: Any) -> str:
    """The placeholder `--help` shows for a value of `kind` (int: `N`, float: `X`, str: `TEXT`, Path: `PATH`)."""
    names = _NOUNS.get(kind)
    return "VALUE" if names is None else names[2]


def typed(kind: Callable[[str], Any], what: str | None = None) -> Callable[[str], Any]:
    """A check that converts with `kind` (int, float, str, Path) and says `expected WHAT, got 'TEXT'` otherwise.

    Args:
        kind: the conversion.
        what: how the message names the value expected (default: `noun(kind)`, e.g. `an integer`).
    """
    expected = what or noun(kind)

    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None

    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


def choice(choices: Sequence[Any]) -> Callable[[str], Any]:
    """A check that returns the one of `choices` whose text is given (`Literal["zero", "all"]`'s values)."""

    def pick(text: str) -> Any:
        for value in choices:
            if text == str(value):
                return value
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(str, choices))}, got {text!r}")

    return pick


def or_none(check: Callable[[str], Any]) -> Callable[[str], Any]:
    """`check`, except that `none` or `null` (any case) is None: an optional field's value cleared."""

    def optional(text: str) -> Any:
        return None if text.lower() in NONE_WORDS else check(text)

    return optional


@dataclass(frozen=True)
class Number:
    """A check for a whole or a finite number within bounds; bad text gets `expected ..., got 'TEXT'`.

    Attributes:
        kind: int or float (a float must be finite: inf and nan are refused).
        minimum: the smallest value allowed, if any.
        above: a bound the value must be greater than, if any.
        maximum: the largest value allowed, if any.
        what: how the message names text that is no number (default: `a whole number`, `a number`).
        requirement: what a value out of bounds is told (default: `expected a whole number >= 1`,
            `expected a finite number > 0`, ... from the bounds).
    """

    kind: type[int] | type[float]
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    what: str = ""
    requirement: str = ""

    def __call__(self, text: str) -> Any:
        default_what = "a whole number" if self.kind is int else "a number"
        value = typed(self.kind, self.what or default_what)(text)
        if not self._allows(value):
            raise argparse.ArgumentTypeError(f"{self.requirement or self._default_requirement()}, got {text!r}")
        return value

    def _allows(self, value: float) -> bool:
        return (
            math.isfinite(value)
            and (self.minimum is None or value >= self.minimum)
            and (self.above is None or value > self.above)
            and (self.maximum is None or value <= self.maximum)
        )

    def _default_requirement(self) -> str:
        limits = ((">=", self.minimum), (">", self.above), ("<=", self.maximum))
        bounds = " and ".join(f"{sign} {limit:g}" for sign, limit in limits if limit is not None)
        return f"expected {'a whole number' if self.kind is int else 'a finite number'} {bounds}".rstrip()


# A count or an index: `demo --steps`, `diff --context`.
NON_NEGATIVE_INT = Number(int, minimum=0)
# Something there must be at least one of: `plot --top`, `--depth`, `--dpi`.
POSITIVE_INT = Number(int, minimum=1)
# A tolerance: `diff --rtol`, `--atol`.
NON_NEGATIVE_FLOAT = Number(float, minimum=0)
# A rate or a size: `demo --lr`.
POSITIVE_FLOAT = Number(float, above=0)
# An abs max on a log scale: `plot --vmin`, `--vmax`.
ABS_MAX = Number(float, above=0, what="a number such as 1e-3", requirement="expected a finite abs max > 0")

# `nanwatch doctor`'s launcher options, in the wording its users (and torchrun's) know.
RANK_COUNT = Number(int, minimum=1, what="an integer")
RANK = Number(int, minimum=0, what="an integer")
PORT = Number(int, minimum=1, maximum=65535, what="an integer", requirement="expected a TCP port in 1-65535")
SECONDS = Number(float, above=0, requirement="must be a positive, finite number")
