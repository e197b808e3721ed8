"""The HF Trainer: `OverflowTrainerCallback` in a real `transformers.Trainer` (CPU; DDP with gloo under torchrun).

Evaluation runs every optimizer step when the scenario asks (`eval_strategy="steps"`, `eval_steps=1`). A checkpoint is
the Trainer's own `checkpoint-N` folder, resumed with `train(resume_from_checkpoint=...)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate.state import AcceleratorState, GradientState
from tests.adapters.conformance.common import (
    BATCH_SIZE,
    LEARNING_RATE,
    FunctionalLoss,
    Outcome,
    Scenario,
    StepRecorder,
    eval_dataset,
    new_loss,
    new_net,
    outcome,
    train_dataset,
    world_size,
)
from transformers import Trainer, TrainerCallback, TrainingArguments

from nanwatch.adapters.hf_trainer import OverflowTrainerCallback
from nanwatch.core.watcher import Watcher

NAME = "hf_trainer"
FAULT_NAME = "block.fault"


class _Probe(TrainerCallback):
    """Once training begins (after a checkpoint was loaded): keep the callback's watcher (it drops it when training
    ends) and start recording the weights after each optimizer step."""

    def __init__(self, overflow: OverflowTrainerCallback, recorder: StepRecorder) -> None:
        self.overflow = overflow
        self.recorder = recorder
        self.watcher: Watcher | None = None
        self.optimizers: list[Any] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.watcher = self.overflow.watcher
        self.optimizers = [optimizer]
        self.recorder.restart()
        self.recorder.track(optimizer)


def _train(
    scenario: Scenario,
    workdir: Path,
    *,
    micro_batches: int,
    micro_batches_done: int = 0,
    save: bool = False,
    resume_from: Path | None = None,
) -> Outcome:
    # The Trainer builds an Accelerator: it must not inherit the settings of one made earlier in this process.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    net = new_net(scenario, micro_batches_done=micro_batches_done)
    overflow = OverflowTrainerCallback(scenario.config(workdir))
    recorder = StepRecorder(net)
    probe = _Probe(overflow, recorder)
    steps = micro_batches // scenario.accumulation
    args = TrainingArguments(
        output_dir=str(workdir / "hf"),
        per_device_train_batch_size=BATCH_SIZE,
        per_device_eval_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=scenario.accumulation,
        max_steps=steps,
        learning_rate=LEARNING_RATE,
        optim="adamw_torch_fused" if scenario.fused else "sgd",
        lr_scheduler_type="constant",
        report_to=[],
        logging_strategy="no",
        save_strategy="steps" if save else "no",
        save_steps=steps,
        eval_strategy="steps" if scenario.evaluate else "no",
        eval_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        ddp_backend="gloo" if world_size() > 1 else None,
        ddp_find_unused_parameters=False,
        # The "weights" cause is an update past float32's max from a finite gradient: clipping would shrink it.
        max_grad_norm=0.0 if scenario.cause == "weights" else 1.0,
    )
    trainer = Trainer(
        model=net,
        args=args,
        train_dataset=train_dataset(scenario),
        eval_dataset=eval_dataset() if scenario.evaluate else None,
        callbacks=[overflow, probe],
        compute_loss_func=_functional(new_loss(scenario, micro_batches_done=micro_batches_done)),
    )
    error: Exception | None = None
    try:
        trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    except Exception as caught:
        error = caught
    return outcome(
        error,
        net=net,
        watcher=probe.watcher,
        recorder=recorder,
        model=net,
        optimizers=probe.optimizers,
        workdir=workdir,
    )


def _functional(loss_fn: FunctionalLoss | None) -> Any:
    """The Trainer's `compute_loss_func` (the user's own loss, outside the model), or None: the model's loss."""
    if loss_fn is None:
        return None

    def compute_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        return loss_fn(outputs["logits"], labels)

    return compute_loss


def run(scenario: Scenario, workdir: Path) -> Outcome:
    if scenario.resume_after is None:
        return _train(scenario, workdir, micro_batches=scenario.micro_batches)
    first = _train(scenario, workdir, micro_batches=scenario.resume_after, save=True)
    if first.error is not None:
        return first
    checkpoint = workdir / "hf" / f"checkpoint-{scenario.resume_after // scenario.accumulation}"
    return _train(
        scenario,
        workdir,
        micro_batches=scenario.micro_batches,
        micro_batches_done=scenario.resume_after,
        resume_from=checkpoint,
    )
