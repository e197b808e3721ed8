"""Train a tiny model with the transformers Trainer and `OverflowTrainerCallback` until an injected inf stops it.

Imported by tests/adapters/test_hf_trainer.py (single process) and run under torchrun (two processes, gloo):
    torchrun --nproc_per_node 2 hf_trainer_run.py --out DIR --inject-at 3 --inject-rank 1
Under torchrun each rank writes DIR/outcome-rank{R}.json, then lets the error end the process (non-zero exit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from blowup_models import SumDataset, TinyRegressor, hook_count, same_weights, snapshot
from transformers import Trainer, TrainerCallback, TrainingArguments

from nanwatch import NonFiniteError
from nanwatch.adapters.hf_trainer import OverflowTrainerCallback


class WeightsAfterEachStep(TrainerCallback):
    """Keeps a copy of the weights as they are after the last optimizer step that ran."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] | None = None
        self.global_step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module, **kwargs: Any) -> None:
        self.weights = snapshot(model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module, **kwargs: Any) -> None:
        self.weights = snapshot(model)
        self.global_step = state.global_step


@dataclass
class Outcome:
    error: NonFiniteError | None
    detected_at: float | None
    model: torch.nn.Module
    callback: OverflowTrainerCallback
    weights_unchanged: bool
    steps_done: int


def build(
    output_dir: Path,
    *,
    inject_at: int | None,
    inject_rank: int | None = None,
    inject_eval_at: int | None = None,
    eval_steps: int | None = None,
    gradient_accumulation_steps: int = 2,
    max_steps: int = 6,
    training_args: dict[str, Any] | None = None,
    callbacks: list[TrainerCallback] | None = None,
) -> tuple[Trainer, TinyRegressor]:
    """A Trainer for `TinyRegressor` on the CPU; it evaluates every `eval_steps` optimizer steps if given."""
    torch.manual_seed(0)
    model = TinyRegressor(inject_at, inject_rank, inject_eval_at)
    settings: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "max_steps": max_steps,
        "learning_rate": 0.1,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "use_cpu": True,
        "ddp_find_unused_parameters": False,
        "disable_tqdm": True,
        "eval_strategy": "no" if eval_steps is None else "steps",
        "eval_steps": eval_steps,
    }
    settings.update(training_args or {})
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=str(output_dir), **settings),
        train_dataset=SumDataset(),
        eval_dataset=None if eval_steps is None else SumDataset(8, seed=1),
        callbacks=callbacks,
    )
    return trainer, model


def train(
    output_dir: Path,
    *,
    callback: OverflowTrainerCallback | None = None,
    resume_from_checkpoint: str | None = None,
    config: dict[str, Any] | None = None,
    **options: Any,
) -> Outcome:
    """Train until the last step or a `NonFiniteError`; `options` go to `build()`, `config` to a new callback."""
    callback = callback if callback is not None else OverflowTrainerCallback(config)
    weights = WeightsAfterEachStep()
    trainer, model = build(output_dir, callbacks=[callback, weights], **options)
    error: NonFiniteError | None = None
    detected_at: float | None = None
    try:
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    except NonFiniteError as caught:
        detected_at = time.time()
        error = caught
    assert weights.weights is not None
    return Outcome(error, detected_at, model, callback, same_weights(model, weights.weights), weights.global_step)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject-at", type=int, required=True)
    parser.add_argument("--inject-rank", type=int, default=None)
    options = parser.parse_args()
    outcome = train(
        options.out / "trainer",
        inject_at=options.inject_at,
        inject_rank=options.inject_rank,
        config={"report_dir": options.out / "reports"},
        training_args={"ddp_backend": "gloo"},
    )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    error = outcome.error
    record = {
        "rank": rank,
        "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "error": None
        if error is None
        else {
            "batch_number": error.batch_number,
            "rank": error.rank,
            "optimizer_step": error.optimizer_step,
            "phase": error.phase,
            "module_name": error.module_name,
            "message": str(error),
        },
        "detected_at": outcome.detected_at,
        "weights_unchanged": outcome.weights_unchanged,
        "steps_done": outcome.steps_done,
        "hooks_left": hook_count(outcome.model),
    }
    (options.out / f"outcome-rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if error is not None:
        raise error
    return 0


if __name__ == "__main__":
    sys.exit(main())
