"""Spike warnings in every adapter, with the real frameworks: a finite jump of one module's output (x100 at one
micro-batch) is reported as a loss and gradient spike that names that module first, the run goes on, and the steady
micro-batches around it raise nothing."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.adapters.long_runs import (
    FRAMEWORK_NOISE,
    batches,
    hf_training_arguments,
    lightning_regressor,
    lightning_trainer,
)
from tests.models import small_mlp
from torch import nn

from nanwatch import ConfigError, WatchConfig, watch

SPIKE_AT = 14


def _batches16(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(count, size=16)


WINDOW = {"spike_window": 10}

pytestmark = FRAMEWORK_NOISE


def _factor(index: int) -> float:
    return 100.0 if index == SPIKE_AT else 1.0


def _spike_reports(report_dir: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for path in report_dir.glob("nanwatch-spike-rank0-batch*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        found[data["batch_number"]] = data
    return found


def _assert_named(report: dict[str, Any], signals: set[str]) -> None:
    assert {signal["signal"] for signal in report["signals"]} == signals
    assert report["first_moved"] == {"module": "2", "kind": "output"}, report["modules"]
    for signal in report["signals"]:
        assert signal["value"] > 10 * signal["mean"]


# ------------------------------------------------------------------------------------------- the plain loop


def test_plain_a_spike_is_named_with_its_module_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    with watch(model, optimizer=optimizer, report_dir=tmp_path, **WINDOW) as handle:
        for index, (x, y) in enumerate(_batches16(20)):
            model[2].factor = _factor(index)
            optimizer.zero_grad()
            handle.watch_loss(nn.functional.mse_loss(model(x), y)).backward()
            optimizer.step()
            handle.step()

    reports = _spike_reports(tmp_path)
    assert list(reports) == [SPIKE_AT], "one spike, and none while training was steady"
    _assert_named(reports[SPIKE_AT], {"loss", "gradients"})
    text = (tmp_path / f"nanwatch-spike-rank0-batch{SPIKE_AT}.txt").read_text(encoding="utf-8")
    assert f"nanwatch: loss spiked during batch_number={SPIKE_AT} (optimizer step {SPIKE_AT})" in text
    assert "first module to move (in the order the frames were recorded): 2 (output, x" in text
    assert f"loss spiked during batch_number={SPIKE_AT}" in capsys.readouterr().err  # logged: a warning
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("window", [10, 50])
def test_plain_a_loss_that_jumps_and_stays_is_one_warning_and_one_report(
    window: int, tmp_path: Path, nanwatch_log: pytest.LogCaptureFixture
) -> None:
    # The loss goes from ~1 to ~100 at micro-batch 50 and stays there for 100 more. Before, a spike entered the window
    # as its mean, so the new level never did: every micro-batch after the jump was a spike, each one a warning and
    # two files (48 warnings and 96 files in a run of 150). One jump is one event; a genuinely new spike on the new
    # level (x100 again, at micro-batch 120) is reported as any other.
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    with watch(model, optimizer=optimizer, report_dir=tmp_path, spike_window=window) as handle:
        for index, (x, y) in enumerate(_batches16(150)):
            model[2].factor = 1.0 if index < 50 else 100.0 if index == 120 else 10.0
            optimizer.zero_grad()
            handle.watch_loss(nn.functional.mse_loss(model(x), y)).backward()
            optimizer.step()
            handle.step()

    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f"nanwatch-spike-rank0-batch{batch}.{ext}" for batch in (120, 50) for ext in ("json", "txt")
    ]
    records = nanwatch_log.records
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "spiked" in r.getMessage()]
    assert [message.split(" (optimizer step")[0] for message in warned] == [
        "nanwatch: loss spiked during batch_number=50",
        "nanwatch: loss spiked during batch_number=120",
    ]
    assert all("largest gradient magnitude about to be applied spiked" in message for message in warned)
    # What became of the jump is said once, not as a warning: the level taken up, or its repeats counted.
    said = [r.getMessage() for r in records if r.levelno == logging.INFO and "batch_number=50" in r.getMessage()]
    assert said, "the end of the event is said"
    assert all("the loss" in m or "largest gradient" in m for m in said)
    assert len(said) <= 2  # one per signal


def test_plain_no_spike_without_spike_window(tmp_path: Path) -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    with watch(model, optimizer=optimizer, report_dir=tmp_path) as handle:
        for index, (x, y) in enumerate(_batches16(16)):
            model[2].factor = _factor(index)
            optimizer.zero_grad()
            handle.watch_loss(nn.functional.mse_loss(model(x), y)).backward()
            optimizer.step()
            handle.step()
    assert _spike_reports(tmp_path) == {}


def test_a_loss_that_creeps_up_slowly_is_no_spike(tmp_path: Path) -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with watch(model, optimizer=optimizer, report_dir=tmp_path, **WINDOW) as handle:
        for index, (x, y) in enumerate(_batches16(30)):
            model[2].factor = 1.03**index  # the loss +6 % a micro-batch: 5.5x in all, never 2x the recent mean
            optimizer.zero_grad()
            handle.watch_loss(nn.functional.mse_loss(model(x), y)).backward()
            optimizer.step()
            handle.step()
    assert _spike_reports(tmp_path) == {}


def test_bad_spike_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="spike_window"):
        WatchConfig(spike_window=1)
    with pytest.raises(ConfigError, match="spike_factor"):
        WatchConfig(spike_factor=1.0)
    with pytest.raises(ConfigError, match="spike_zscore"):
        WatchConfig(spike_zscore=0)
    with pytest.raises(ConfigError, match="spike_window"):
        WatchConfig(spike_window=True)


# ---------------------------------------------------------------------------------------------- Lightning


def test_lightning_a_spike_is_named_with_its_module(tmp_path: Path) -> None:
    pytest.importorskip("lightning")

    from nanwatch.adapters.lightning import OverflowCallback

    trainer = lightning_trainer(20, [OverflowCallback(report_dir=tmp_path, **WINDOW)])
    module = lightning_regressor(lambda params: torch.optim.SGD(params, lr=1e-4), _factor)
    trainer.fit(module, torch.utils.data.DataLoader(_batches16(20), batch_size=None))

    reports = _spike_reports(tmp_path)
    assert list(reports) == [SPIKE_AT]
    report = reports[SPIKE_AT]
    assert report["first_moved"] == {"module": "net.2", "kind": "output"}, report["modules"]
    assert {signal["signal"] for signal in report["signals"]} == {"loss", "gradients"}
    assert trainer.global_step == 20


# ---------------------------------------------------------------------------------------------- Accelerate


def test_accelerate_a_spike_is_named_with_its_module(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from nanwatch.adapters.accelerate import OverflowTracker

    tracker = OverflowTracker(report_dir=tmp_path, **WINDOW)
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    tracker.attach(accelerator, model)
    for index, (x, y) in enumerate(_batches16(20)):
        model[2].factor = _factor(index)
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    tracker.detach()

    reports = _spike_reports(tmp_path)
    assert list(reports) == [SPIKE_AT]
    _assert_named(reports[SPIKE_AT], {"loss", "gradients"})


# ------------------------------------------------------------------------------------------ the HF Trainer


class _LossInForward(nn.Module):
    """small_mlp returning {"loss", "logits"}, as a transformers model does (the loss inside its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = small_mlp()
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.net[2].factor = _factor(self.calls)
        self.calls += 1
        logits = self.net(x)
        return {"loss": nn.functional.mse_loss(logits, labels), "logits": logits}


def test_hf_trainer_a_gradient_spike_is_named_with_its_module(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer

    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    data = [{"x": x, "labels": y} for x, y in _batches16(20)]
    arguments = hf_training_arguments(tmp_path / "out", 20)
    trainer = Trainer(
        model=_LossInForward(),
        args=arguments,
        train_dataset=data,
        data_collator=lambda items: items[0],
        callbacks=[OverflowTrainerCallback(report_dir=tmp_path / "reports", **WINDOW)],
    )
    trainer.train()

    reports = _spike_reports(tmp_path / "reports")
    assert list(reports) == [SPIKE_AT]
    report = reports[SPIKE_AT]
    # The Trainer's loss is computed inside the model: the gradients carry the spike here.
    assert "gradients" in {signal["signal"] for signal in report["signals"]}
    assert report["first_moved"] == {"module": "net.2", "kind": "output"}, report["modules"]
    assert math.isfinite(trainer.state.log_history[-1].get("train_loss", 0.0))
