"""Accelerate: `OverflowTracker` attached to a real `Accelerator` after `prepare`, in the usual
`with accelerator.accumulate(model)` loop (CPU; DDP with gloo under torchrun).

A checkpoint is `accelerator.save_state` with the tracker registered by `register_for_checkpointing`, resumed by
`load_state` in a fresh Accelerator.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from tests.adapters.conformance.common import (
    BATCH_SIZE,
    LEARNING_RATE,
    MICRO_BATCHES_PER_EPOCH,
    Outcome,
    Scenario,
    StepRecorder,
    eval_dataset,
    new_loss,
    new_net,
    outcome,
    train_dataset,
)
from torch.utils.data import DataLoader

from nanwatch.adapters.accelerate import OverflowTracker

NAME = "accelerate"
FAULT_NAME = "block.fault"


def _fresh_state() -> None:
    # Accelerate keeps its state in process-wide singletons: a new Accelerator (a resumed run, the next test, the HF
    # Trainer's own) must not inherit the last one's settings.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class _Run:
    def __init__(self, scenario: Scenario, workdir: Path, *, micro_batches_done: int = 0) -> None:
        _fresh_state()
        self.scenario = scenario
        self.workdir = workdir
        self.tracker = OverflowTracker(scenario.config(workdir))
        self.accelerator = Accelerator(
            gradient_accumulation_steps=scenario.accumulation, cpu=True, log_with=[self.tracker]
        )
        self.net = new_net(scenario, micro_batches_done=micro_batches_done)
        self.loss_fn = new_loss(scenario, micro_batches_done=micro_batches_done)
        optimizer = torch.optim.SGD(self.net.parameters(), lr=LEARNING_RATE, fused=scenario.fused or None)
        loader = DataLoader(train_dataset(scenario), batch_size=BATCH_SIZE)  # prepare() shards it across ranks
        self.model, self.optimizer, self.loader = self.accelerator.prepare(self.net, optimizer, loader)
        self.recorder = StepRecorder(self.net)
        self.recorder.track(self.optimizer)
        self.tracker.attach(self.accelerator, self.model)
        self.accelerator.register_for_checkpointing(self.tracker)
        self.eval_batches = list(DataLoader(eval_dataset(), batch_size=BATCH_SIZE))

    def load(self, checkpoint: Path) -> None:
        self.accelerator.load_state(str(checkpoint))
        self.recorder.restart()

    def _micro_batches(self, start: int, stop: int) -> Iterator[dict[str, torch.Tensor]]:
        for epoch in range(start // MICRO_BATCHES_PER_EPOCH, self.scenario.epochs):
            for index, batch in enumerate(self.loader):
                if epoch * MICRO_BATCHES_PER_EPOCH + index >= stop:
                    return
                yield batch

    def _evaluate(self) -> None:
        self.model.eval()
        with torch.no_grad():
            for batch in self.eval_batches:
                self.model(batch["x"], labels=batch["labels"])
        self.model.train()

    def train(self, start: int, stop: int, *, save_to: Path | None = None) -> Exception | None:
        """Train micro-batches [start, stop) (`start` a whole epoch), then save the state if asked; the tracker's
        `with` block removes the hooks whatever happens."""
        accelerator = self.accelerator
        try:
            with self.tracker:
                for batch in self._micro_batches(start, stop):
                    with accelerator.accumulate(self.model):
                        if self.loss_fn is None:
                            loss = self.model(batch["x"], labels=batch["labels"])["loss"]
                        else:
                            loss = self.loss_fn(self.model(batch["x"])["logits"], batch["labels"])
                        accelerator.backward(loss)
                        self.optimizer.step()  # a no-op inside an accumulation window
                        self.optimizer.zero_grad()
                    if accelerator.sync_gradients and self.scenario.evaluate:
                        self._evaluate()
                if save_to is not None:
                    accelerator.save_state(str(save_to))
        except Exception as error:
            return error
        return None

    def outcome(self, error: Exception | None) -> Outcome:
        return outcome(
            error,
            net=self.net,
            watcher=self.tracker.watcher,
            recorder=self.recorder,
            model=self.net,
            optimizers=[self.optimizer],
            workdir=self.workdir,
        )


def run(scenario: Scenario, workdir: Path) -> Outcome:
    if scenario.resume_after is None:
        single = _Run(scenario, workdir)
        return single.outcome(single.train(0, scenario.micro_batches))
    checkpoint = workdir / "accelerate-checkpoint"
    first = _Run(scenario, workdir)
    error = first.train(0, scenario.resume_after, save_to=checkpoint)
    if error is not None:
        return first.outcome(error)
    resumed = _Run(scenario, workdir, micro_batches_done=scenario.resume_after)
    resumed.load(checkpoint)
    return resumed.outcome(resumed.train(scenario.resume_after, scenario.micro_batches))
