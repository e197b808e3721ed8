"""`OverflowTracker` under fp16 loss scaling, with a real `Accelerator` and a real `torch.amp.GradScaler` on the CPU.

What Accelerate does with `mixed_precision="fp16"` on the CPU (accelerate 1.x): nothing. It builds no GradScaler
(`accelerator.scaler` stays None), sets `native_amp` False, and so adds no autocast either: the run is plain fp32
(the first test pins this down). There is no switch that gives a CPU run a scaler (`GradScalerKwargs` only shapes the
one it would build on a GPU). So the tests set by hand the two attributes `Accelerator.__init__` sets for fp16 on a
GPU: `native_amp = True` (its `prepare()` then wraps the forward in `torch.autocast("cpu", dtype=torch.float16)`,
and `clip_grad_norm_` unscales first) and `scaler`, a real `torch.amp.GradScaler("cpu")` built from the run's own
`GradScalerKwargs`. Everything else (prepare, `backward` scaling the loss, `AcceleratedOptimizer.step` calling
`scaler.step` and `scaler.update`, gradient accumulation) is Accelerate's own code.

The overflow in the first tests is real: with the loss `out.float().sum()` the gradient reaching a float16 Linear
output is the loss scale itself, and 65536 is more than float16 holds (65504).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402
from tests.engine_helpers import loss_scale
from tests.models import InfInBackward  # noqa: E402
from torch import nn  # noqa: E402

from nanwatch import LossScaleBelowFloor, NonFiniteError  # noqa: E402
from nanwatch.adapters.accelerate import OverflowTracker  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def fp16_run(
    tracker: OverflowTracker,
    model: nn.Module,
    *,
    init_scale: float = 2.0**16,
    accumulation: int = 1,
    fused_adam: bool = False,
) -> tuple[Accelerator, nn.Module, Any]:
    accelerator = Accelerator(
        mixed_precision="fp16",
        cpu=True,
        gradient_accumulation_steps=accumulation,
        log_with=[tracker],
        kwargs_handlers=[GradScalerKwargs(init_scale=init_scale)],
    )
    # What Accelerator.__init__ does for fp16 on a GPU, done here on the CPU's own GradScaler (see the module doc).
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", **accelerator.scaler_handler.to_kwargs())
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        if fused_adam
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    tracker.attach(accelerator, model)
    return accelerator, model, optimizer


def train(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: Any,
    tracker: OverflowTracker,
    micro_batches: int,
    *,
    nan_loss_at: int | None = None,
    input_grad: bool = False,
) -> list[torch.Tensor]:
    """The usual Accelerate loop on batches of 1; returns the first weight as each micro-batch begins."""
    generator = torch.Generator().manual_seed(0)
    first = next(model.parameters())
    weights = []
    for micro_batch in range(micro_batches):
        weights.append(first.detach().clone())
        x = torch.randn(1, 4, generator=generator) * 0.01
        if input_grad:
            x.requires_grad_()
        with accelerator.accumulate(model):
            loss = model(x).float().sum()
            if micro_batch == nan_loss_at:
                loss = loss * float("nan")  # a loss computed outside the model goes bad
            accelerator.backward(tracker.watch_loss(loss))
            optimizer.step()
            optimizer.zero_grad()
    return weights


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def test_fp16_on_the_cpu_gets_no_scaler_from_accelerate_and_nothing_is_excused() -> None:
    tracker = OverflowTracker(watch_gradients=True)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True, log_with=[tracker])
    assert accelerator.scaler is None  # the finding the module doc states: no scaler, no autocast, on the CPU
    assert not accelerator.native_amp
    model, optimizer = accelerator.prepare(nn.Sequential(nn.Linear(4, 4), InfInBackward()), None)
    tracker.attach(accelerator, model)
    assert tracker.watcher is not None
    assert loss_scale(tracker.watcher) is None
    accelerator.backward(model(torch.ones(1, 4)).sum())
    with pytest.raises(NonFiniteError) as info:  # without a scaler an inf gradient is fatal
        model(torch.ones(1, 4))  # the next micro-batch's forward checks the previous one
    assert not isinstance(info.value, LossScaleBelowFloor)
    assert info.value.module_name == "1"


@pytest.mark.parametrize(
    ("accumulation", "init_scale", "fused_adam"),
    [
        pytest.param(1, 2.0**16, False, id="a-step-per-micro-batch"),
        # Accelerate divides the loss by the accumulation steps: twice the scale overflows the same way.
        pytest.param(2, 2.0**17, False, id="gradient-accumulation"),
        # GradScaler.step calls a fused optimizer on skipped steps too (its pre-hook runs), with `found_inf` set.
        pytest.param(1, 2.0**16, True, id="fused-adamw"),
    ],
)
def test_an_overflow_on_a_step_the_scaler_skips_is_recorded_and_training_goes_on(
    accumulation: int, init_scale: float, fused_adam: bool
) -> None:
    tracker = OverflowTracker(watch_gradients=True)
    accelerator, model, optimizer = fp16_run(
        tracker, linear(), init_scale=init_scale, accumulation=accumulation, fused_adam=fused_adam
    )
    weights = train(accelerator, model, optimizer, tracker, micro_batches=3 * accumulation)
    tracker.detach()

    assert accelerator.scaler is not None
    assert accelerator.scaler.get_scale() == init_scale / 2  # one step skipped, then too few steps to grow
    # The first window's step was skipped (weights unchanged), the second one applied.
    assert torch.equal(weights[0], weights[accumulation])
    assert not torch.equal(weights[accumulation], weights[2 * accumulation])
    watcher = tracker.watcher
    assert watcher is not None
    assert loss_scale(watcher) is not None
    history = loss_scale(watcher).history()
    last_of_first_window = accumulation - 1
    assert [(r.batch_number, r.scale) for r in history.records] == [
        (0, init_scale),
        (last_of_first_window, init_scale / 2),
    ]
    assert history.skipped_steps == 1
    assert history.gradient_overflows == accumulation  # every micro-batch of the skipped window
    assert [o.skipped for o in loss_scale(watcher).overflows] == [True] * accumulation
    assert loss_scale(watcher).overflows[0].report.module_name == ""  # the root Linear's bias gradient
    # A plain optimizer's step never runs on a skipped step; a fused one runs (and applies nothing).
    assert watcher.counters.optimizer_step == (3 if fused_adam else 2)
    assert watcher.counters.batch_number == 3 * accumulation - 1  # the last micro-batch ended at detach
    assert history.to_text().startswith(
        f"Loss scale (GradScaler): {int(init_scale)} at batch 0 -> {int(init_scale // 2)} at batch "
        f"{last_of_first_window}; 1 skipped step"
    )


def test_the_scale_falling_below_the_floor_stops_the_run_with_the_report_on_disk(tmp_path: Path) -> None:
    tracker = OverflowTracker(watch_gradients=True, min_loss_scale=1.0, report_dir=tmp_path)
    torch.manual_seed(0)
    accelerator, model, optimizer = fp16_run(tracker, nn.Sequential(nn.Linear(4, 4), InfInBackward()), init_scale=4.0)
    with pytest.raises(LossScaleBelowFloor) as info:
        train(accelerator, model, optimizer, tracker, micro_batches=10)
    error = info.value
    assert error.batch_number == 2  # 4 -> 2 -> 1 -> 0.5: the third skipped step
    assert (error.loss_scale, error.min_loss_scale) == (0.5, 1.0)
    assert [scale for _, _, scale in error.scale_history] == [4.0, 2.0, 1.0, 0.5]
    assert error.module_name == "1"  # where the last overflow first appeared (backward)
    assert "fell to 0.5 at batch_number=2, below min_loss_scale=1" in str(error)
    # Written before it was raised, as text and JSON, with the history.
    text = (tmp_path / "nanwatch-report-rank0-batch2.txt").read_text()
    assert "Loss scale (GradScaler): 4 at batch 0 -> 2 at batch 0 -> 1 at batch 1 -> 0.5 at batch 2" in text
    assert text.rstrip("\n") == error.report
    data = json.loads((tmp_path / "nanwatch-report-rank0-batch2.json").read_text())
    assert data["loss_scale"]["skipped_steps"] == 3
    assert data["loss_scale"]["current"] == 0.5
    # Raised from micro-batch 3's forward, which ends micro-batch 2; no step ever ran and the hooks are gone.
    assert tracker.watcher is not None
    assert not tracker.watcher.attached
    assert tracker.watcher.counters.optimizer_step == 0


def test_a_nan_loss_given_to_watch_loss_stops_the_run_under_a_scaler() -> None:
    tracker = OverflowTracker(watch_gradients=True)
    accelerator, model, optimizer = fp16_run(tracker, linear(), init_scale=2.0**15)
    start = next(model.parameters()).detach().clone()
    with pytest.raises(NonFiniteError) as info:
        train(accelerator, model, optimizer, tracker, micro_batches=5, nan_loss_at=2)
    error = info.value
    assert not isinstance(error, LossScaleBelowFloor)
    # Every gradient is nan, which alone would pass for an overflow the scaler skips; the loss frame says otherwise.
    assert (error.batch_number, error.module_name) == (2, "(loss)")
    assert "Loss scale (GradScaler): 32768 at batch 0" in error.report
    assert torch.isfinite(next(model.parameters())).all()
    assert not torch.equal(next(model.parameters()), start)  # steps 0 and 1 ran


def test_non_finite_weights_stop_the_run_under_a_scaler() -> None:
    tracker = OverflowTracker(watch_gradients=True)
    accelerator, model, optimizer = fp16_run(tracker, linear(), init_scale=2.0**15)
    train(accelerator, model, optimizer, tracker, micro_batches=2)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")  # written by something outside the optimizer
    with pytest.raises(NonFiniteError) as info:
        train(accelerator, model, optimizer, tracker, micro_batches=2)
    error = info.value
    assert not isinstance(error, LossScaleBelowFloor)
    assert (error.batch_number, error.module_name) == (2, "")
    assert "Linear" in error.report
    assert "weight" in error.report


def test_inf_gradients_on_a_step_the_scaler_lets_through_stop_before_the_step() -> None:
    # The input's gradient is inf, but the scaler only looks at the parameters' (finite): it lets the step run.
    tracker = OverflowTracker(watch_gradients=True)
    torch.manual_seed(0)
    accelerator, model, optimizer = fp16_run(tracker, nn.Sequential(InfInBackward(), nn.Linear(4, 4)), init_scale=4.0)
    start = model[1].weight.detach().clone()
    with pytest.raises(NonFiniteError) as info:
        train(accelerator, model, optimizer, tracker, micro_batches=3, input_grad=True)
    error = info.value
    assert not isinstance(error, LossScaleBelowFloor)
    assert (error.batch_number, error.module_name) == (0, "0")
    assert "Loss scale (GradScaler): 4 at batch 0" in error.report
    assert torch.equal(model[1].weight, start)  # raised in the step pre-hook: the step never ran
    assert tracker.watcher is not None
    assert not tracker.watcher.attached
