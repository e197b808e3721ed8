"""Spike warnings in sentinel mode, in every adapter with the real frameworks: sentinel mode records no module, so the
spiking micro-batch and the one before it are replayed under a full watch on the same weights, and the module whose
output moved with the data is named. The spike here comes with the data (one micro-batch's `boost` input is x100, and
only the `boost` module uses it); one comes with the weights instead, and one can only be replayed in part."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.adapters.long_runs import FRAMEWORK_NOISE, batches, hf_training_arguments, lightning_trainer
from tests.adapters.scripts.blowup_models import Boosted
from torch import nn

from nanwatch import watch

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

SPIKE_AT = 14
STEPS = 18
SENTINEL = {"mode": "sentinel", "spike_window": 10}

pytestmark = FRAMEWORK_NOISE


def _boost(index: int) -> torch.Tensor:
    return torch.tensor(100.0 if index == SPIKE_AT else 1.0)


def _data() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [(x, y, _boost(index)) for index, (x, y) in enumerate(batches(STEPS, size=16))]


def _train_plain(model: nn.Module, report_dir: Path) -> int:
    """The plain loop in sentinel mode over `_data()`, a functional loss given to `watch_loss`: the steps it took."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    steps = 0
    with watch(model, optimizer=optimizer, report_dir=report_dir, **SENTINEL) as handle:
        for x, y, boost in _data():
            optimizer.zero_grad()
            handle.watch_loss(nn.functional.mse_loss(model(x, boost), y)).backward()
            optimizer.step()
            handle.step()
            steps += 1
    return steps


def _spike_report(report_dir: Path, batch: int = SPIKE_AT) -> dict[str, Any]:
    path = report_dir / f"nanwatch-spike-rank0-batch{batch}.json"
    assert path.exists(), sorted(p.name for p in report_dir.glob("*"))
    return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _assert_named_by_replay(report: dict[str, Any], prefix: str = "") -> None:
    """`Boosted`'s `boost` module (under `prefix`) named first, x100; the modules before it barely moved."""
    assert report["replay"] == {"batch_number": SPIKE_AT, "compared_with": SPIKE_AT - 1, "moved_with_the_data": True}
    assert report["first_moved"] == {"module": prefix + "boost", "kind": "output"}, report["modules"]
    moved = {entry["module"]: entry["abs_max"] / entry["recent"] for entry in report["modules"]}
    assert moved[prefix + "boost"] > 50, moved  # x100 with the data, whatever the weights did
    assert all(moved.get(prefix + name, 1.0) < 2 for name in ("inp", "act")), moved


# ------------------------------------------------------------------------------------------- the plain loop


def test_plain_sentinel_replays_the_spike_and_names_the_module(tmp_path: Path) -> None:
    model = Boosted()
    _train_plain(model, tmp_path)

    report = _spike_report(tmp_path)
    assert {signal["signal"] for signal in report["signals"]} == {"loss", "gradients"}
    _assert_named_by_replay(report)
    text = (tmp_path / f"nanwatch-spike-rank0-batch{SPIKE_AT}.txt").read_text(encoding="utf-8")
    replayed = f"sentinel mode: micro-batch {SPIKE_AT} replayed under a full watch, against micro-batch {SPIKE_AT - 1}"
    assert replayed in text
    assert "first module to move (in the order the frames were recorded): boost (output, x" in text
    # The replays changed nothing the run keeps: it trained on, finite, and nothing is left hooked.
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


def test_plain_sentinel_a_spike_from_the_weights_names_no_module(tmp_path: Path) -> None:
    model = Boosted()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with watch(model, optimizer=optimizer, report_dir=tmp_path, **SENTINEL) as handle:
        for index, (x, y, _) in enumerate(_data()):
            if index == SPIKE_AT:
                with torch.no_grad():
                    model.out.weight.mul_(100.0)  # what a bad step does: every micro-batch from here on spikes
            optimizer.zero_grad()
            handle.watch_loss(nn.functional.mse_loss(model(x, torch.tensor(1.0)), y)).backward()
            optimizer.step()
            handle.step()

    report = _spike_report(tmp_path)
    assert report["replay"] == {"batch_number": SPIKE_AT, "compared_with": SPIKE_AT - 1, "moved_with_the_data": False}
    assert report["first_moved"] is None, report["modules"]
    text = (tmp_path / f"nanwatch-spike-rank0-batch{SPIKE_AT}.txt").read_text(encoding="utf-8")
    assert "no module's output grew x2 or more with this micro-batch's data: the spike came with the weights" in text


def test_plain_sentinel_a_refilled_input_buffer_is_not_replayed_as_if_it_were_the_same(tmp_path: Path) -> None:
    """A loop that refills one input buffer, with inputs kept by reference: the earlier micro-batch's input is gone
    (it holds this micro-batch's values now), and the report says so rather than comparing the spike with itself."""
    model = Boosted()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    buffer, boost = torch.empty(16, 4), torch.empty(())
    config = {**SENTINEL, "sentinel_copy_inputs": "never"}
    with watch(model, optimizer=optimizer, report_dir=tmp_path, **config) as handle:
        for x, y, value in _data():
            buffer.copy_(x)
            boost.copy_(value)
            optimizer.zero_grad()
            handle.watch_loss(nn.functional.mse_loss(model(buffer, boost), y)).backward()
            optimizer.step()
            handle.step()

    report = _spike_report(tmp_path)
    assert report["first_moved"] is None
    assert report["replay"]["compared_with"] == SPIKE_AT - 1
    assert f"input[0] of micro-batch {SPIKE_AT - 1}" in report["replay"]["why_not"]
    text = (tmp_path / f"nanwatch-spike-rank0-batch{SPIKE_AT}.txt").read_text(encoding="utf-8")
    assert "changed; mode='full' names the modules that moved)" in text


def test_plain_sentinel_a_replay_that_fails_still_reports_the_spike_and_the_run_goes_on(tmp_path: Path) -> None:
    """A forward that only works with autograd on (the replay runs it forward only, with autograd off): the replay's
    failure is named in the spike's report, and neither it nor the spike stops the run."""

    class NeedsAutograd(Boosted):
        def forward(self, x: torch.Tensor, boost: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                raise RuntimeError("this model trains only")
            return super().forward(x, boost)

    model = NeedsAutograd()
    steps = _train_plain(model, tmp_path)

    assert steps == STEPS
    report = _spike_report(tmp_path)
    assert report["first_moved"] is None
    assert report["modules"] == []
    failed = f"the replay of micro-batch {SPIKE_AT} failed: RuntimeError('this model trains only')"
    assert failed in report["replay"]["why_not"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- Lightning


def test_lightning_sentinel_replays_the_spike_and_names_the_module(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from nanwatch.adapters.lightning import OverflowCallback

    class LitBoosted(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = Boosted()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, boost = batch
            return nn.functional.mse_loss(self.net(x, boost), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    trainer = lightning_trainer(STEPS, [OverflowCallback(report_dir=tmp_path, **SENTINEL)])
    trainer.fit(LitBoosted(), torch.utils.data.DataLoader(_data(), batch_size=None))

    report = _spike_report(tmp_path)
    _assert_named_by_replay(report, "net.")
    assert trainer.global_step == STEPS


# ---------------------------------------------------------------------------------------------- Accelerate


def test_accelerate_sentinel_replays_the_spike_and_names_the_module(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from nanwatch.adapters.accelerate import OverflowTracker

    tracker = OverflowTracker(report_dir=tmp_path, **SENTINEL)
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    model = Boosted()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-4))
    tracker.attach(accelerator, model)
    for x, y, boost in _data():
        accelerator.backward(nn.functional.mse_loss(model(x, boost), y))  # the adapter hands the loss over
        optimizer.step()
        optimizer.zero_grad()
    tracker.detach()

    _assert_named_by_replay(_spike_report(tmp_path))


# ------------------------------------------------------------------------------------------ the HF Trainer


class _BoostedRegressor(nn.Module):
    """Boosted returning {"loss", "logits"}, as a transformers model does (the loss inside its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Boosted()

    def forward(self, x: torch.Tensor, boost: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x, boost)
        return {"loss": nn.functional.mse_loss(logits, labels), "logits": logits}


def test_hf_trainer_sentinel_replays_the_spike_and_names_the_module(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer

    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    arguments = hf_training_arguments(tmp_path / "out", STEPS)

    class InOrder(Trainer):  # type: ignore[misc]
        """The micro-batches in the dataset's order (the Trainer shuffles by default): the spike at SPIKE_AT."""

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler[int]:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrder(
        model=_BoostedRegressor(),
        args=arguments,
        train_dataset=[{"x": x, "boost": boost, "labels": y} for x, y, boost in _data()],
        data_collator=lambda items: items[0],
        callbacks=[OverflowTrainerCallback(report_dir=tmp_path / "reports", **SENTINEL)],
    )
    trainer.train()

    report = _spike_report(tmp_path / "reports")
    # The Trainer's loss is computed inside the model: the gradients carry the spike here.
    assert "gradients" in {signal["signal"] for signal in report["signals"]}
    _assert_named_by_replay(report, "net.")


# ------------------------------------------------------------------------------------------- two DDP ranks


@pytest.mark.multiprocess
def test_two_ddp_ranks_each_replay_their_own_micro_batch_after_a_gradient_spike(tmp_path: Path) -> None:
    """Only rank 1's micro-batch carries the x100 data; the all-reduced gradients spike on both ranks. Each replays its
    own micro-batch: rank 1 names `boost`, rank 0 finds nothing moved with its data and says where else it can come
    from. No replay runs a collective: both ranks train on to the end, with equal weights."""
    from torchrun_launch import run_torchrun

    result = run_torchrun("spike_ddp_run.py", "--out", str(tmp_path), "--spike-at", str(SPIKE_AT))

    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(outcome["error"], outcome["steps"]) for outcome in outcomes] == [(None, 16), (None, 16)]
    assert outcomes[0]["weights"] == outcomes[1]["weights"]
    reports = tmp_path / "reports"
    on_rank = {
        rank: json.loads((reports / f"nanwatch-spike-rank{rank}-batch{SPIKE_AT}.json").read_text()) for rank in (0, 1)
    }
    assert {signal["signal"] for signal in on_rank[1]["signals"]} == {"loss", "gradients"}
    assert {signal["signal"] for signal in on_rank[0]["signals"]} == {"gradients"}
    _assert_named_by_replay(on_rank[1])
    assert on_rank[0]["replay"]["moved_with_the_data"] is False
    assert on_rank[0]["first_moved"] is None
    text = (reports / f"nanwatch-spike-rank0-batch{SPIKE_AT}.txt").read_text(encoding="utf-8")
    assert "another rank's micro-batch" in text
