"""`OverflowCallback` with gradients and a GradScaler, in real Lightning `Trainer` runs on the CPU.

Lightning turns `precision="16-mixed"` into bf16 on the CPU, so the tests pass the float16 plugin themselves:
`MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))`, which is what Lightning builds on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from tests.engine_helpers import loss_scale
from tests.models import InfInBackward  # noqa: E402
from torch import nn  # noqa: E402

from nanwatch import LossScaleBelowFloor, NonFiniteError  # noqa: E402
from nanwatch.adapters.lightning import OverflowCallback  # noqa: E402


class Tiny(pl.LightningModule):
    """A Linear whose float16 bias gradient is the loss scale (batch 1): 65536 overflows, 32768 does not."""

    def __init__(self, fault: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 4), InfInBackward()) if fault else nn.Sequential(nn.Linear(4, 4))
        self.weights: list[torch.Tensor] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.weights.append(self.net[0].weight.detach().clone())
        return self.net(batch[0]).float().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: Tiny, callbacks: list[pl.Callback], steps: int, init_scale: float = 2.0**16) -> pl.Trainer:
    data = torch.utils.data.TensorDataset(torch.randn(steps, 4) * 0.01)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
    return trainer


def test_the_precision_plugins_scaler_is_followed_and_a_skipped_overflow_goes_on() -> None:
    callback = OverflowCallback(watch_gradients=True)
    module = Tiny()
    seen: dict[str, Any] = {}

    class Spy(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            assert callback.watcher is not None
            monitor = loss_scale(callback.watcher)
            assert monitor is not None
            seen["history"] = monitor.history()
            seen["overflows"] = list(monitor.overflows)

    trainer = _fit(module, [callback, Spy()], steps=3)
    assert trainer.global_step == 3  # Lightning counts skipped steps too
    history = seen["history"]
    assert [(r.batch_number, r.scale) for r in history.records] == [(0, 65536.0), (0, 32768.0)]
    assert history.skipped_steps == 1
    assert [overflow.skipped for overflow in seen["overflows"]] == [True]
    assert seen["overflows"][0].report.module_name == "net.0"
    assert torch.equal(module.weights[0], module.weights[1])  # the skipped step changed nothing
    assert not torch.equal(module.weights[1], module.weights[2])


def test_the_floor_stops_a_lightning_run() -> None:
    with pytest.raises(LossScaleBelowFloor) as info:
        _fit(Tiny(fault=True), [OverflowCallback(watch_gradients=True, min_loss_scale=1.0)], steps=10, init_scale=4.0)
    assert info.value.batch_number == 2  # 4 -> 2 -> 1 -> 0.5
    assert [scale for _, _, scale in info.value.scale_history] == [4.0, 2.0, 1.0, 0.5]
    assert info.value.module_name == "net.1"


def test_without_a_scaler_a_backward_inf_stops_before_the_step() -> None:
    module = Tiny(fault=True)
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        callbacks=[OverflowCallback(watch_gradients=True)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = module.net[0].weight.detach().clone()
    data = torch.utils.data.TensorDataset(torch.randn(3, 4))
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
    assert info.value.batch_number == 0
    assert info.value.module_name == "net.1"  # the backward of InfInBackward, found in on_before_optimizer_step
    assert torch.equal(module.net[0].weight, before)


class LeafInput(Tiny):
    """The input requires grad but is no parameter: its inf gradient is outside what the scaler looks at."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(InfInBackward(), nn.Linear(4, 4))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.weights.append(self.net[1].weight.detach().clone())
        return self.net(batch[0].clone().requires_grad_()).float().sum()


def test_inf_gradients_on_a_step_the_scaler_lets_through_stop_the_run_before_that_step() -> None:
    module = LeafInput()
    before = module.net[1].weight.detach().clone()
    with pytest.raises(NonFiniteError) as info:
        _fit(module, [OverflowCallback(watch_gradients=True)], steps=3, init_scale=4.0)
    assert not isinstance(info.value, LossScaleBelowFloor)
    assert info.value.batch_number == 0
    assert info.value.module_name == "net.0"
    assert "Loss scale (GradScaler): 4 at batch 0" in info.value.report
    # Raised in the optimizer's step pre-hook (inside scaler.step, on every rank alike): the step never ran.
    assert len(module.weights) == 1
    assert torch.equal(module.net[1].weight, before)
