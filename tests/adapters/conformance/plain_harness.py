"""The plain loop: `nanwatch.watch(model, optimizer=optimizer)` and `handle.step()` after each micro-batch.

Under torchrun the model is wrapped in DistributedDataParallel (gloo), with `no_sync()` on the micro-batches that do
not end an accumulation window. A checkpoint holds the model, the optimizer and `handle.watcher.state_dict()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
    world_size,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import nanwatch

NAME = "plain"
FAULT_NAME = "block.fault"


class _Run:
    """One training process's model, optimizer and watch handle; `micro_batches_done` > 0 for a resumed run."""

    def __init__(self, scenario: Scenario, workdir: Path, *, micro_batches_done: int = 0) -> None:
        self.scenario = scenario
        self.workdir = workdir
        self.net = new_net(scenario, micro_batches_done=micro_batches_done)
        self.loss_fn = new_loss(scenario, micro_batches_done=micro_batches_done)
        self.ddp = DistributedDataParallel(self.net) if world_size() > 1 else None
        self.model: torch.nn.Module = self.net if self.ddp is None else self.ddp
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE, fused=scenario.fused or None)
        self.recorder = StepRecorder(self.net)
        self.recorder.track(self.optimizer)
        self.handle = nanwatch.watch(self.model, scenario.config(workdir), optimizer=self.optimizer)
        data = train_dataset(scenario)
        sampler: DistributedSampler[Any] | None = None if self.ddp is None else DistributedSampler(data, shuffle=False)
        self.loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)
        self.eval_batches = list(DataLoader(eval_dataset(), batch_size=BATCH_SIZE))

    def checkpoint(self) -> dict[str, Any]:
        return {
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "nanwatch": self.handle.watcher.state_dict(),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        self.net.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.handle.watcher.load_state_dict(saved["nanwatch"])
        self.recorder.restart()

    def _micro_batches(self, start: int, stop: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        for epoch in range(self.scenario.epochs):
            for index, batch in enumerate(self.loader):
                micro = epoch * MICRO_BATCHES_PER_EPOCH + index
                if micro >= stop:
                    return
                if micro >= start:
                    yield micro, batch

    def _evaluate(self) -> None:
        self.model.eval()
        with torch.no_grad():
            for batch in self.eval_batches:
                self.model(batch["x"], labels=batch["labels"])
        self.model.train()

    def train(self, start: int, stop: int) -> Exception | None:
        """Train micro-batches [start, stop) inside the handle's `with` block; what it raised, if anything."""
        accumulation = self.scenario.accumulation
        try:
            with self.handle:
                for micro, batch in self._micro_batches(start, stop):
                    last = (micro + 1) % accumulation == 0
                    # DDP all-reduces gradients only on the micro-batch that ends an accumulation window.
                    syncing = contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()
                    with syncing:
                        if self.loss_fn is None:
                            loss = self.model(batch["x"], labels=batch["labels"])["loss"] / accumulation
                        else:  # the user's own loss, nothing told to nanwatch: the optimizer guard stands alone
                            loss = self.loss_fn(self.model(batch["x"])["logits"], batch["labels"]) / accumulation
                        loss.backward()
                    if last:
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                    self.handle.step()
                    if last and self.scenario.evaluate:
                        self._evaluate()
        except Exception as error:
            return error
        return None

    def outcome(self, error: Exception | None) -> Outcome:
        return outcome(
            error,
            net=self.net,
            watcher=self.handle.watcher,
            recorder=self.recorder,
            model=self.model,
            optimizers=[self.optimizer],
            workdir=self.workdir,
        )


def run(scenario: Scenario, workdir: Path) -> Outcome:
    if world_size() > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if scenario.resume_after is None:
        single = _Run(scenario, workdir)
        return single.outcome(single.train(0, scenario.micro_batches))
    first = _Run(scenario, workdir)
    error = first.train(0, scenario.resume_after)
    if error is not None:
        return first.outcome(error)
    path = workdir / "plain-checkpoint.pt"
    torch.save(first.checkpoint(), path)
    resumed = _Run(scenario, workdir, micro_batches_done=scenario.resume_after)
    resumed.restore(torch.load(path))
    return resumed.outcome(resumed.train(scenario.resume_after, scenario.micro_batches))
