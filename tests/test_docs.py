"""The docs are tested: every Python and console block of README.md and docs/*.md runs here, its shown output
compared, or is marked illustrative where this test sees the mark.

Sybil (https://sybil.readthedocs.io) parses the Markdown; each document runs in a folder of its own (with the
repository's examples/, benchmarks/, configs/ and tests/ linked in, and an empty docs/ for the plots), its blocks in
order:

- ```` ```python ````: executed in the document's namespace, from that folder; what it prints, stdout and stderr
  together as a terminal shows them (the `nanwatch` logger's lines, warnings under Python's default filters), is
  kept for a ```` ```console ```` block right after it that holds no `$` line.
- ```` ```python NAME ```` (or ```` ```yaml NAME ````, any language and a file name): written to NAME in that folder,
  for the commands that follow (`$ python train.py`).
- ```` ```console ````: each `$ command` (a line ending in `\\` goes on) runs in bash in that folder, stdout and
  stderr together as a terminal shows them, and what it printed must be the lines below it. In those lines, a line
  `...` (or `[...]`) stands for any lines, `...` inside a line for any text on that line, and a last line
  `(exit N)` for the exit status; `$ echo $?` prints the status of the command before.
- `<!-- skip: next "illustrative: why" -->` before a block: not run (Sybil's skip directive); the reason says why,
  and a skipped block that shows output (any line but a `$` command, in a block other than Python) names the
  test that runs that case (`tests/...py`).
- `<!-- invisible-code-block: python ... -->`: Python the reader does not need to see that sets up what a block
  shows (a run whose files the block reads), or makes the run whose output the console block after it shows.

Every block is run or marked illustrative, whatever its language: a block in ```` ``` ```` or ```` ```text ````
that shows output is made a console block (after the Python block or the command that prints it) or marked. The
one exception is a block whose language is bash, yaml, json or toml alone (NOT_RUN: what a reader types, a file's
format): it is not run. A block that is neither run nor marked fails here, naming its file and line.

Shown against printed: text exactly, numbers within a tolerance.

- A number with a fractional part or an exponent (`1.20e-02`, `4008.0`, `-0.00e+00`) is a measurement: it matches a
  printed number in the same notation (a `%8.2e` number has two decimals on both sides; one without an exponent may
  have other digits, `%.4g` prints 325.96 as `326`) within RTOL = 5 % of the larger of the two, or within ATOL = 1e-6
  near zero.
- An abs min (the first of nanwatch's two columns, `abs min  abs max`) is judged on its tensor's scale: within 5 % of
  its line's abs max; beside an abs max of inf or nan, any finite abs min matches.
- A number without a point or an exponent (a batch, a rank, an optimizer step, a count, an exit status) is a
  counter: text, exact. So are `inf` and `nan`, and the digits of a name (`h.1.fc2`, `2.down`) or a version
  (`2.13.0`).

Why these bounds. The outputs come from real runs on one CPU; another CPU's kernels (vector width, summation order)
round last digits otherwise, and a training run carries those differences on. Between two CPUs, over the few steps
the docs' runs take, abs maxes and losses differed by up to 2 % (`2.00e+06` against `2.04e+06`), and one unit of the
last printed digit alone is up to 1 %: 5 % takes those with room to spare and still fails a number 10 % off. An abs
min is the value nearest zero, where rounding is absolute, not relative: every value of a tensor is off by about the
rounding error of the terms that made it, so which value is nearest zero, and how near, changes from CPU to CPU
(`1.33e-02` against `4.03e-02` in a float16 tensor whose abs max is `1.23e+03`; `6.02e-03` against `1.19e-02` in a
LayerNorm bias of abs max `2.78e+00`). That error is bounded by the tensor's scale, its abs max, and the largest
seen was 0.2 % of it. A tensor that holds inf or nan has no known scale (`4.28e-01` against `8.69e-01` beside
`inf`). A number near zero with no abs max beside it gets the floor of 1e-6 (float16's subnormals are 6e-8 apart; a
float32 sum of terms near 1 errs by about 1e-7).

A run that amplifies rounding is no example for a page, whatever the bound: the float32 run that replay.md showed
(27 steps of weights growing to 1e22) printed numbers 14 % apart between two CPUs, and up to 2x apart under other
kernels on one machine; the runs the pages show overflow within a few to a dozen optimizer steps. To see what
another CPU would print, run this file with `ATEN_CPU_CAPABILITY=default` and `MKL_CBWR=COMPATIBLE` in the
environment (torch's and MKL's kernels for other CPUs): it passes, and the runs' numbers move by at most 2.6 % there
(the HF Trainer example; the others 1 % or less, an abs min judged on its abs max). The tests at the end show the
rule on real output: a page whose numbers all have their last digit changed passes; a wrong module, batch or a
number 10 % off fails.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import subprocess
import sys
import unittest
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = ("examples", "benchmarks", "configs", "tests")  # what the commands in the docs use from the repository
_COMMAND_TIMEOUT_S = 180
_SANDBOX = "__docs_sandbox__"
_OUTPUT = "__docs_last_output__"
_COMPARED = "__docs_compared__"  # (what, shown lines, printed, exit status) of every comparison, in order


def _sandbox(example: Example) -> Path:
    folder: Path = example.namespace[_SANDBOX]
    return folder


# The blocks that must be run or marked: every fence but one whose language is one of these, alone (what a reader
# types, a file's format). Plain ``` and ```text are not among them: output in them is run or marked like any other.
NOT_RUN = ("bash", "yaml", "json", "toml")


# ------------------------------------------------------------------------------------------------------ python


@contextlib.contextmanager
def _chdir(folder: str) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def _show_on_stderr(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _as_a_terminal_shows_it(printed: io.StringIO) -> Iterator[None]:
    """stdout and stderr into `printed`, and warnings printed on stderr under Python's default filters (pytest
    records them instead)."""
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed), warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = _show_on_stderr
        yield


class _PythonInSandbox(PythonEvaluator):
    """Sybil's Python evaluator, run from the document's folder (and importing from it), what it prints kept: stdout
    and stderr together, as a terminal shows them (the `nanwatch` logger's lines and warnings included)."""

    def __call__(self, example: Example) -> None:
        folder = str(_sandbox(example))
        printed = io.StringIO()
        before = set(sys.modules)
        sys.path.insert(0, folder)
        try:
            with _chdir(folder), _as_a_terminal_shows_it(printed):
                super().__call__(example)
        finally:
            sys.path.remove(folder)
            # Modules the block imported from the folder (train.py) belong to this document only.
            for name in set(sys.modules) - before:
                origin = getattr(sys.modules[name], "__file__", None) or ""
                if origin.startswith(folder):
                    del sys.modules[name]
        example.namespace[_OUTPUT] = printed.getvalue()


class PythonParser(PythonCodeBlockParser):
    def __init__(self) -> None:
        super().__init__()
        self.codeblock_parser = CodeBlockParser("python", _PythonInSandbox())


# ------------------------------------------------------------------------------------------------------ files


class FileParser:
    """```` ```LANGUAGE NAME ````: the block is the file NAME, written to the document's folder."""

    _lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<language>\w+) +(?P<name>[\w./-]+)$\n", re.M))

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self._lexer(document):
            region.parsed = (region.lexemes["name"], str(region.lexemes["source"]))
            region.evaluator = self._write
            yield region

    @staticmethod
    def _write(example: Example) -> None:
        name, text = example.parsed
        path = _sandbox(example) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


# ------------------------------------------------------------------------------------------------------ unrun


class UnrunParser:
    """A block that no parser above runs (```` ``` ````, ```` ```text ````, any other language but NOT_RUN's): it
    fails unless a skip mark says why it is illustrative."""

    _lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<language>[^\n]*)$\n", re.M))

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self._lexer(document):
            language = region.lexemes["language"].strip()
            if language in ("python", "console", *NOT_RUN) or " " in language:  # run, not run, or a file block
                continue
            region.parsed = language
            region.evaluator = self._unrun
            yield region

    @staticmethod
    def _unrun(example: Example) -> None:
        shown = f"```{example.parsed}" if example.parsed else "```"
        raise AssertionError(
            f"a {shown} block that nothing runs: show its output in a console block after what prints it, or mark "
            'it <!-- skip: next "illustrative: why (tests/... that runs it)" -->'
        )


# ------------------------------------------------------------------------------------------------------ console


def _commands(block: str) -> Iterator[tuple[str, list[str]]]:
    """(command, the lines shown after it) for each `$ ` line of a console block."""
    command: list[str] | None = None
    shown: list[str] = []
    continuing = False
    for line in block.splitlines():
        if continuing and command is not None:
            command.append(line)
            continuing = line.endswith("\\")
        elif line.startswith("$ "):
            if command is not None:
                yield "\n".join(command), shown
            command, shown = [line[2:]], []
            continuing = line.endswith("\\")
        else:
            shown.append(line)
    if command is not None:
        yield "\n".join(command), shown


# A number with a fractional part or an exponent (`1.20e-02`, `-0.00e+00`, `4008.0`, `0.5`) is a measurement,
# compared within the tolerance; a number without (a batch, a rank, a count, an exit status) is text. A number is
# never a part of a name (`h.1.fc2`, `2.up`), a version (`2.13.0`) or an address: the characters around it are
# neither a word character nor a dot that goes on into one. `inf` and `nan` are words: text.
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?!\w|\.\w)")
# What a shown number without an exponent matches: a number printed by `%g` (`.4g`: `325.6`, or `326`, its point gone).
DECIMAL = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?!\w|\.\w)")
# nanwatch's two columns, abs min then abs max (`%8.2e %8.2e`, inf and nan right-aligned): an abs min is the number
# right before a one-space gap and its abs max, eight characters wide.
ABS_MIN = re.compile(r"(?<![\w.])\d\.\d\de[+-]\d\d(?= (?:\d\.\d\de[+-]\d\d| {5}inf| {5}nan)(?!\S))")
RTOL = 0.05  # relative; see the module's docstring
ATOL = 1e-6  # absolute, for numbers near zero


def _digits_after_point(number: str) -> int | None:
    """A number in scientific notation: how many digits its mantissa has after the point, which its format fixes
    (`%8.2e`: 2); None for a number without an exponent, whose digits may vary with its value (`%.4g`)."""
    mantissa, exponent, _ = number.lower().partition("e")
    return len(mantissa.partition(".")[2]) if exponent else None


def _close(shown: str, printed: str, scale: float = 0.0) -> bool:
    """A printed number is the shown one: the same notation, and within RTOL of the larger of the two and `scale`
    (an abs min's abs max), or within ATOL near zero."""
    if _digits_after_point(shown) != _digits_after_point(printed):
        return False
    a, b = float(shown), float(printed)
    return abs(a - b) <= max(RTOL * max(abs(a), abs(b), scale), ATOL)


def _abs_max_after(line: str, start: int) -> float:
    """The abs max in the column after the abs min at `start`: the scale the abs min is judged against (inf when the
    tensor holds inf or nan: its scale is unknown, so any finite abs min matches)."""
    value = float(line[start:].split(maxsplit=2)[1])
    return value if math.isfinite(value) else math.inf


@functools.lru_cache(maxsize=4096)
def _line_pattern(shown: str) -> tuple[re.Pattern[str], tuple[tuple[str, float], ...]]:
    """A shown line as a pattern (its text exact, `...` any text, each number any number), and its numbers, each with
    the scale it is judged against (its abs max for an abs min, else 0)."""
    numbers: list[tuple[str, float]] = []
    parts = []
    for piece in shown.split("..."):
        pattern, at = [], 0
        minima = {found.start() for found in ABS_MIN.finditer(piece)}
        for found in NUMBER.finditer(piece):
            matches = DECIMAL if _digits_after_point(found[0]) is None else NUMBER
            pattern += [re.escape(piece[at : found.start()]), f"({matches.pattern})"]
            scale = _abs_max_after(piece, found.start()) if found.start() in minima else 0.0
            numbers.append((found[0], scale))
            at = found.end()
        pattern.append(re.escape(piece[at:]))
        parts.append("".join(pattern))
    return re.compile(".*?".join(parts)), tuple(numbers)


def _line_matches(shown: str, printed: str) -> bool:
    pattern, numbers = _line_pattern(shown)
    found = pattern.fullmatch(printed)
    return found is not None and all(
        _close(number, other, scale) for (number, scale), other in zip(numbers, found.groups(), strict=True)
    )


def _lines_match(shown: list[str], printed: list[str]) -> bool:
    """The shown lines against the printed ones: a line `...` (or `[...]`) alone stands for any lines, or none."""
    any_lines = [line.strip() in ("...", "[...]") for line in shown]
    # below[j]: the shown lines after line i match printed[j:] (before the first pass: no shown line is left)
    below = [False] * len(printed) + [True]
    for i in reversed(range(len(shown))):
        here = [False] * (len(printed) + 1)
        for j in reversed(range(len(printed) + 1)):
            if any_lines[i]:
                here[j] = below[j] or (j < len(printed) and here[j + 1])
            else:
                here[j] = j < len(printed) and below[j + 1] and _line_matches(shown[i], printed[j])
        below = here
    return below[0]


def _tidy(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _compare(what: str, shown: list[str], printed: str, status: int | None) -> str | None:
    """None when `printed` (and the exit status, if the block shows one) is what the block shows; else why not."""
    expected = _tidy("\n".join(shown))
    if expected and re.fullmatch(r"\(exit \d+\)", expected[-1]):
        wanted = int(expected.pop()[6:-1])
        if status != wanted:
            return f"{what}: exit status {status}, the docs say {wanted}\n{printed}"
    actual = _tidy(printed)
    if _lines_match(expected, actual):
        return None
    return (
        f"{what}: the output differs from the docs (numbers compared within {RTOL:.0%}, or {ATOL:g} near zero)\n"
        "--- docs\n" + "\n".join(expected) + "\n--- now\n" + "\n".join(actual)
    )


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("NANWATCH_", "PYTEST_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleave as in a terminal
    env["COLUMNS"] = "80"  # argparse wraps --help to the terminal's width
    return env


class ConsoleParser(CodeBlockParser):
    language = "console"

    def __init__(self) -> None:
        super().__init__("console")

    def evaluate(self, example: Example) -> str | None:
        block = str(example.parsed)
        commands = list(_commands(block))
        if not commands:  # the output of the Python block above
            return _compared(example, "the Python block above", block.splitlines(), example.namespace.get(_OUTPUT, ""))
        for command, shown in commands:
            result = subprocess.run(
                ["bash", "-c", command],
                cwd=_sandbox(example),
                env=_environment(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=_COMMAND_TIMEOUT_S,
                check=False,
            )
            if command.strip() == "echo $?":  # the status of the command before, as a shell would say
                printed = f"{example.namespace.get('__docs_previous_status__', 0)}\n"
            else:
                printed = result.stdout
                example.namespace["__docs_previous_status__"] = result.returncode
            failure = _compared(example, f"$ {command}", shown, printed, result.returncode)
            if failure is not None:
                return failure
        return None


def _compared(example: Example, what: str, shown: list[str], printed: str, status: int | None = None) -> str | None:
    example.namespace.setdefault(_COMPARED, []).append((what, shown, printed, status))
    return _compare(what, shown, printed, status)


# ------------------------------------------------------------------------------------------------------ the test

SYBIL = Sybil(parsers=[SkipParser(), FileParser(), PythonParser(), ConsoleParser(), UnrunParser()], path=str(REPO))
FENCE = re.compile(r"^[ \t]*(?:[-*+][ \t]+)?```(?P<info>[^`\n]*)$", re.M)


# A skip mark and the block right after it.
SKIP_MARK = re.compile(
    r"<!-- skip: (?P<mark>.*?) -->\n(?P<fence>[ \t]*```[^\n]*)\n(?P<body>.*?)^[ \t]*```$", re.M | re.S
)


def _fences_to_run(text: str) -> list[int]:
    """Where each block that must be run or marked starts: every opening fence, but those of a NOT_RUN language."""
    starts, inside = [], False
    for found in FENCE.finditer(text):
        info = found["info"].strip()
        if inside:  # a closing fence has no info; anything else is text inside the block
            inside = bool(info)
            continue
        inside = True
        if info not in NOT_RUN:
            starts.append(found.start())
    return starts


def _sandbox_for(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "docs").mkdir()  # where the docs' plots are written (not the repository's docs/)
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    return tmp_path


def _run_page(path: Path, where: object, folder: Path) -> tuple[Document, list[str]]:
    """Run every block of the page at `path` in `folder`: the document, and a failure for each block that raised,
    printed what the page does not show, or is neither run nor marked illustrative."""
    import torch

    # Each page runs as in a fresh process: compiled code an earlier page or test left (why-nan.md compiles a Linear)
    # would make a page that watches a Linear say it dropped it, which depends on the order the tests ran in.
    torch._dynamo.reset()
    document = SYBIL.parse(path)
    document.namespace[_SANDBOX] = _sandbox_for(folder)
    failures: list[str] = []
    handled: set[int] = set()  # where the blocks that ran, or were marked illustrative, start
    for example in document:
        try:
            example.evaluate()
        except unittest.SkipTest:
            pass
        except Exception as error:  # a block that raised, or whose output differs: all are reported together
            failures.append(f"{where}:{example.line}: {type(error).__name__}: {error}")
        handled.add(example.start)
    fences = _fences_to_run(document.text)
    unhandled = [document.text.count("\n", 0, start) + 1 for start in fences if start not in handled]
    if unhandled:
        failures.append(f"{where}: blocks at lines {unhandled} are neither run nor marked illustrative")
    return document, failures


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
@pytest.mark.slow
def test_every_block_runs_as_shown_or_is_marked_illustrative(path: Path, tmp_path: Path) -> None:
    _, failures = _run_page(path, path.relative_to(REPO), tmp_path)
    assert not failures, "\n\n".join(failures)


def test_the_docs_test_sees_drift_and_unmarked_blocks(tmp_path: Path) -> None:
    # The harness itself: a shown output that is not what the command prints, a wrong exit status, and a block
    # that raises are each a failure naming the line; `...` and a skip mark are not.
    page = tmp_path / "page.md"
    page.write_text(
        "```console\n$ echo one; echo two\none\n...\n```\n"  # 1: `...` stands for any lines
        "```console\n$ echo drifted\nas documented\n```\n"  # 6: differs
        "```console\n$ false\n(exit 0)\n```\n"  # 10: the exit status differs
        '<!-- skip: next "illustrative: a test of the mark" -->\n```python\nraise RuntimeError\n```\n'
        "```python\nprint(undefined)\n```\n"  # 18: raises
        "```python\nprint('made', 1 + 1)\n```\n```console\nmade 2\n```\n",  # the output of the block above
        encoding="utf-8",
    )
    document = SYBIL.parse(page)
    document.namespace[_SANDBOX] = _sandbox_for(tmp_path / "sandbox")
    outcomes = []
    for example in document:
        try:
            example.evaluate()
            outcomes.append((example.line, "ok"))
        except unittest.SkipTest:
            outcomes.append((example.line, "marked"))
        except Exception as error:
            outcomes.append((example.line, str(error).splitlines()[-1] if "exit status" not in str(error) else "exit"))
    assert outcomes == [
        (1, "ok"),
        (6, "drifted"),  # the last line of the failure: what the command printed
        (10, "exit"),
        (14, "ok"),  # the skip mark itself
        (15, "marked"),
        (18, "name 'undefined' is not defined"),
        (21, "ok"),
        (24, "ok"),
    ]


# ------------------------------------------------------------------------------------------------------ another CPU
# The shown outputs were printed on one machine; another CPU's kernels round some last digits otherwise (the issue:
# `1.20e-02` shown, `1.22e-02` printed). Simulated here: every nonzero number of a page's shown output with its
# last digit one off. That must pass; a wrong module, batch or a number 10 % off must not.


def _last_digit_off(number: str) -> str:
    """`number` with the last digit of its mantissa one off: `1.20e-02` -> `1.21e-02`, `4008.9` -> `4008.8`."""
    end = len(number.lower().partition("e")[0])
    digit = int(number[end - 1])
    return number[: end - 1] + str(digit + 1 if digit < 9 else digit - 1) + number[end:]


def _as_printed_elsewhere(line: str) -> str:
    """The line as another CPU may print it: every nonzero number's last digit one off (a zero stays exact)."""
    return NUMBER.sub(lambda found: found[0] if float(found[0]) == 0 else _last_digit_off(found[0]), line)


def _ten_percent_more(line: str) -> str:
    """The line with its first nonzero number 10 % larger, in the same notation."""
    number = next(found[0] for found in NUMBER.finditer(line) if float(found[0]) != 0)
    mantissa, exponent, _ = number.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    larger = f"{float(number) * 1.1:.{decimals}{'e' if exponent else 'f'}}"
    return line.replace(number, larger, 1)


CONSOLE_BLOCK = re.compile(r"^```console\n(.*?)^```$", re.M | re.S)


def _page_printed_elsewhere(page: str) -> str:
    """The page with the shown output of every console block (not its commands) as another CPU may print it."""

    def block(found: re.Match[str]) -> str:
        lines, continuing = [], False
        for line in found[1].splitlines(keepends=True):
            command = continuing or line.startswith("$ ")
            continuing = command and line.rstrip("\n").endswith("\\")
            lines.append(line if command else _as_printed_elsewhere(line))
        return "```console\n" + "".join(lines) + "```"

    return CONSOLE_BLOCK.sub(block, page)


@pytest.mark.parametrize(
    ("shown", "printed", "same"),
    [
        ("1.20e-02 2.18e+03 output", "1.22e-02 2.18e+03 output", True),  # the case
        ("1.64e-02 2.00e+06 weight", "1.64e-02 2.04e+06 weight", True),  # docs/replay.md, in float32
        ("9.98e+01 inf output", "1.01e+02 inf output", True),  # across a decade
        ("epoch 0: loss 4008.0", "epoch 0: loss 4012.0", True),  # without an exponent
        ("{'loss': '325.6', 'epoch': '0.125'}", "{'loss': '326', 'epoch': '0.125'}", True),  # `%.4g`: no point
        ("{'loss': '326', 'epoch': '0.125'}", "{'loss': '325.6', 'epoch': '0.125'}", False),  # but 326 is text
        ("0.00e+00 1.50e+02 output", "-0.00e+00 1.50e+02 output", True),  # a signed zero
        ("7.15e-07 5.61e-01 weight", "0.00e+00 5.61e-01 weight", True),  # near zero: within ATOL
        ("1.33e-02 1.23e+03 output", "4.03e-02 1.23e+03 output", True),  # an abs min: within 5 % of its abs max
        ("6.02e-03 2.78e+00 bias", "1.19e-02 2.76e+00 bias", True),
        ("> 2.72e+01 6.24e+04   1.62e+01      inf  output", "> 2.80e+01 6.24e+04   1.62e+01      inf  output", True),
        ("1.20e-02 ... output", "1.22e-02 2.18e+03 output", True),  # `...` in a line still any text
        ("Detected\n...\nloss 1.50", "Detected\none\ntwo\nloss 1.52", True),  # `...` alone: any lines
        ("1.20e-02 2.18e+03 output", "1.20e-02 2.40e+03 output", False),  # 10 % off
        ("epoch 0: loss 4008.0", "epoch 0: loss 4408.8", False),
        ("1.00e-05 price 1.00e+00", "3.00e-06 price 1.00e+00", False),  # past ATOL, and no abs max beside it
        ("1.33e-02 1.23e+03 output", "7.00e+01 1.23e+03 output", False),  # an abs min past 5 % of its abs max
        ("1.24e+04      inf output", "8.69e-01      inf output", True),  # beside inf: any finite abs min
        ("1.24e+04      inf output", "     inf      inf output", False),  # but not inf
        ("1.33e-02 1.23e+03 output", "1.33e-02 1.37e+03 output", False),  # the abs max: relative
        ("1.50e+02 inf output", "1.50e+02 nan output", False),  # inf and nan are words: exact
        ("1.50e+02 inf output", "1.50e+02 6.50e+04 output", False),
        ("1.50e+02 -inf output", "1.50e+02 inf output", False),
        ("1.20e-02 output", "1.2e-02 output", False),  # the notation is the format's: exact
        ("1.20e-02 output", "0.012 output", False),
        ("Detected inf/nan during batch_number=18", "Detected inf/nan during batch_number=19", False),  # counters
        ("during batch_number=18 on rank 0", "during batch_number=18 on rank 1", False),
        ("6 of 6 parameters; optimizer step 9 never ran", "5 of 6 parameters; optimizer step 9 never ran", False),
        ("7 of 44 lines diverge (rtol=0.5)", "7 of 45 lines diverge (rtol=0.5)", False),
        (
            "first non-finite value produced by 2.down (Linear)",
            "first non-finite value produced by 2.up (Linear)",
            False,
        ),
        ("h.1.fc2 Linear", "h.2.fc2 Linear", False),  # a number in a name is text
        ("torch 2.13.0+cpu", "torch 2.14.0+cpu", False),  # and so is a version
    ],
)
def test_numbers_compare_within_the_tolerance_and_the_rest_exactly(shown: str, printed: str, same: bool) -> None:
    assert (_compare("example", shown.splitlines(), printed, None) is None) == same


def test_an_exit_status_is_compared_exactly() -> None:
    assert _compare("example", ["done", "(exit 1)"], "done\n", 1) is None
    assert _compare("example", ["done", "(exit 1)"], "done\n", 2) is not None


# A real report, from a run small enough to repeat: `down` makes the inf, in batch 7.
TINY_RUN = """\
import collections

import torch
from torch import nn

import nanwatch

torch.manual_seed(0)
model = nn.Sequential(collections.OrderedDict(up=nn.Linear(8, 8), act=nn.GELU(), down=nn.Linear(8, 8))).half()
model.down.weight.data *= 1000
try:
    with nanwatch.watch(model, max_frames_to_save=4, headroom_warn_fraction=None) as handle:
        for batch in range(12):
            model(torch.randn(4, 8).half() * 2.0**batch)
            handle.step()
except nanwatch.NonFiniteError:
    pass  # the report: on stderr, from the nanwatch logger
"""


def test_a_report_printed_elsewhere_passes_and_a_wrong_module_batch_or_number_fails(tmp_path: Path) -> None:
    # A page whose Python block prints a real report, followed by that report as shown on five pages: as printed
    # here, as another CPU may print it, and with a wrong module, a number 10 % off, a wrong batch.
    # Compiled code an earlier page left (why-nan.md compiles a Linear) would make this process's run say it dropped
    # it, and the page's run, after it, not.
    import torch

    torch._dynamo.reset()
    printed = io.StringIO()
    with _as_a_terminal_shows_it(printed):
        exec(compile(TINY_RUN, "tiny_run", "exec"), {})  # what the block prints, here (the logger's lines too)
    report = printed.getvalue()
    assert "first non-finite value produced by down (Linear)" in report
    lines = report.splitlines()
    culprit = next(index for index, line in enumerate(lines) if line.startswith("first non-finite value produced by"))
    shown = {
        "as printed": report,
        "elsewhere": "\n".join(map(_as_printed_elsewhere, lines)),
        "module": report.replace("produced by down (Linear)", "produced by up (Linear)"),
        "10 %": "\n".join([*lines[:culprit], _ten_percent_more(lines[culprit]), *lines[culprit + 1 :]]),
        "batch": report.replace("batch_number=7", "batch_number=6"),
    }
    assert len({text.strip() for text in shown.values()}) == len(shown)  # each one a change
    page = tmp_path / "page.md"
    page.write_text(
        f"```python\n{TINY_RUN}```\n" + "".join(f"```console\n{text.strip()}\n```\n" for text in shown.values()),
        encoding="utf-8",
    )

    _, failures = _run_page(page, "page.md", tmp_path / "sandbox")

    text = page.read_text(encoding="utf-8")
    blocks = [text.count("\n", 0, found.start()) + 1 for found in CONSOLE_BLOCK.finditer(text)]
    failed = {int(failure.split(":")[1]) for failure in failures}
    outcomes = {change: "fails" if line in failed else "passes" for change, line in zip(shown, blocks, strict=True)}
    expected = {"as printed": "passes", "elsewhere": "passes", "module": "fails", "10 %": "fails", "batch": "fails"}
    assert outcomes == expected, "\n\n".join(failures)


@pytest.mark.slow
def test_the_readme_as_another_cpu_prints_it_passes_and_a_real_change_does_not(tmp_path: Path) -> None:
    # A copy of README.md whose shown outputs have every nonzero number's last digit one off, run as the test above
    # runs the page itself (the demo trains for real). Then the demo's real output against its shown lines changed
    # as no CPU changes them: a wrong module, a number 10 % off, a wrong batch.
    original = (REPO / "README.md").read_text(encoding="utf-8")
    elsewhere = _page_printed_elsewhere(original)
    changed = [line for line, other in zip(original.splitlines(), elsewhere.splitlines(), strict=True) if line != other]
    assert len(changed) > 20, changed  # the demo's report: every line with a number
    page = tmp_path / "README.md"
    page.write_text(elsewhere, encoding="utf-8")

    document, failures = _run_page(page, "README.md as another CPU prints it", tmp_path / "sandbox")

    assert not failures, "\n\n".join(failures)
    ((what, shown, printed, status),) = [c for c in document.namespace[_COMPARED] if c[0].startswith("$ nanwatch demo")]
    assert _compare(what, shown, printed, status) is None
    culprit = next(index for index, line in enumerate(shown) if line.startswith("first non-finite value produced by"))
    wrong = {
        "module": [line.replace("produced by 4 (Linear)", "produced by 2 (Linear)") for line in shown],
        "10 %": [*shown[:culprit], _ten_percent_more(shown[culprit]), *shown[culprit + 1 :]],
        "batch": [line.replace("batch_number=2", "batch_number=3") for line in shown],
    }
    for change, lines in wrong.items():
        assert lines != shown, change
        assert _compare(what, lines, printed, status) is not None, change


# ------------------------------------------------------------------------------------------------------ skip marks


def _skip_mark_problems(text: str, where: object) -> list[str]:
    """A block is skipped only for a reason the page gives ("illustrative: why"). A skipped block that is neither
    Python nor of a NOT_RUN language shows output if it holds a line that is not a `$ ` command (a console block's
    output, any line of a ```text block): output no run here checks, so its reason names the test that runs the case
    (a file under tests/)."""
    problems = []
    marks = list(SKIP_MARK.finditer(text))
    if len(marks) != len(re.findall(r"^<!-- skip:", text, re.M)):
        problems.append(f"{where}: a skip mark that is not right before a block")
    for found in marks:
        line = text.count("\n", 0, found.start()) + 1
        reason = re.fullmatch(r'next "illustrative: (?P<why>[^"]+)"', found["mark"])
        if reason is None:
            problems.append(f'{where}:{line}: {found["mark"]!r} is not next "illustrative: why"')
            continue
        language = found["fence"].strip()[3:].partition(" ")[0]
        shows_output = language not in ("python", *NOT_RUN) and any(
            text.strip() and not text.strip().startswith("$ ") for text in found["body"].splitlines()
        )
        named = re.findall(r"tests/[\w/]+\.py", reason["why"])
        if shows_output and not (named and all((REPO / test).is_file() for test in named)):
            problems.append(f"{where}:{line}: a skipped block shows output; its reason names no test that runs it")
    return problems


def test_every_skip_mark_says_why_and_hides_no_output_that_nothing_checks() -> None:
    problems = [
        problem
        for path in DOCUMENTS
        for problem in _skip_mark_problems(path.read_text(encoding="utf-8"), path.relative_to(REPO))
    ]
    assert not problems, "\n".join(problems)


def test_output_in_any_block_is_run_or_marked_and_a_marked_one_names_its_test(tmp_path: Path) -> None:
    # The rule on a page: a plain or text block (in a list item too) that nothing runs fails, and so does a skipped
    # one that shows output without naming a test; bash, yaml, json and toml blocks are not run.
    page = tmp_path / "page.md"
    page.write_text(
        "```\nDetected inf/nan during batch_number=2\n```\n"  # 1: plain, unmarked
        "```text\nnanwatch: numbers near their dtype's limits\n```\n"  # 4: text, unmarked
        "- a list item:\n\n  ```\n  nanwatch: inf/nan gradients during batch_number=0\n  ```\n"  # 9: indented
        "```bash\npip install nanwatch\n```\n"
        "```yaml\nmax_frames_to_save: 3\n```\n"
        '```json\n{"abs_max": "inf"}\n```\n'
        "```toml\n[tool.nanwatch]\n```\n"
        "```console\n$ echo checked\nchecked\n```\n"
        '<!-- skip: next "illustrative: needs a GPU (tests/test_docs.py)" -->\n```text\nmarked, test named\n```\n'
        '<!-- skip: next "illustrative: needs a GPU" -->\n```\nmarked, no test named\n```\n'  # 32
        '<!-- skip: next "illustrative: a sketch" -->\n```python\nmodel = ...\n```\n',
        encoding="utf-8",
    )

    _, failures = _run_page(page, "page.md", tmp_path / "sandbox")

    assert [failure.partition(" that nothing runs")[0] for failure in failures] == [
        "page.md:1: AssertionError: a ``` block",
        "page.md:4: AssertionError: a ```text block",
        "page.md:9: AssertionError: a ``` block",
    ]
    text = page.read_text(encoding="utf-8")
    assert _skip_mark_problems(text, "page.md") == [
        "page.md:32: a skipped block shows output; its reason names no test that runs it"
    ]
