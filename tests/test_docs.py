"""The docs are tested: every Python and console block of README.md and docs/*.md runs here, its shown output
compared, or is marked illustrative where this test sees the mark.

Sybil (https://sybil.readthedocs.io) parses the Markdown; each document runs in a folder of its own (with the
repository's examples/, benchmarks/, configs/ and tests/ linked in, and an empty docs/ for the plots), its blocks in
order:

- ```` ```python ````: executed in the document's namespace, from that folder; what it prints is kept for a
  ```` ```console ```` block right after it that holds no `$` line.
- ```` ```python NAME ```` (or ```` ```yaml NAME ````, any language and a file name): written to NAME in that folder,
  for the commands that follow (`$ python train.py`).
- ```` ```console ````: each `$ command` (a line ending in `\\` goes on) runs in bash in that folder, stdout and
  stderr together as a terminal shows them, and what it printed must be the lines below it. In those lines, a line
  `...` (or `[...]`) stands for any lines, `...` inside a line for any text, and a last line `(exit N)` for the exit
  status; `$ echo $?` prints the status of the command before.
- `<!-- skip: next "illustrative: why" -->` before a block: not run (Sybil's skip directive); the reason says why.
- `<!-- invisible-code-block: python ... -->`: Python the reader does not need to see that sets up what a block
  shows (a run whose files the block reads).

A block that is neither run nor marked fails here, naming its file and line.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import unittest
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


def _sandbox(example: Example) -> Path:
    folder: Path = example.namespace[_SANDBOX]
    return folder


# ------------------------------------------------------------------------------------------------------ python


@contextlib.contextmanager
def _chdir(folder: str) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


class _PythonInSandbox(PythonEvaluator):
    """Sybil's Python evaluator, run from the document's folder (and importing from it), its stdout kept."""

    def __call__(self, example: Example) -> None:
        folder = str(_sandbox(example))
        printed = io.StringIO()
        before = set(sys.modules)
        sys.path.insert(0, folder)
        try:
            with _chdir(folder), contextlib.redirect_stdout(printed):
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


def _pattern(lines: list[str]) -> re.Pattern[str]:
    """The shown lines as a pattern: `...` (or `[...]`) alone on a line is any lines, `...` in a line any text."""
    parts = []
    for line in lines:
        if line.strip() in ("...", "[...]"):
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.rstrip().split("...")) + r"\n")
    return re.compile("".join(parts), re.DOTALL)


def _tidy(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _compare(what: str, shown: list[str], printed: str, status: int | None) -> str | None:
    expected = _tidy("\n".join(shown))
    if expected and re.fullmatch(r"\(exit \d+\)", expected[-1]):
        wanted = int(expected.pop()[6:-1])
        if status != wanted:
            return f"{what}: exit status {status}, the docs say {wanted}\n{printed}"
    actual = _tidy(printed)
    if _pattern(expected).fullmatch("".join(line + "\n" for line in actual)):
        return None
    return (
        f"{what}: the output differs from the docs\n--- docs\n"
        + "\n".join(expected)
        + "\n--- now\n"
        + "\n".join(actual)
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
            return _compare("the Python block above", block.splitlines(), example.namespace.get(_OUTPUT, ""), None)
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
            failure = _compare(f"$ {command}", shown, printed, result.returncode)
            if failure is not None:
                return failure
        return None


# ------------------------------------------------------------------------------------------------------ the test

SYBIL = Sybil(parsers=[SkipParser(), FileParser(), PythonParser(), ConsoleParser()], path=str(REPO))
# The blocks that must be run or marked: every fence whose language is python or console (a file block included).
FENCES = re.compile(r"^[ \t]*```(?:python|console)\b", re.M)


def _sandbox_for(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "docs").mkdir()  # where the docs' plots are written (not the repository's docs/)
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    return tmp_path


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_block_runs_as_shown_or_is_marked_illustrative(path: Path, tmp_path: Path) -> None:
    document = SYBIL.parse(path)
    document.namespace[_SANDBOX] = _sandbox_for(tmp_path)
    where = path.relative_to(REPO)
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
    assert not failures, "\n\n".join(failures)
    fences = [match.start() for match in FENCES.finditer(document.text)]
    unhandled = [document.text.count("\n", 0, start) + 1 for start in fences if start not in handled]
    assert not unhandled, f"{where}: blocks at lines {unhandled} are neither run nor marked illustrative"


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
