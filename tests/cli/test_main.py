"""`nanwatch --help`, `show`, `diff` and `plot` never import torch: reading a report must not pay for loading torch.

Each command runs in a fresh interpreter (this one has torch loaded already) on files written by a real watched run,
and that interpreter asserts, after `nanwatch.cli.main` returns, that torch is not in `sys.modules`.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.trace_models import run_amp_net, trace_path

import nanwatch
from nanwatch.cli import COMMANDS, build_parser, main
from nanwatch.core.config import WatchConfig

# Runs `main(argv)` and exits with its status; a torch import fails the assertion (exit 1, traceback on stderr).
PROBE = """\
import sys
from nanwatch.cli import main
argv = {argv!r}
try:
    status = main(argv)
except SystemExit as stop:  # argparse exits after printing --help
    status = stop.code
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
assert not loaded, f"nanwatch {{' '.join(argv)}} imported torch ({{len(loaded)}} modules: {{loaded[:3]}})"
sys.exit(status)
"""


def _probe(*argv: str) -> subprocess.CompletedProcess[str]:
    code = PROBE.format(argv=list(argv))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace of batches 0-2 and the report of batch 2, where AmpNet's float16 output overflows."""
    report_dir = tmp_path_factory.mktemp("amp_net")
    run_amp_net(report_dir, overflow_at=2, batches=3)
    return report_dir


def test_help_does_not_import_torch() -> None:
    result = _probe("--help")
    assert (result.returncode, result.stderr) == (0, "")
    for command in ("demo", "doctor", "replay", "show", "diff", "plot"):
        assert command in result.stdout


def test_show_does_not_import_torch(run_dir: Path) -> None:
    for stem in ("nanwatch-trace-rank0", "nanwatch-report-rank0-batch2"):
        result = _probe("show", str(run_dir / f"{stem}.jsonl"))
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout == (run_dir / f"{stem}.txt").read_text(encoding="utf-8")


def test_diff_does_not_import_torch(run_dir: Path) -> None:
    trace = trace_path(run_dir)
    result = _probe("diff", f"{trace}:1", f"{trace}:2")
    assert (result.returncode, result.stderr) == (1, "")  # 1: they diverge, at amp's overflow
    assert "first divergence at line 8 of 14: 'amp' (Amplify) output" in result.stdout


def test_plot_does_not_import_torch(run_dir: Path, tmp_path: Path) -> None:
    png = tmp_path / "x.png"
    result = _probe("plot", str(trace_path(run_dir)), "-o", str(png))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith(f"wrote {png} (")
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_the_probe_sees_a_command_that_imports_torch() -> None:
    # `demo` trains a model: it must import torch, and the probe must say so.
    result = _probe("demo", "--steps", "0")
    assert result.returncode == 1
    assert "AssertionError: nanwatch demo --steps 0 imported torch" in result.stderr


# --------------------------------------------------------------------------------------------------------------------
# `nanwatch --help` and `--version`: no command module is imported (no pydantic, no torch), so they start at once.
# (The time itself is measured by a script, not by a test: see docs/config-on-the-command-line.md.)

# Runs `main(argv)` and prints, after the status, which of the heavy modules it imported.
LOADED_PROBE = """\
import sys
from nanwatch.cli import main
status = main({argv!r})
heavy = ("torch", "pydantic", "yaml", "nanwatch.cli.options", "nanwatch.cli.show", "nanwatch.core.config")
print("LOADED", sorted(name for name in heavy if name in sys.modules))
sys.exit(status)
"""


def _loaded(*argv: str) -> tuple[subprocess.CompletedProcess[str], str]:
    code = LOADED_PROBE.format(argv=list(argv))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    return result, result.stdout.rsplit("LOADED ", 1)[-1].strip()


def test_help_and_version_import_no_command_module() -> None:
    result, loaded = _loaded("--help")
    assert (result.returncode, result.stderr, loaded) == (0, "", "[]")
    assert "Tracebacks: NANWATCH_DEBUG=1" in " ".join(result.stdout.split())
    result, loaded = _loaded("--version")
    assert (result.returncode, result.stderr, loaded) == (0, "", "[]")
    torch_version = importlib.metadata.version("torch")
    python = ".".join(str(part) for part in sys.version_info[:3])
    assert result.stdout.splitlines()[0] == f"nanwatch {nanwatch.__version__} (torch {torch_version}, Python {python})"


def test_a_command_imports_only_its_own_module() -> None:
    result, loaded = _loaded("config")
    assert (result.returncode, result.stderr, loaded) == (0, "", "[]")  # nanwatch config: package data, no pydantic
    result, loaded = _loaded("show", "--help")
    assert result.returncode == 0
    assert "nanwatch.cli.show" in loaded
    assert "torch" not in loaded


# --------------------------------------------------------------------------------------------------------------------
# Errors: one line `nanwatch <command>: <what was wrong>; <what to do>`, exit 2; a traceback only when asked for.


def _nanwatch(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "NANWATCH_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "nanwatch", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**environment, **env},
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["shwo", "x.jsonl"], "nanwatch: unknown command 'shwo' (did you mean 'show'?); the commands are demo,"),
        (["--bogus"], "nanwatch: unrecognized arguments: --bogus; see nanwatch --help"),
        (["show"], "nanwatch show: the following arguments are required: FILE[:BATCH]; see nanwatch show --help"),
        (["show", "x.jsonl", "--bogus"], "nanwatch show: unrecognized arguments: --bogus; see nanwatch show --help"),
        (["diff", "a.jsonl", "b.jsonl", "--context", "-2"], "nanwatch diff: argument --context: expected a whole"),
        (["plot", "x.jsonl"], "nanwatch plot: the following arguments are required: -o/--output; see nanwatch plot"),
        (["config", "fast"], "nanwatch config: no config named 'fast'; the installed ones are default, trace"),
        (["doctor", "--timeout", "0"], "nanwatch doctor: argument --timeout: must be a positive, finite number"),
        (["replay", "x.pt"], "nanwatch replay: the following arguments are required: --model; see nanwatch replay"),
    ],
)
def test_every_error_is_one_line_and_exit_2(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err  # no usage block, no traceback
    assert err.startswith(expected), err
    assert "; " in err  # what was wrong; what to do


def test_nanwatch_debug_adds_the_traceback(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    plain = _nanwatch("show", missing)
    assert (plain.returncode, plain.stdout) == (2, "")
    assert plain.stderr.startswith(f"nanwatch show: {missing} is not there (no such file); ")
    assert len(plain.stderr.splitlines()) == 1
    debug = _nanwatch("show", missing, NANWATCH_DEBUG="1")
    assert debug.returncode == 2
    assert debug.stderr.startswith("Traceback (most recent call last):")
    assert debug.stderr.splitlines()[-1] == plain.stderr.strip()  # the same line, last


def test_a_bug_in_nanwatch_is_one_line_and_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import nanwatch.cli.config

    def broken(name: str = "default") -> str:  # stands for a bug in a command
        return {}[name]  # type: ignore[no-any-return]

    monkeypatch.setattr(nanwatch.cli.config, "preset_text", broken)
    assert main(["config"]) == 3
    err = capsys.readouterr().err
    assert err == (
        "nanwatch config: nanwatch failed with KeyError: 'default'; this is a bug in nanwatch: run again with "
        "NANWATCH_DEBUG=1 for the traceback, and report it\n"
    )

    def interrupted(name: str = "default") -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(nanwatch.cli.config, "preset_text", interrupted)
    assert main(["config"]) == 130
    assert capsys.readouterr().err == "nanwatch config: interrupted\n"


# --------------------------------------------------------------------------------------------------------------------
# Help texts: each command lists only the options it uses, and says what its exit statuses mean.

# The WatchConfig options each tool lists (every command lists --config FILE too); demo runs a watched model: all.
USED = {
    "show": {"max_frames_to_save", "include_modules", "exclude_modules"},
    "diff": {"include_modules", "exclude_modules"},
    "plot": {"include_modules", "exclude_modules", "target_dtype", "headroom_warn_fraction"},
    "doctor": {"report_dir"},
    "replay": {"max_frames_to_save", "report_dir"},
    "repro": set(),
    "config": set(),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_only_the_options_a_command_uses_and_its_exit_statuses(command: str) -> None:
    parser = build_parser(only=command)
    subparser = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    text = subparser.format_help()
    flags = {flag for flag in re.findall(r"--[a-z][a-z-]+", text)}
    fields = {name for name in WatchConfig.model_fields if f"--{name.replace('_', '-')}" in flags}
    assert fields == USED.get(command, set(WatchConfig.model_fields)), command
    description = " ".join((subparser.description or "").split())
    assert "Exit status" in description, command
    assert "2 on bad input" in description or "2 for an unknown NAME" in description, command
