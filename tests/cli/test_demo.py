"""`nanwatch demo` and `nanwatch --help`: the first two things a new user runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanwatch.cli import SUBCOMMAND_MODULES, build_parser, main
from nanwatch.cli.demo import run_demo
from nanwatch.core.config import WatchConfig


def test_help_lists_every_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nanwatch", "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    commands = [module.rsplit(".", 1)[1] for module in SUBCOMMAND_MODULES]
    assert "demo" in commands
    for command in commands:
        assert command in result.stdout, f"{command!r} missing from `nanwatch --help`"


def test_no_command_prints_help_and_fails() -> None:
    result = subprocess.run([sys.executable, "-m", "nanwatch"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "COMMAND" in result.stdout


def test_demo_overflows_for_real_and_reports(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nanwatch", "demo", "--report-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Detected inf/nan during batch_number=" in result.stderr
    assert "Last 8 forward frames:" in result.stderr
    assert "nanwatch stopped the run at batch_number=" in result.stdout
    reports = sorted(tmp_path.glob("nanwatch-report-rank0-batch*.json"))
    assert len(reports) == 1
    data = json.loads(reports[0].read_text())
    last = data["frames"][-1]
    assert data["module_name"] == last["module"]
    assert any(entry["non_finite"] for entry in last["entries"])
    # Inputs to the module that overflowed were still finite: the inf was made there, in float16.
    assert all(entry["dtype"] == "float16" for entry in last["entries"] if entry["dtype"] is not None)


def test_demo_stops_before_the_step_that_would_apply_inf() -> None:
    stopped_at = run_demo(WatchConfig(max_frames_to_save=4), steps=50)
    assert stopped_at is not None
    assert stopped_at < 50


def test_demo_parser_takes_config_fields() -> None:
    args = build_parser().parse_args(["demo", "--max-frames-to-save", "3", "--steps", "5"])
    assert args.steps == 5


def test_a_bad_config_ends_demo_with_exit_2_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"report_dir: caf\xe9\n")
    for argv in (["demo", "--config", str(latin)], ["demo", "--max-frames-to-save", "0"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("nanwatch demo: error: ")
