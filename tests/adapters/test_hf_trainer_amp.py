"""`OverflowTrainerCallback` under fp16 loss scaling, in real transformers `Trainer` runs on the CPU.

What the Trainer does with `TrainingArguments(fp16=True, use_cpu=True)`: it accepts it and builds its `Accelerator`
with `mixed_precision="fp16"`, which on the CPU builds no GradScaler and adds no autocast (`accelerator.scaler` is
None, `native_amp` False): the run is plain fp32 (the first test pins this down). The Trainer has no switch of its own
for a scaler; it relies on its accelerator's (it also saves and loads `accelerator.scaler` in checkpoints). So the
tests set by hand, on `trainer.accelerator` before `train()` prepares the optimizer, the two attributes
`Accelerator.__init__` sets for fp16 on a GPU: `native_amp = True` (the forward then runs under
`torch.autocast("cpu", dtype=torch.float16)` and the gradient clipping unscales first) and `scaler`, a real
`torch.amp.GradScaler("cpu")`. The rest is the Trainer's and Accelerate's own code, with the Trainer's default
optimizer (fused AdamW, which `GradScaler.step` calls on every step with `found_inf` set) and gradient clipping.

The overflow in the first tests is real: the model's loss is the sum of a float16 Linear's outputs, so the gradient
reaching that output is the loss scale itself, and 65536 is more than float16 holds (65504).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from tests.models import InfInBackward  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from nanwatch import LossScaleBelowFloor, NonFiniteError  # noqa: E402
from nanwatch.adapters.hf_trainer import OverflowTrainerCallback  # noqa: E402


class SumModel(nn.Module):
    """Returns `{"loss": sum of the outputs, "logits"}` as a transformers model does.

    Args:
        before: a module run on the input (made a leaf that requires grad) before the Linear.
        after: a module run on the Linear's output.
        nan_loss_at: the training forward (0-indexed) whose loss is nan, all activations finite.
    """

    def __init__(
        self, before: nn.Module | None = None, after: nn.Module | None = None, nan_loss_at: int | None = None
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.before = before
        self.linear = nn.Linear(4, 4)
        self.after = after
        self.nan_loss_at = nan_loss_at
        self.forwards = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if self.before is not None:
            x = self.before(x.detach().requires_grad_())
        out = self.linear(x)
        if self.after is not None:
            out = self.after(out)
        loss = out.float().sum()
        if self.training:
            if self.forwards == self.nan_loss_at:
                loss = loss * float("nan")
            self.forwards += 1
        return {"loss": loss, "logits": out}


class SmallInputs(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 16) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0)) * 0.01

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": torch.zeros(1)}


class WeightsEachStep(TrainerCallback):
    """The Linear's weight as each optimizer step begins; can write inf into it before step `poison_at`."""

    def __init__(self, poison_at: int | None = None) -> None:
        self.weights: list[torch.Tensor] = []
        self.poison_at = poison_at

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module, **kwargs: Any) -> None:
        weight = model.linear.weight
        if state.global_step == self.poison_at:
            with torch.no_grad():
                weight[0, 0] = float("inf")  # written by something outside the optimizer
        self.weights.append(weight.detach().clone())


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def fp16_trainer(
    tmp_path: Path,
    model: nn.Module,
    callbacks: list[TrainerCallback],
    *,
    init_scale: float,
    max_steps: int,
    growth_interval: int = 2000,
    **settings: Any,
) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        fp16=True,
        use_cpu=True,
        per_device_train_batch_size=1,
        max_steps=max_steps,
        learning_rate=0.1,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **settings,
    )
    trainer = Trainer(model=model, args=args, train_dataset=SmallInputs(), callbacks=callbacks)
    # What Accelerator.__init__ does for fp16 on a GPU, done here on the CPU's own GradScaler (see the module doc);
    # before train(), which prepares the optimizer with the accelerator's scaler.
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    return trainer


def test_fp16_on_the_cpu_gets_no_scaler_from_the_trainer_and_nothing_is_excused(tmp_path: Path) -> None:
    callback = OverflowTrainerCallback(watch_gradients=True)
    args = TrainingArguments(
        output_dir=str(tmp_path), fp16=True, use_cpu=True, max_steps=2, report_to=[], disable_tqdm=True
    )
    trainer = Trainer(
        model=SumModel(after=InfInBackward()), args=args, train_dataset=SmallInputs(), callbacks=[callback]
    )
    assert trainer.accelerator.mixed_precision == "fp16"
    assert trainer.accelerator.scaler is None  # the finding the module doc states
    assert not trainer.accelerator.native_amp
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    assert not isinstance(info.value, LossScaleBelowFloor)
    assert info.value.batch_number == 0
    assert callback.loss_scale is None


@pytest.mark.parametrize(
    "optim",
    [
        # The Trainer's default: GradScaler.step calls it on skipped steps too, with `found_inf` set.
        "adamw_torch_fused",
        "sgd",  # called only on the steps the scaler lets through
    ],
)
def test_an_overflow_on_a_step_the_scaler_skips_is_recorded_and_training_goes_on(tmp_path: Path, optim: str) -> None:
    callback = OverflowTrainerCallback(watch_gradients=True)
    weights = WeightsEachStep()
    model = SumModel()
    trainer = fp16_trainer(tmp_path, model, [callback, weights], init_scale=2.0**16, max_steps=3, optim=optim)
    trainer.train()

    assert trainer.state.global_step == 3  # the Trainer counts the skipped step too
    assert trainer.accelerator.scaler is not None
    assert trainer.accelerator.scaler.get_scale() == 2.0**15
    assert torch.equal(weights.weights[0], weights.weights[1])  # step 0 was skipped ...
    assert not torch.equal(weights.weights[1], weights.weights[2])  # ... step 1 was applied
    assert torch.isfinite(model.linear.weight).all()
    history = callback.loss_scale
    assert history is not None  # kept after train() ended
    # Read again after each step (on_optimizer_step): the drop is put on the micro-batch whose step was skipped.
    assert [(r.batch_number, r.scale) for r in history.records] == [(0, 65536.0), (0, 32768.0)]
    assert (history.skipped_steps, history.gradient_overflows) == (1, 1)
    assert callback.watcher is None
    assert hook_count(model) == 0


def test_under_gradient_accumulation_the_scale_grows_then_backs_off_and_training_goes_on(tmp_path: Path) -> None:
    # The Trainer divides the loss by the 2 accumulation steps: 65536 is clean, and after 2 clean steps the scale
    # doubles to 131072, which overflows in the first micro-batch after an applied step.
    callback = OverflowTrainerCallback(watch_gradients=True)
    weights = WeightsEachStep()
    trainer = fp16_trainer(
        tmp_path,
        SumModel(),
        [callback, weights],
        init_scale=2.0**16,
        growth_interval=2,
        max_steps=4,
        gradient_accumulation_steps=2,
    )
    trainer.train()

    history = callback.loss_scale
    assert history is not None
    # Each change is put on the micro-batch that ended the step it followed: steps 1 (grew) and 2 (skipped).
    assert [(r.batch_number, r.scale) for r in history.records] == [(0, 65536.0), (3, 131072.0), (5, 65536.0)]
    assert (history.skipped_steps, history.gradient_overflows) == (1, 2)  # micro-batches 4 and 5, one step
    steps = weights.weights
    assert not torch.equal(steps[0], steps[1])
    assert not torch.equal(steps[1], steps[2])
    assert torch.equal(steps[2], steps[3])  # step 2 (micro-batches 4 and 5) was skipped


def test_the_scale_falling_below_the_floor_stops_the_run_with_the_report_on_disk(tmp_path: Path) -> None:
    callback = OverflowTrainerCallback(watch_gradients=True, min_loss_scale=1.0, report_dir=tmp_path / "reports")
    model = SumModel(after=InfInBackward())
    trainer = fp16_trainer(tmp_path, model, [callback], init_scale=4.0, max_steps=10)
    with pytest.raises(LossScaleBelowFloor) as info:
        trainer.train()
    error = info.value
    # 4 -> 2 -> 1 -> 0.5 after steps 0-2 were skipped, read after each step: the third skip is batch 2's.
    assert error.batch_number == 2
    assert (error.loss_scale, error.min_loss_scale) == (0.5, 1.0)
    assert [scale for _, _, scale in error.scale_history] == [4.0, 2.0, 1.0, 0.5]
    assert error.module_name == "after"  # where the last overflow first appeared (backward)
    assert "fell to 0.5 at batch_number=2, below min_loss_scale=1" in str(error)
    text = (tmp_path / "reports" / "nanwatch-report-rank0-batch2.txt").read_text()
    assert text.rstrip("\n") == error.report
    assert "Loss scale (GradScaler): 4 at batch 0 -> 2 at batch 0 -> 1 at batch 1 -> 0.5 at batch 2" in text
    data = json.loads((tmp_path / "reports" / "nanwatch-report-rank0-batch2.json").read_text())
    assert data["loss_scale"]["skipped_steps"] == 3
    assert callback.watcher is None
    assert callback.loss_scale is not None
    assert hook_count(model) == 0


def test_a_nan_loss_returned_by_the_model_stops_the_run_under_a_scaler(tmp_path: Path) -> None:
    callback = OverflowTrainerCallback(watch_gradients=True)
    trainer = fp16_trainer(tmp_path, SumModel(nan_loss_at=2), [callback], init_scale=2.0**15, max_steps=6)
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    error = info.value
    assert not isinstance(error, LossScaleBelowFloor)
    # Every gradient is nan, which alone would pass for an overflow; the model's own frame holds the nan loss.
    assert (error.batch_number, error.module_name) == (2, "")
    assert "Loss scale (GradScaler): 32768 at batch 0" in error.report
    assert "     nan      nan output.loss" in error.report
    assert "output.loss nan (float32)" in str(error)  # the culprit line


def test_non_finite_weights_stop_the_run_under_a_scaler(tmp_path: Path) -> None:
    callback = OverflowTrainerCallback(watch_gradients=True)
    weights = WeightsEachStep(poison_at=2)
    trainer = fp16_trainer(tmp_path, SumModel(), [callback, weights], init_scale=2.0**15, max_steps=6)
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    error = info.value
    assert not isinstance(error, LossScaleBelowFloor)
    assert (error.batch_number, error.module_name) == (2, "linear")
    assert "linear Linear" in error.report


def test_inf_gradients_on_a_step_the_scaler_lets_through_stop_before_the_step(tmp_path: Path) -> None:
    # The input's gradient is inf, but the scaler only looks at the parameters' (finite): it lets the step run.
    callback = OverflowTrainerCallback(watch_gradients=True)
    weights = WeightsEachStep()
    model = SumModel(before=InfInBackward())
    trainer = fp16_trainer(tmp_path, model, [callback, weights], init_scale=4.0, max_steps=3)
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    error = info.value
    assert not isinstance(error, LossScaleBelowFloor)
    assert (error.batch_number, error.module_name) == (0, "before")
    assert "Loss scale (GradScaler): 4 at batch 0" in error.report
    assert torch.equal(model.linear.weight, weights.weights[0])  # raised in the step pre-hook: the step never ran
    assert callback.watcher is None


def test_inf_gradients_right_after_a_skipped_step_are_not_taken_for_that_skip(tmp_path: Path) -> None:
    # Batch 0: the Linear overflows at 65536 and the scaler skips. Batch 1, at 32768: only the input's gradient is
    # inf, so the scaler lets step 1 through. Its check (before the step) must not take step 0's drop for a skip.
    callback = OverflowTrainerCallback(watch_gradients=True)
    weights = WeightsEachStep()
    model = SumModel(before=InfInBackward())
    trainer = fp16_trainer(tmp_path, model, [callback, weights], init_scale=2.0**16, max_steps=4)
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    error = info.value
    assert (error.batch_number, error.module_name) == (1, "before")
    assert "Loss scale (GradScaler): 65536 at batch 0 -> 32768 at batch 0; 1 skipped step" in error.report
    assert len(weights.weights) == 2
    assert torch.equal(model.linear.weight, weights.weights[0])  # step 0 skipped, step 1 never ran
