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


def test_no_command_is_one_error_line() -> None:
    result = subprocess.run([sys.executable, "-m", "nanwatch"], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "nanwatch: no command given; the commands are demo, config, show, diff, plot, replay, repro, doctor "
        "(see nanwatch --help)\n"
    )


@pytest.mark.slow
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
    typo = tmp_path / "typo.yaml"
    typo.write_text("max_frames_to_sav: 3\n", encoding="utf-8")
    cases = {
        ("demo", "--config", str(latin)): f"config file {str(latin)!r} is not UTF-8 text",
        ("demo", "--config", str(typo)): "unknown field 'max_frames_to_sav' (did you mean 'max_frames_to_save'?",
        ("demo", "--config", str(tmp_path / "missing.yaml")): "cannot read config file",
        ("demo", "--max-frames-to-save", "0"): "option --max-frames-to-save: Input should be greater than or equal",
        ("demo", "--lr", "-1"): "argument --lr: expected a finite number > 0, got '-1'; see nanwatch demo --help",
        ("demo", "--steps", "ten"): "argument --steps: expected a whole number, got 'ten'",
    }
    for argv, expected in cases.items():
        assert main(list(argv)) == 2, argv
        out, err = capsys.readouterr()
        assert out == ""
        assert len(err.splitlines()) == 1, err  # no usage block, no traceback
        assert err.startswith("nanwatch demo: "), err
        assert expected in err, err


def test_demo_stopped_early_by_abort_after_batch_num_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    # Before: BatchLimitReached escaped as a traceback.
    assert main(["demo", "--abort-after-batch-num", "0"]) == 1
    out = capsys.readouterr().out
    assert "stopped after batch_number=0, as abort_after_batch_num asked; no inf/nan yet" in out


@pytest.mark.slow
def test_a_users_first_five_minutes_print_no_traceback(tmp_path: Path) -> None:
    """The demo, a typo'd config, show on the wrong file of the report dir, plot to PDF: each as a user types it."""

    def nanwatch(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "nanwatch", *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )

    reports = tmp_path / "reports"
    steps = [
        (["demo", "--report-dir", str(reports), "--capture-on-detect", "--trace-batch-nums", "0", "1"], 0),
        (["demo", "--config", "typo.yaml"], 2),
        (["show", str(reports / "nanwatch-report-rank0-batch2.json")], 2),
        (["show", str(reports / "replay-rank0-batch2.pt")], 2),
        (["show", str(reports / "nanwatch-report-rank0-batch2.jsonl")], 0),
        (["plot", str(reports / "nanwatch-trace-rank0.jsonl"), "-o", "heatmap.pdf"], 0),
    ]
    (tmp_path / "typo.yaml").write_text("max_frames_to_sav: 3\n", encoding="utf-8")
    results = []
    for argv, expected in steps:
        result = nanwatch(*argv)
        assert result.returncode == expected, (argv, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout, argv
        if expected == 2:
            assert len(result.stderr.splitlines()) == 1, (argv, result.stderr)
        results.append(result)
    # The demo logged one line per traced batch, not its frames; the report is on stderr, culprit line last.
    demo = results[0]
    assert demo.stderr.count("nanwatch: tracing batch_number=") == 2
    assert "first non-finite value produced by 4 (Linear)" in demo.stderr
    assert (tmp_path / "heatmap.pdf").read_bytes().startswith(b"%PDF")
