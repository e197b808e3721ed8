"""The argparse checks every command shares (`nanwatch.cli.validators`): a bad value is one line that names the option,
what it expected and what it got."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import nanwatch.cli
from nanwatch.cli import main, validators
from nanwatch.cli.validators import (
    ABS_MAX,
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    PORT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    RANK,
    RANK_COUNT,
    SECONDS,
    Number,
)


def _error(check: Callable[[str], Any], text: str, capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser(prog="prog")
    parser.add_argument("--value", type=check)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--value", text])
    assert stop.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    ("check", "text", "message"),
    [
        (NON_NEGATIVE_INT, "ten", "expected a whole number, got 'ten'"),
        (NON_NEGATIVE_INT, "-1", "expected a whole number >= 0, got '-1'"),
        (NON_NEGATIVE_INT, "1.5", "expected a whole number, got '1.5'"),
        (POSITIVE_INT, "0", "expected a whole number >= 1, got '0'"),
        (NON_NEGATIVE_FLOAT, "-1", "expected a finite number >= 0, got '-1'"),
        (NON_NEGATIVE_FLOAT, "nan", "expected a finite number >= 0, got 'nan'"),
        (NON_NEGATIVE_FLOAT, "x", "expected a number, got 'x'"),
        (POSITIVE_FLOAT, "0", "expected a finite number > 0, got '0'"),
        (POSITIVE_FLOAT, "inf", "expected a finite number > 0, got 'inf'"),
        (ABS_MAX, "0", "expected a finite abs max > 0, got '0'"),
        (ABS_MAX, "big", "expected a number such as 1e-3, got 'big'"),
        (RANK_COUNT, "two", "expected an integer, got 'two'"),
        (RANK_COUNT, "0", "expected a whole number >= 1, got '0'"),
        (RANK, "-1", "expected a whole number >= 0, got '-1'"),
        (PORT, "65536", "expected a TCP port in 1-65535, got '65536'"),
        (PORT, "http", "expected an integer, got 'http'"),
        (SECONDS, "0", "must be a positive, finite number, got '0'"),
        (Number(int, minimum=2, maximum=8), "9", "expected a whole number >= 2 and <= 8, got '9'"),
        (validators.typed(int), "many", "expected an integer, got 'many'"),
        (validators.typed(float), "x", "expected a number, got 'x'"),
        (validators.choice(("zero", "all")), "one", "expected one of zero, all, got 'one'"),
        (validators.or_none(validators.typed(int)), "nothing", "expected an integer, got 'nothing'"),
    ],
)
def test_a_bad_value_names_the_option_what_was_expected_and_what_came(
    check: Callable[[str], Any], text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _error(check, text, capsys) == f"prog: error: argument --value: {message}"


def test_a_good_value_comes_back_converted() -> None:
    assert NON_NEGATIVE_INT("0") == 0
    assert POSITIVE_INT(" 7 ") == 7
    assert NON_NEGATIVE_FLOAT("0") == 0.0
    assert POSITIVE_FLOAT("1e-3") == 1e-3
    assert ABS_MAX("1e5") == 1e5
    assert PORT("65535") == 65535
    assert SECONDS("0.5") == 0.5
    assert isinstance(POSITIVE_INT("3"), int)
    assert isinstance(POSITIVE_FLOAT("3"), float)
    assert validators.typed(Path)("runs") == Path("runs")
    assert validators.choice(("zero", "all"))("all") == "all"
    assert validators.or_none(validators.typed(int))("None") is None
    assert validators.or_none(validators.typed(int))("null") is None
    assert validators.or_none(validators.typed(int))("4") == 4


def test_a_float_must_be_finite_even_without_bounds() -> None:
    for text in ("inf", "-inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a finite number, got '{text}'"):
            Number(float)(text)
    assert math.isclose(Number(float)("-2.5"), -2.5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--steps", "-3"], "nanwatch demo: argument --steps: expected a whole number >= 0, got '-3'"),
        (
            ["diff", "a", "b", "--atol", "inf"],
            "nanwatch diff: argument --atol: expected a finite number >= 0, got 'inf'",
        ),
        (["plot", "a", "-o", "a.png", "--top", "0"], "nanwatch plot: argument --top: expected a whole number >= 1"),
        (["doctor", "--master-port", "0"], "nanwatch doctor: argument --master-port: expected a TCP port in 1-65535"),
        (
            ["show", "a", "--max-frames-to-save", "x"],
            "nanwatch show: argument --max-frames-to-save: expected an integer",
        ),
    ],
)
def test_every_command_says_it_the_same_way(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert err.endswith(f"; see nanwatch {argv[0]} --help\n"), err  # and what to do


def test_only_the_validators_module_writes_a_check() -> None:
    # A check written again in a command (`def _positive(text)`, raising ArgumentTypeError) belongs in validators.
    folder = Path(nanwatch.cli.__file__).parent
    writers = sorted(path.name for path in folder.glob("*.py") if "ArgumentTypeError(" in path.read_text("utf-8"))
    assert writers == ["validators.py"]
