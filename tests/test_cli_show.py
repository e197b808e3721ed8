"""`nanwatch show`: a report's .jsonl renders as its .txt report byte for byte; a trace's as its .txt trace."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.cli import main

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.trace_models import run_amp_net, trace_path  # noqa: E402


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
    assert "nanwatch show: error:" in err
    assert "nanwatch-trace-rank0.txt:1 is not JSON" in err
    status, _, err = _show(f"{trace_path(tmp_path)}:9", capsys)
    assert status == 2
    assert "holds no batch 9; it holds batch 0" in err
    status, _, err = _show(str(tmp_path / "missing.jsonl"), capsys)
    assert status == 2
    assert "cannot read" in err
