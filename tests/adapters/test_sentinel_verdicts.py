"""Sentinel mode's replay verdicts through the real frameworks (Accelerate, Lightning, the transformers Trainer), on
the CPU, with small models.

Each verdict the plain-loop tests in tests/core/features/test_sentinel.py reach is reached here through an adapter,
with the framework driving the loop:

- Accelerate, a loop that refills one preallocated input buffer with `.copy_()` (CUDA-graph style) inside
  `accelerator.accumulate(model)`: a micro-batch that does not step is checked only at the next forward, after the
  refill. Kept by reference (`sentinel_copy_inputs="never"`) the input is "not_replayable"; copied (the default), the
  replay runs what the forward was given and the nan is "reproduced".
- Lightning with `accumulate_grad_batches=2`: an fp16 weight-gradient overflow in the second micro-batch of a window
  is "reproduced" at its parameter (a `grad weight` line holding inf); a nan-gradient loss computed in
  `training_step` is "born_in_the_loss".
- The transformers Trainer: a `compute_loss` override whose loss has a nan gradient is "born_in_the_loss"; a forward
  that divides its `x` keyword input in place is "reproduced" with the defaults (the small input was copied) and
  "not_replayable", naming `input.x`, when inputs are kept by reference.

No verdict other than "not_reproduced" may point at the hardware.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from nanwatch import NonFiniteError  # noqa: E402
from nanwatch.adapters.accelerate import OverflowTracker  # noqa: E402
from nanwatch.adapters.hf_trainer import OverflowTrainerCallback  # noqa: E402
from nanwatch.adapters.lightning import OverflowCallback  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("fresh_accelerate_state"),  # the HF Trainer builds an Accelerator too
    pytest.mark.filterwarnings(
        "ignore:.*does not have many workers.*",
        "ignore:.*isinstance\\(treespec, LeafSpec\\).*",
        "ignore:.*smaller than the logging interval.*",
    ),
]

REPLAYED = "reproduced by replaying micro-batch"
HARDWARE = "hardware fault"


def _replay_section(report_dir: Path, batch: int) -> dict[str, Any]:
    """The "replay" section of the JSON report written for `batch`."""
    data = json.loads((report_dir / f"nanwatch-report-rank0-batch{batch}.json").read_text(encoding="utf-8"))
    section: dict[str, Any] = data["replay"]
    return section


def _loss_nan_gradient(out: torch.Tensor) -> torch.Tensor:
    # Finite in value (torch.where picks 0 wherever sqrt(out) is nan), nan in gradient (0 times sqrt's nan gradient).
    return torch.where(out > 0, out.sqrt(), 0.0).sum()


# ------------------------------------------------------------------------------ Accelerate: a refilled input buffer


class NanWhenLarge(nn.Module):
    """A nan output when the input's first value is above 100, as the buffer holds it at the call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * float("nan") if bool(x[0, 0] > 100) else y


# Micro-batch 4 holds the large value and opens the window {4, 5}: it does not step, so the Accelerate adapter checks
# it as micro-batch 5's forward begins, after the loop refilled the buffer with 5.0.
BUFFER_VALUES = (1.0, 2.0, 3.0, 4.0, 1000.0, 5.0, 6.0, 7.0)
LARGE_AT = 4


def _accelerate_refilled_buffer(copy_inputs: str, report_dir: Path) -> tuple[NonFiniteError, list[int]]:
    tracker = OverflowTracker(mode="sentinel", sentinel_copy_inputs=copy_inputs, report_dir=report_dir)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True, log_with=[tracker])
    torch.manual_seed(0)
    model = NanWhenLarge()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    tracker.attach(accelerator, model)
    buffer = torch.zeros(1, 2)  # one preallocated input, refilled for every micro-batch
    started: list[int] = []
    with tracker:
        for index, value in enumerate(BUFFER_VALUES):
            buffer.copy_(torch.full((1, 2), value))
            started.append(index)
            with accelerator.accumulate(model):
                try:
                    loss = model(buffer).sum()
                except NonFiniteError as error:
                    return error, started
                accelerator.backward(loss)
                optimizer.step()  # a no-op inside an accumulation window
                optimizer.zero_grad()
    raise AssertionError(f"sentinel_copy_inputs={copy_inputs!r}: nothing detected")


def test_accelerate_a_refilled_buffer_kept_by_reference_is_not_replayable(tmp_path: Path) -> None:
    error, started = _accelerate_refilled_buffer("never", tmp_path)
    assert started[-1] == LARGE_AT + 1, "detected before the loop refilled the buffer: nothing is exercised"
    assert error.replay == "not_replayable", error.report
    assert error.batch_number == LARGE_AT
    assert error.module_name is None  # nothing was replayed: no module's frame holds it
    # The only frames recorded are the loss's: no culprit may say the loss made it from a finite output.
    assert error.culprit is None
    assert "computed outside the watched modules" not in error.report
    assert f"not replayable: input[0] of micro-batch {LARGE_AT} changed since" in error.report
    assert "the sentinel saw inf/nan in output of the model" in error.report
    assert HARDWARE not in error.report
    assert "not reproduced" not in error.report
    section = _replay_section(tmp_path, LARGE_AT)
    assert section["verdict"] == "not_replayable"
    assert section["changed"] == [f"input[0] of micro-batch {LARGE_AT}"]


def test_accelerate_a_refilled_buffer_copied_by_default_is_reproduced(tmp_path: Path) -> None:
    error, started = _accelerate_refilled_buffer("auto", tmp_path)
    assert started[-1] == LARGE_AT + 1, "detected before the loop refilled the buffer: nothing is exercised"
    assert error.replay == "reproduced", error.report
    assert error.batch_number == LARGE_AT
    assert error.culprit is not None
    assert error.culprit.class_name == "NanWhenLarge"  # the top-level model's own code multiplied by nan
    assert f"{REPLAYED} {LARGE_AT} " in error.report
    assert HARDWARE not in error.report
    assert "not replayable" not in error.report
    assert _replay_section(tmp_path, LARGE_AT)["verdict"] == "reproduced"


# ------------------------------------------------------------------------------ Lightning, gradient accumulation


def _lightning_fit(module: pl.LightningModule, data: TensorDataset, root: Path, **config: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[OverflowCallback(mode="sentinel", report_dir=root / "reports", **config)],
    )
    trainer.fit(module, DataLoader(data, batch_size=100, shuffle=False))
    return trainer


class WideHalfModule(pl.LightningModule):
    """A float16 Linear whose forward and output gradients stay small while its weight's gradient (a sum over 100
    rows) overflows float16 when the input holds 300: the classic fp16 weight-gradient overflow. The loss is summed in
    float32, so it stays finite too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4).half()
        with torch.no_grad():
            self.fc.weight.fill_(1e-3)
            self.fc.bias.zero_()
        self.finite_losses: list[bool] = []
        self.finite_outputs: list[bool] = []

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        out = self.fc(x)
        loss = (out.float() * 300).sum()
        self.finite_outputs.append(bool(torch.isfinite(out).all()))
        self.finite_losses.append(bool(torch.isfinite(loss)))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-9)


OVERFLOW_AT = 3  # the second micro-batch of the window {2, 3}


def test_lightning_an_fp16_weight_gradient_overflow_is_reproduced_at_its_parameter(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = WideHalfModule()
    x = torch.full((6 * 100, 4), 0.01, dtype=torch.float16)
    x[OVERFLOW_AT * 100 : (OVERFLOW_AT + 1) * 100] = 300.0
    with pytest.raises(NonFiniteError) as caught:
        _lightning_fit(module, TensorDataset(x), tmp_path)
    error = caught.value
    # The forward and the loss stayed finite: only the weight's gradient overflowed.
    assert module.finite_outputs == [True] * (OVERFLOW_AT + 1)
    assert module.finite_losses == [True] * (OVERFLOW_AT + 1)
    assert error.replay == "reproduced", error.report
    assert error.batch_number == OVERFLOW_AT
    assert error.optimizer_step == 1  # the step of the window {2, 3} never ran
    assert error.module_name == "fc"
    assert f"{REPLAYED} {OVERFLOW_AT} " in error.report
    assert "non-finite gradients about to be applied" in error.report
    line = next(line for line in error.report.splitlines() if line.endswith("grad weight"))
    assert "inf" in line
    assert HARDWARE not in error.report
    assert _replay_section(tmp_path / "reports", OVERFLOW_AT)["verdict"] == "reproduced"


class SqrtLossModule(pl.LightningModule):
    """A float32 Linear; at micro-batch `trap_at` the loss is the "safe sqrt" (finite value, nan gradient)."""

    def __init__(self, trap_at: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.trap_at = trap_at
        self.trapped: list[tuple[bool, bool]] = []  # (the loss is finite, some output is <= 0) at trap_at

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        out = self.fc(x)
        if batch_idx != self.trap_at:
            return out.pow(2).mean()
        loss = _loss_nan_gradient(out)
        self.trapped.append((bool(torch.isfinite(loss)), bool((out <= 0).any())))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("trap_at", [2, 3], ids=["first-of-the-window", "second-of-the-window"])
def test_lightning_a_nan_gradient_loss_in_training_step_is_born_in_the_loss(tmp_path: Path, trap_at: int) -> None:
    torch.manual_seed(0)
    module = SqrtLossModule(trap_at)
    data = TensorDataset(torch.randn(6 * 100, 2, generator=torch.Generator().manual_seed(1)))
    with pytest.raises(NonFiniteError) as caught:
        _lightning_fit(module, data, tmp_path)
    error = caught.value
    assert module.trapped == [(True, True)], "the loss must be finite, with a negative output to take sqrt of"
    assert error.replay == "born_in_the_loss", error.report
    assert error.batch_number == trap_at  # checked before the step of the window {2, 3}, named where it was born
    assert error.module_name == "(loss)"
    assert f"born in the loss: the gradient w.r.t. the model's output in micro-batch {trap_at}" in error.report
    assert "not reproduced" not in error.report
    assert HARDWARE not in error.report
    section = _replay_section(tmp_path / "reports", trap_at)
    assert section["verdict"] == "born_in_the_loss"
    assert section["micro_batch"] == trap_at


# ------------------------------------------------------------------------------ the transformers Trainer


class Points(Dataset[dict[str, torch.Tensor]]):
    """Random 2-d points and targets; the item fetched `large_at`-th (in fetch order, whatever the sampler picks)
    holds 1000 everywhere. With batch size 1 that is micro-batch `large_at`."""

    def __init__(self, size: int, large_at: int | None = None) -> None:
        self.size, self.large_at = size, large_at
        self.fetched = 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.randn(2, generator=torch.Generator().manual_seed(index))
        if self.fetched == self.large_at:
            x = torch.full((2,), 1000.0)
        self.fetched += 1
        return {"x": x, "labels": torch.randn(1, generator=torch.Generator().manual_seed(100 + index))}


class Regressor(nn.Module):
    """`model(x=..., labels=...)`; with `normalises`, a nan output when `x` is large, after dividing `x` in place."""

    def __init__(self, normalises: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.normalises = normalises

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        large = bool(x.abs().max() > 100)
        if self.normalises:
            x.div_(x.abs().max())  # the forward changes its input in place
        logits = self.fc(x)
        if self.normalises and large:
            logits = logits * float("nan")
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.mse_loss(logits, labels)
        return out


class SqrtLossTrainer(Trainer):
    """A `compute_loss` override whose loss, at its `trap_at`-th call, is the "safe sqrt" of the logits."""

    trap_at = 2

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        calls = getattr(self, "calls", 0)
        self.calls = calls + 1
        outputs = model(**inputs)
        logits = outputs["logits"]
        if calls == self.trap_at:
            logits = logits - logits.detach().max() - 1  # every output negative: sqrt's gradient is nan everywhere
            loss = _loss_nan_gradient(logits)
            self.trapped = bool(torch.isfinite(loss))
        else:
            loss = nn.functional.mse_loss(logits, inputs["labels"])
        return (loss, outputs) if return_outputs else loss


def _training_args(root: Path) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(root / "hf"),
        per_device_train_batch_size=1,
        max_steps=6,
        learning_rate=0.01,
        optim="sgd",
        lr_scheduler_type="constant",
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )


def test_hf_trainer_a_nan_gradient_loss_in_compute_loss_is_born_in_the_loss(tmp_path: Path) -> None:
    torch.manual_seed(0)
    callback = OverflowTrainerCallback(mode="sentinel", report_dir=tmp_path / "reports")
    trainer = SqrtLossTrainer(
        model=Regressor(), args=_training_args(tmp_path), train_dataset=Points(16), callbacks=[callback]
    )
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    error = caught.value
    trap_at = SqrtLossTrainer.trap_at
    assert trainer.trapped, "the trapped loss must be finite in value"
    assert trainer.state.global_step == trap_at  # the steps before it ran; its own never did
    assert error.replay == "born_in_the_loss", error.report
    assert error.batch_number == trap_at
    assert error.module_name == "(loss)"
    assert f"born in the loss: the gradient w.r.t. the model's output.logits in micro-batch {trap_at}" in error.report
    assert HARDWARE not in error.report
    assert "not reproduced" not in error.report
    assert _replay_section(tmp_path / "reports", trap_at)["verdict"] == "born_in_the_loss"


X_LARGE_AT = 2


def _hf_normalising_run(root: Path, **config: Any) -> tuple[NonFiniteError, Trainer]:
    torch.manual_seed(0)
    callback = OverflowTrainerCallback(mode="sentinel", report_dir=root / "reports", **config)
    trainer = Trainer(
        model=Regressor(normalises=True),
        args=_training_args(root),
        train_dataset=Points(16, large_at=X_LARGE_AT),
        callbacks=[callback],
    )
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    return caught.value, trainer


def test_hf_trainer_an_input_the_forward_changes_in_place_is_copied_and_reproduced(tmp_path: Path) -> None:
    error, trainer = _hf_normalising_run(tmp_path)  # sentinel_copy_inputs="auto": 8 bytes of x are copied
    assert trainer.state.global_step == X_LARGE_AT
    assert error.replay == "reproduced", error.report
    assert error.batch_number == X_LARGE_AT  # the replay ran the x the forward was given, not the one it left
    assert error.culprit is not None
    assert error.culprit.class_name == "Regressor"
    assert f"{REPLAYED} {X_LARGE_AT} " in error.report
    assert "the sentinel saw inf/nan in output.logits of the model" in error.report
    assert HARDWARE not in error.report
    assert "not replayable" not in error.report
    assert _replay_section(tmp_path / "reports", X_LARGE_AT)["verdict"] == "reproduced"


def test_hf_trainer_an_input_the_forward_changes_in_place_kept_by_reference_is_not_replayable(tmp_path: Path) -> None:
    error, trainer = _hf_normalising_run(tmp_path, sentinel_copy_inputs="never")
    assert trainer.state.global_step == X_LARGE_AT
    assert error.replay == "not_replayable", error.report
    assert error.batch_number == X_LARGE_AT
    assert f"not replayable: input.x of micro-batch {X_LARGE_AT} changed since" in error.report
    assert HARDWARE not in error.report
    assert "not reproduced" not in error.report
    assert "sentinel_copy_inputs='always'" in error.report
    section = _replay_section(tmp_path / "reports", X_LARGE_AT)
    assert section["verdict"] == "not_replayable"
    assert section["changed"] == [f"input.x of micro-batch {X_LARGE_AT}"]
