"""Watching a healthy run changes nothing, in a plain loop written the way users write one.

Each twin trains the same seeded model on the same data twice, unwatched and watched, and both must end with
bitwise-identical weights and buffers, optimizer state, RNG states (torch, Python, NumPy) and the same number of
optimizer steps. The model and loop do what real ones do: `model(**batch)`, a functional loss outside the model,
dropout (draws from torch's generator), data augmentation from Python's and NumPy's generators, an additive causal
mask kept as a `-inf` buffer, attention pooling whose caller masks the scores in place (`masked_fill_`) once batches
come padded, gradient accumulation, AdamW, a checkpoint every other step. These run in the quick tier; the compiled
twin takes seconds.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.twins.twin import StepCounter, TwinEnd, seed_everything, twin_end
from torch import nn

import nanwatch

VOCAB, WIDTH, LENGTH = 32, 16, 6
MICRO_BATCHES, ACCUMULATION, SAVE_EVERY = 10, 2, 2
PADDED_FROM = 4  # batches from this one on are padded: the pooling masks their scores in place

MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "sentinel": {"mode": "sentinel"},
    # A fused AdamW takes sentinel mode's flag as its `found_inf`: the check is decided on the device.
    "sentinel-fused": {"mode": "sentinel"},
    "sentinel-fused-skip": {"mode": "sentinel", "on_detect": "skip"},
    "gradients": {"watch_gradients": True},
    "spikes-skip": {"spike_window": 3, "on_detect": "skip"},
    "checkpoints": {},
    "underflow": {"count_underflow": True},
}


class CausalMix(nn.Module):
    """Mixes each position with those before it through an additive causal mask, a `-inf` buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mask", torch.full((LENGTH, LENGTH), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(x @ x.transpose(1, 2) / WIDTH + self.mask, dim=-1)
        return self.proj(weights @ x)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = CausalMix()
        self.drop = nn.Dropout(0.1)
        self.ffn = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.score = nn.Linear(WIDTH, 1)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.drop(self.mix(self.norm(self.embed(input_ids))))
        hidden = hidden + self.ffn(hidden)
        scores = self.score(hidden).squeeze(-1)
        if not attention_mask.all():  # padded: the caller changes the Linear's output in place
            scores.masked_fill_(~attention_mask, float("-inf"))
        pooled = (torch.softmax(scores, dim=-1).unsqueeze(-1) * hidden).sum(1)
        return self.head(pooled)


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    found = []
    for index in range(MICRO_BATCHES):
        mask = torch.ones(4, LENGTH, dtype=torch.bool)
        if index >= PADDED_FROM:
            mask[:, LENGTH - 2 :] = False
        found.append(
            {
                "input_ids": torch.randint(0, VOCAB, (4, LENGTH), generator=generator),
                "attention_mask": mask,
                "labels": torch.randint(0, 3, (4,), generator=generator),
            }
        )
    return found


FUSED = {"sentinel-fused", "sentinel-fused-skip"}  # the modes whose twins train with AdamW(fused=True)


def train(mode: str | None, folder: Path, *, compiled: bool = False, fused: bool = False) -> TwinEnd:
    """The run, unwatched (`mode` None) or watched in `mode`."""
    seed_everything(0)
    model = Tagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or mode in FUSED)
    steps = StepCounter(optimizer)
    runnable: nn.Module = torch.compile(model, backend="aot_eager") if compiled else model
    handle = (
        None
        if mode is None
        else nanwatch.watch(runnable, optimizer=optimizer, report_dir=str(folder / "reports"), **MODES[mode])
    )
    try:
        for index, batch in enumerate(batches()):
            labels = batch.pop("labels")
            jitter = random.random() * 1e-3 + float(np.random.uniform()) * 1e-3  # augmentation from both generators
            logits = runnable(**batch) * (1.0 + jitter)
            loss = nn.functional.cross_entropy(logits, labels) / ACCUMULATION
            loss.backward()
            if (index + 1) % ACCUMULATION == 0:
                optimizer.step()
                optimizer.zero_grad()
                if mode == "checkpoints" and steps.count % SAVE_EVERY == 0:
                    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                    assert handle is not None
                    handle.save_checkpoint(state, folder / f"step{steps.count}.pt", step=steps.count)
            if handle is not None:
                handle.step()
    finally:
        if handle is not None:
            handle.close()
    return twin_end(model, optimizer, steps.count)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_watched_healthy_plain_loop_ends_bit_identical_to_its_unwatched_twin(mode: str, tmp_path: Path) -> None:
    unwatched = train(None, tmp_path / "unwatched", fused=mode in FUSED)
    watched = train(mode, tmp_path / "watched")
    assert unwatched.steps == MICRO_BATCHES // ACCUMULATION
    assert watched.differences(unwatched) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_watched_healthy_compiled_model_ends_bit_identical_to_its_unwatched_twin(mode: str, tmp_path: Path) -> None:
    torch._dynamo.reset()
    unwatched = train(None, tmp_path / "unwatched", compiled=True)
    torch._dynamo.reset()
    watched = train(mode, tmp_path / "watched", compiled=True)
    assert unwatched.steps == MICRO_BATCHES // ACCUMULATION
    assert watched.differences(unwatched) == []
