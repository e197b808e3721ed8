"""`on_detect="skip"` in every adapter, with the real frameworks: the step a detection reaches is not applied (its
weights and optimizer state stay as they were), the report and the skip list are written, the run goes on with the
framework's counters as for any step, and `max_consecutive_skips + 1` detections in a row stop the run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.adapters.long_runs import FRAMEWORK_NOISE, batches, lightning_regressor, lightning_trainer, same, snapshot
from tests.models import small_mlp
from torch import nn

from nanwatch import ConfigError, NonFiniteError, StepsSkippedInARow, watch

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

pytestmark = FRAMEWORK_NOISE


def _skip_list(report_dir: Path) -> list[dict[str, Any]]:
    lines = (report_dir / "skipped.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


# ------------------------------------------------------------------------------------------- the plain loop


def _plain_run(report_dir: Path, inf_at: set[int], count: int = 6, **config: Any) -> dict[str, Any]:
    """A plain loop with Adam; the Scale module multiplies by inf in the micro-batches `inf_at`."""
    model = small_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    weights = [snapshot(model)]
    adam_steps = []
    with watch(model, optimizer=optimizer, on_detect="skip", report_dir=report_dir, **config) as handle:
        for index, (x, y) in enumerate(batches(count)):
            model[2].factor = math.inf if index in inf_at else 1.0
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            handle.step()
            weights.append(snapshot(model))
            adam_steps.append(int(optimizer.state[model[0].weight]["step"]) if optimizer.state else 0)
        skipped = handle.skipped
        optimizer_step = handle.watcher.counters.optimizer_step
    return {"weights": weights, "adam_steps": adam_steps, "skipped": skipped, "optimizer_step": optimizer_step}


def test_plain_a_bad_micro_batch_is_skipped_and_the_run_goes_on(tmp_path: Path) -> None:
    run = _plain_run(tmp_path, inf_at={2})

    weights = run["weights"]
    assert same(weights[3], weights[2]), "the step of micro-batch 2 changed the weights"
    assert all(not same(weights[i + 1], weights[i]) for i in (0, 1, 3, 4, 5)), "every other step applied"
    assert all(torch.isfinite(value).all() for value in weights[-1].values())
    assert run["adam_steps"] == [1, 2, 2, 3, 4, 5], "Adam's state did not move on the skipped step"
    assert run["optimizer_step"] == 6, "the loop called step() six times: six counted, as a GradScaler's skip is"
    listed = _skip_list(tmp_path)
    assert listed == run["skipped"]
    assert [(entry["batch_number"], entry["rank"], entry["skipped_in_a_row"]) for entry in listed] == [(2, 0, 1)]
    assert listed[0]["optimizer_step"] == 2
    assert (
        (tmp_path / "nanwatch-report-rank0-batch2.txt")
        .read_text(encoding="utf-8")
        .startswith("Detected inf/nan during batch_number=2\n")
    )


def test_plain_skips_in_a_row_up_to_the_limit_then_raise(tmp_path: Path) -> None:
    with pytest.raises(StepsSkippedInARow) as caught:
        _plain_run(tmp_path, inf_at={1, 3, 4, 5}, max_consecutive_skips=2)

    error = caught.value
    assert isinstance(error, NonFiniteError)
    assert error.batch_number == 5
    assert error.skipped == 2
    assert "2 optimizer steps were skipped in a row" in str(error)
    listed = _skip_list(tmp_path)
    assert [(entry["batch_number"], entry["skipped_in_a_row"]) for entry in listed] == [(1, 1), (3, 1), (4, 2)]


def test_plain_raise_stays_the_default(tmp_path: Path) -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model[2].factor = math.inf

    def train() -> None:
        with watch(model, optimizer=optimizer, report_dir=tmp_path) as handle:
            x, y = batches(1)[0]
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            handle.step()

    with pytest.raises(NonFiniteError):
        train()
    assert not (tmp_path / "skipped.jsonl").exists()


SKIP_NEEDS_AN_OPTIMIZER = (
    "nanwatch: on_detect='skip' skips the optimizer step of a micro-batch that holds inf/nan, and {caller} has no "
    "optimizer whose steps it can skip: {fix}"
)


def test_plain_skip_without_an_optimizer_is_refused_at_watch() -> None:
    # Before, watch() took it, and the first detection raised NonFiniteError: the run it was meant to keep going
    # stopped, and nothing had said skip could not skip.
    model = small_mlp()
    with pytest.raises(ConfigError) as info:
        watch(model, on_detect="skip")
    assert str(info.value) == SKIP_NEEDS_AN_OPTIMIZER.format(
        caller="watch()", fix="pass it, nanwatch.watch(model, optimizer=optimizer, on_detect='skip')"
    )
    assert "\n" not in str(info.value)
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules()), "nothing left"
    # With the optimizer the same call watches, and the loop runs as written.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, optimizer=optimizer, on_detect="skip") as handle:
        x, y = batches(1)[0]
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        handle.step()


def test_bad_skip_settings_are_named() -> None:
    from nanwatch import ConfigError, WatchConfig

    with pytest.raises(ConfigError, match="on_detect"):
        WatchConfig(on_detect="ignore")
    with pytest.raises(ConfigError, match="max_consecutive_skips"):
        WatchConfig(max_consecutive_skips=-1)
    with pytest.raises(ConfigError, match="max_consecutive_skips"):
        WatchConfig(max_consecutive_skips=True)


# ---------------------------------------------------------------------------------------------- Lightning


def test_lightning_skips_the_step_and_counts_it_as_lightning_counts_any(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from nanwatch.adapters.lightning import OverflowCallback

    class ScheduledRegressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = small_mlp()
            self.weights: list[dict[str, torch.Tensor]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.net[2].factor = math.inf if batch_idx == 2 else 1.0
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.weights.append(snapshot(self.net))

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module = ScheduledRegressor()
    initial = snapshot(module.net)
    callback = OverflowCallback(on_detect="skip", report_dir=tmp_path)
    trainer = lightning_trainer(5, [callback])
    trainer.fit(module, torch.utils.data.DataLoader(batches(5), batch_size=None))

    weights = [initial, *module.weights]
    assert same(weights[3], weights[2]), "the step of batch 2 changed the weights"
    assert all(not same(weights[i + 1], weights[i]) for i in (0, 1, 3, 4))
    assert trainer.global_step == 5, "Lightning counts the skipped step, as it counts a step its closure skips"
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 5, "the scheduler stepped with every step"
    listed = _skip_list(tmp_path)
    assert [(entry["batch_number"], entry["optimizer_step"], entry["epoch"]) for entry in listed] == [(2, 2, 0)]
    assert callback.state_dict()["batch_number"] == 5


def test_lightning_finds_its_optimizer_itself_so_skip_is_never_refused(tmp_path: Path) -> None:
    # Lightning always has an optimizer to step, even when configure_optimizers() returns None (its stand-in, whose
    # steps change nothing): skip skips that step, and the run goes on. Nothing to refuse, unlike watch() without one.
    pytest.importorskip("lightning")
    from nanwatch.adapters.lightning import OverflowCallback

    module = lightning_regressor(lambda parameters: None, lambda index: math.inf if index == 1 else 1.0)
    trainer = lightning_trainer(3, [OverflowCallback(on_detect="skip", report_dir=tmp_path)])
    trainer.fit(module, torch.utils.data.DataLoader(batches(3), batch_size=None))
    assert trainer.global_step == 3
    assert [entry["batch_number"] for entry in _skip_list(tmp_path)] == [1]


# ---------------------------------------------------------------------------------------------- Accelerate


def test_accelerate_skip_without_a_prepared_optimizer_is_refused_at_attach() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from nanwatch.adapters.accelerate import OverflowTracker

    tracker = OverflowTracker(on_detect="skip")
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    model = accelerator.prepare(small_mlp())  # the optimizer was not prepared
    with pytest.raises(ConfigError) as info:
        tracker.attach(accelerator, model)
    assert str(info.value) == SKIP_NEEDS_AN_OPTIMIZER.format(
        caller="OverflowTracker.attach()",
        fix="prepare the optimizer (accelerator.prepare) before tracker.attach(), or pass it: "
        "tracker.attach(accelerator, model, optimizers=optimizer)",
    )
    assert tracker.watcher is None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker.attach(accelerator, model, optimizers=optimizer)  # passed: watched, its steps skippable
    tracker.detach()


def test_accelerate_skips_the_step_and_goes_on(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from nanwatch.adapters.accelerate import OverflowTracker

    tracker = OverflowTracker(on_detect="skip", report_dir=tmp_path)
    accelerator = Accelerator(cpu=True, log_with=[tracker], gradient_accumulation_steps=2)
    model = small_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    tracker.attach(accelerator, model)
    weights = [snapshot(model)]
    for index, (x, y) in enumerate(batches(8)):
        model[2].factor = math.inf if index == 3 else 1.0  # the second micro-batch of optimizer step 1
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            weights.append(snapshot(model))
    tracker.detach()

    assert len(weights) == 5
    assert same(weights[2], weights[1]), "the step holding micro-batch 3 changed the weights"
    assert all(not same(weights[i + 1], weights[i]) for i in (0, 2, 3))
    listed = _skip_list(tmp_path)
    assert [entry["batch_number"] for entry in listed] == [3]
    assert tracker.watcher is not None
    assert tracker.watcher.counters.batch_number == 7, "counted on: the last micro-batch (7) ends at the next forward"


# ------------------------------------------------------------------------------------------ the HF Trainer


def test_hf_trainer_skips_the_step_and_counts_it_as_the_trainer_counts_any(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from hf_trainer_run import train

    outcome = train(
        tmp_path / "out",
        inject_at=3,  # the second micro-batch of optimizer step 1 (accumulation 2)
        config={"on_detect": "skip", "report_dir": tmp_path / "reports"},
        max_steps=4,
        training_args={"logging_strategy": "steps", "logging_steps": 1},
    )

    assert outcome.error is None
    assert outcome.steps_done == 4, "the Trainer counts the skipped step as a step"
    listed = _skip_list(tmp_path / "reports")
    assert [(entry["batch_number"], entry["optimizer_step"]) for entry in listed] == [(3, 1)]
    assert outcome.callback.watcher is None
    assert all(torch.isfinite(value).all() for value in outcome.model.state_dict().values())


# ------------------------------------------------------------------------------------------- two DDP ranks


@pytest.mark.multiprocess
def test_two_ddp_ranks_skip_the_same_step_when_only_rank_1_sees_inf(tmp_path: Path) -> None:
    from torchrun_launch import run_torchrun

    # Two bad micro-batches on rank 1: 3 (optimizer step 1) and 6 (step 3), each settled on fresh keys.
    args = ("--out", str(tmp_path), "--inject-at", "3", "--inject-rank", "1", "--inject-again", "6")
    result = run_torchrun("skip_ddp_run.py", *args)

    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    for outcome in outcomes:
        assert outcome["error"] is None
        assert outcome["changed"] == [True, False, True, False, True], "steps 1 and 3 skipped"
        assert [(entry["batch_number"], entry["rank"]) for entry in outcome["skipped"]] == [(3, 1), (6, 1)]
        assert outcome["finite"]
    assert outcomes[0]["weights"] == outcomes[1]["weights"], "the ranks took different decisions"
    listed = _skip_list(tmp_path / "reports")
    assert [(entry["batch_number"], entry["rank"], entry["optimizer_step"]) for entry in listed] == [
        (3, 1, 1),
        (6, 1, 3),
    ]
    assert (tmp_path / "reports" / "nanwatch-report-rank1-batch3.txt").exists()


# ------------------------------------------------------------------------- the limit of skips in a row, per framework


def test_lightning_stops_at_the_limit_of_skips_in_a_row(tmp_path: Path) -> None:
    pytest.importorskip("lightning")

    from nanwatch.adapters.lightning import OverflowCallback

    callback = OverflowCallback(on_detect="skip", max_consecutive_skips=2, report_dir=tmp_path)
    trainer = lightning_trainer(8, [callback])
    inf_from_batch_2 = lightning_regressor(
        lambda params: torch.optim.SGD(params, lr=0.01), lambda index: math.inf if index >= 2 else 1.0
    )
    with pytest.raises(StepsSkippedInARow) as caught:
        trainer.fit(inf_from_batch_2, torch.utils.data.DataLoader(batches(8), batch_size=None))

    assert (caught.value.batch_number, caught.value.skipped) == (4, 2)
    assert [entry["batch_number"] for entry in _skip_list(tmp_path)] == [2, 3]


def test_accelerate_stops_at_the_limit_of_skips_in_a_row(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from nanwatch.adapters.accelerate import OverflowTracker

    tracker = OverflowTracker(on_detect="skip", max_consecutive_skips=1, report_dir=tmp_path)
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    tracker.attach(accelerator, model)

    def train() -> None:
        for index, (x, y) in enumerate(batches(6)):
            model[2].factor = math.inf if index in (1, 3, 4) else 1.0  # 1 skipped, 3 skipped, 4: a second in a row
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    with pytest.raises(StepsSkippedInARow) as caught:
        train()
    tracker.detach()

    assert (caught.value.batch_number, caught.value.skipped) == (4, 1)
    assert [entry["batch_number"] for entry in _skip_list(tmp_path)] == [1, 3]


def test_hf_trainer_stops_at_the_limit_of_skips_in_a_row(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    class InfFromCall2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = small_mlp()
            self.calls = 0

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            self.net[2].factor = math.inf if self.calls >= 2 else 1.0
            self.calls += 1
            logits = self.net(x)
            return {"loss": nn.functional.mse_loss(logits, labels), "logits": logits}

    arguments = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=1,
        max_steps=8,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = OverflowTrainerCallback(on_detect="skip", max_consecutive_skips=3, report_dir=tmp_path / "reports")
    trainer = Trainer(
        model=InfFromCall2(),
        args=arguments,
        train_dataset=[{"x": x, "labels": y} for x, y in batches(8)],
        data_collator=lambda items: items[0],
        callbacks=[callback],
    )
    with pytest.raises(StepsSkippedInARow) as caught:
        trainer.train()

    assert (caught.value.batch_number, caught.value.skipped) == (5, 3)
    assert [entry["batch_number"] for entry in _skip_list(tmp_path / "reports")] == [2, 3, 4]
    assert trainer.state.global_step == 5, "steps 0-4 ran (2, 3, 4 applying nothing); step 5 raised before its update"
    assert callback.watcher is None
