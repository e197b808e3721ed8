"""`nanwatch show`: a report's .jsonl renders as its .txt report byte for byte; a trace's as its .txt trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.trace_models import run_amp_net, trace_path
from torch import nn

import nanwatch
from nanwatch.cli import build_parser, main


def _show(spec: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["show", spec])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_show_prints_the_text_report_byte_for_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    capsys.readouterr()
    status, out, err = _show(str(tmp_path / "nanwatch-report-rank0-batch2.jsonl"), capsys)
    assert (status, err) == (0, "")
    assert out == (tmp_path / "nanwatch-report-rank0-batch2.txt").read_bytes().decode("utf-8")
    # 5 frames a batch (fc1, act, amp, fc2, the root): 2 clean batches, then 3 up to the inf in amp.
    assert out.startswith("Detected inf/nan during batch_number=2\nLast 13 forward frames:\n")


def test_show_prints_the_trace_batch_by_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    capsys.readouterr()
    status, out, _ = _show(str(trace_path(tmp_path)), capsys)
    assert status == 0
    text = (tmp_path / "nanwatch-trace-rank0.txt").read_text()
    assert out == text
    starts = [line for line in out.splitlines() if "*** Starting batch number=" in line]
    assert starts == [f"{' ' * 17} *** Starting batch number={n} ***" for n in (0, 1, 2)]
    status, one, _ = _show(f"{trace_path(tmp_path)}:1", capsys)
    assert status == 0
    assert one.splitlines()[0] == f"{' ' * 17} *** Starting batch number=1 ***"
    assert one in text
    assert "batch number=0" not in one
    assert "batch number=2" not in one


def test_show_of_an_eval_report_keeps_its_counter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model.eval()
    with torch.no_grad():
        model[0].weight.fill_(3e38)  # two of them add up past float32's max
    handle = nanwatch.watch(model, watch_eval=True, report_dir=tmp_path)
    with pytest.raises(nanwatch.NonFiniteError):
        model(torch.ones(1, 2))
    handle.close()
    (txt,) = tmp_path.glob("nanwatch-report-eval-*.txt")
    status, out, _ = _show(str(txt.with_suffix(".jsonl")), capsys)
    assert status == 0
    assert out == txt.read_text()
    assert out.startswith("Detected inf/nan during eval_batch_number=0\n")


def test_show_refuses_what_nanwatch_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    capsys.readouterr()
    status, out, err = _show(str(tmp_path / "nanwatch-trace-rank0.txt"), capsys)
    assert (status, out) == (2, "")
    assert err == (
        f"nanwatch show: {tmp_path / 'nanwatch-trace-rank0.txt'} is a nanwatch text trace (.txt); show reads a "
        f"nanwatch .jsonl file: give {trace_path(tmp_path)}, written beside it\n"
    )
    status, _, err = _show(f"{trace_path(tmp_path)}:9", capsys)
    assert status == 2
    assert "holds no batch 9; it holds batch 0" in err
    status, _, err = _show(str(tmp_path / "missing.jsonl"), capsys)
    assert status == 2
    assert err.startswith(f"nanwatch show: {tmp_path / 'missing.jsonl'} is not there (no such file); ")
    assert "those beside it: nanwatch-trace-rank0.jsonl" in err


# --------------------------------------------------------------------------------------------------------------------
# The WatchConfig fields show applies: --config FILE and the generated options


def _frame_headers(text: str) -> list[str]:
    # A frame's first line is its module's name and class, indented past the two number columns.
    return [line.strip() for line in text.splitlines() if line.startswith(" " * 18) and "***" not in line]


def test_a_config_file_and_options_choose_frames_and_modules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    report = str(tmp_path / "nanwatch-report-rank0-batch2.jsonl")
    full = (tmp_path / "nanwatch-report-rank0-batch2.txt").read_text()
    config = tmp_path / "watch.yaml"
    config.write_text("max_frames_to_save: 4\nexclude_modules: [act]\ntrace_batch_nums: [0, 1]\n", encoding="utf-8")
    capsys.readouterr()

    # From the file: the last 4 frames that are not act's (batch 1's fc2 and root, then batch 2's fc1 and amp).
    assert main(["show", report, "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # trace_batch_nums is for training runs: accepted from the shared file without a word
    assert out.startswith("Detected inf/nan during batch_number=2\nLast 4 forward frames:\n")
    assert _frame_headers(out) == ["fc2 Linear", "AmpNet", "fc1 Linear", "amp Amplify"]
    assert out.splitlines()[-1] == full.splitlines()[-1]  # the culprit line stays
    # Each frame shown is a frame of the full report, line for line.
    body = out.split("\n\n")[0].splitlines()[3:]
    starts = [i for i, line in enumerate(body) if line.startswith(" " * 18)] + [len(body)]
    frames = ["\n".join(body[a:b]) + "\n" for a, b in zip(starts, starts[1:], strict=False)]
    assert len(frames) == 4
    assert all(frame in full for frame in frames)

    # An option beats the file; the file's other field still holds.
    assert main(["show", report, "--config", str(config), "--max-frames-to-save", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == "Last 2 forward frames:"
    assert _frame_headers(out) == ["fc1 Linear", "amp Amplify"]
    assert main(["show", report, "--config", str(config), "--exclude-modules", "--include-modules", "fc*"]) == 0
    # fc1 and fc2 of batch 0 and 1, then fc1 of batch 2: the last 4 of those five frames.
    assert _frame_headers(capsys.readouterr().out) == ["fc2 Linear", "fc1 Linear", "fc2 Linear", "fc1 Linear"]

    # Without a config the report is the file's, whole: the default 21 frames would hide nothing here, and is
    # not applied anyway (a report written with max_frames_to_save=50 would keep all 50).
    assert main(["show", report]) == 0
    assert capsys.readouterr().out == full


def test_show_says_what_it_does_not_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=2)
    trace = str(trace_path(tmp_path))
    capsys.readouterr()
    assert main(["show", f"{trace}:1", "--watch-eval", "--max-frames-to-save", "1", "--include-modules", "amp"]) == 0
    out, err = capsys.readouterr()
    assert _frame_headers(out) == ["amp Amplify"]  # a trace keeps every frame of the modules chosen
    assert "nanwatch show: note: --watch-eval is not used by show" in err
    assert "--max-frames-to-save applies to reports" in err
    help_text = " ".join(build_parser().parse_args(["show", trace]).parser.format_help().split())
    assert "WatchConfig fields used by show" in help_text
    assert "max_frames_to_save: a report shows only its last N frames" in help_text
    assert "The other WatchConfig fields are accepted and ignored by show" in help_text
    # --help lists only the options show uses: the three fields and --config, not the 16 others.
    assert "--max-frames-to-save N" in help_text
    assert "--include-modules" in help_text
    assert "--watch-eval" not in help_text
    assert "--trace-batch-nums" not in help_text


def test_show_rejects_a_typo_in_the_config_and_a_pattern_that_matches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    trace = str(trace_path(tmp_path))
    config = tmp_path / "watch.yaml"
    config.write_text("max_frames_to_save: 4\nexclude_module: [act]\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["show", trace, "--config", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "unknown field 'exclude_module' (did you mean 'exclude_modules'?" in err
    assert len(err.splitlines()) == 1
    assert main(["show", trace, "--include-modules", "fc3"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "include_modules: the pattern 'fc3' matches none of the 5 modules in" in err
    assert "did you mean 'fc2', 'fc1'?" in err
    assert main(["show", trace, "--exclude-modules", "*"]) == 2
    assert "leave none of the 5 modules" in capsys.readouterr().err


BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00"  # the start of a PNG: no text at all


def test_a_file_that_is_not_utf8_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: UnicodeDecodeError and a traceback.
    path = tmp_path / "nanwatch-report-rank0-batch0.jsonl"
    path.write_bytes(BINARY)
    status, out, err = _show(str(path), capsys)
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        f"nanwatch show: {path} is a binary file (byte 0 is 0x89), not text; show reads a nanwatch .jsonl file: "
        "report_dir holds nanwatch-report-*.jsonl and nanwatch-trace-*.jsonl"
    ]


def test_a_config_file_that_is_not_utf8_ends_the_command_with_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: UnicodeDecodeError and a traceback. The config is read before FILE, so FILE need not exist.
    config = tmp_path / "watch.yaml"
    config.write_bytes("max_frames_to_save: 4\ninclude_modules: [écoute]\n".encode("latin-1"))
    assert main(["show", str(tmp_path / "nanwatch-trace-rank0.jsonl"), "--config", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [  # one line: no usage block, no traceback
        f"nanwatch show: config file {str(config)!r} is not UTF-8 text (byte 40 is 0xe9); expected a YAML or JSON "
        "file; fix the config file or the option (nanwatch config prints every field with its default)"
    ]
