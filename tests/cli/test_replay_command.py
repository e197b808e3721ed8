"""`nanwatch replay` on the command line: exit 1 for "the replay differs" and nothing else; every error (a file
that is no capture, a device this torch cannot use, a factory that raises) one line with exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.trace_models import SEED, build_amp_net

import nanwatch
from nanwatch.cli import main

FACTORY = "tests.trace_models:build_amp_net"


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """AmpNet in float16, amp multiplying by 1e5 at batch 1: its output is inf, and the forward is captured."""
    folder = tmp_path_factory.mktemp("reports")
    model = build_amp_net()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED)).half()

    def train() -> None:
        with nanwatch.watch(model, report_dir=folder, capture_on_detect=True) as handle:
            for batch in range(2):
                model.amp.factor = 1e5 if batch == 1 else 1.0
                model(x)
                handle.step()

    with pytest.raises(nanwatch.NonFiniteError):
        train()
    return folder / "replay-rank0-batch1.pt"


def _replay(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["replay", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_replay_that_differs_exits_1(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The factory builds amp with its factor at 1, not the 1e5 of the captured forward: the replay stays finite.
    status, out, err = _replay([str(capture), "--model", FACTORY], capsys)
    assert status == 1, err
    assert out.startswith(f"nanwatch replay of batch_number=1 from {capture}\n")


def test_a_device_this_torch_cannot_use_is_one_line(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a 29-line traceback and exit 1, the code of "the replay differs".
    status, out, err = _replay([str(capture), "--model", FACTORY, "--device", "cuda:99"], capsys)
    assert (status, out) == (2, "")
    assert len(err.splitlines()) == 1
    assert err.startswith("nanwatch replay: --device cuda:99: ")
    if not torch.cuda.is_available():  # a CPU build, as on this project's machines; with GPUs, too few of them
        assert f"this torch ({torch.__version__}, " in err
        assert "cannot use CUDA here; leave --device out (the forward runs where it first ran, or on the CPU)" in err
    else:
        assert f"only {torch.cuda.device_count()} CUDA device(s) are visible here" in err
    status, _, err = _replay([str(capture), "--model", FACTORY, "--device", "gpu0"], capsys)
    assert status == 2
    assert err == (
        "nanwatch replay: --device 'gpu0' is not a device name torch knows; give cpu, cuda, cuda:N, or leave "
        "--device out\n"
    )


def test_a_file_that_is_no_capture_says_what_it_is(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = capture.parent / "nanwatch-report-rank0-batch1.jsonl"
    status, out, err = _replay([str(report), "--model", FACTORY], capsys)
    assert (status, out) == (2, "")
    assert err == (
        f"nanwatch replay: {report} is a nanwatch report as JSON Lines; replay reads the "
        "replay-rank{R}-batch{N}.pt file that capture_on_detect=True writes in report_dir\n"
    )


def test_a_factory_that_raises_is_one_line_naming_where(
    capture: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [str(capture), "--model", "tests.replay_models:broken_factory"]
    status, out, err = _replay(argv, capsys)
    assert (status, out) == (2, "")
    assert len(err.splitlines()) == 1
    assert "raised RuntimeError: the config file train.yaml is missing (at " in err
    assert "tests/replay_models.py:" in err
    assert err.endswith("; fix it in your code (NANWATCH_DEBUG=1 shows its traceback)\n")
    monkeypatch.setenv("NANWATCH_DEBUG", "1")
    status, _, debug = _replay(argv, capsys)
    assert status == 2
    assert debug.startswith("Traceback (most recent call last):")
    assert "RuntimeError: the config file train.yaml is missing" in debug  # the user's own exception, chained
    assert debug.splitlines()[-1] == err.strip()
