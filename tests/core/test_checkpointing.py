"""Activation checkpointing: the forwards `torch.utils.checkpoint` runs again during backward (reentrant or not) to
recompute what it did not keep are recompute, not new calls. They add no forward frame, count nothing, and double no
line of a backward frame, so a report never shows one call twice. With `watch_gradients`, whose frames tell the
backward's story, each recompute is recorded there, in its place, as a frame marked `(recompute)`."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from nanwatch import NonFiniteError, watch
from nanwatch.core.frames import Direction, resolve

REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])


class Block(nn.Module):
    """A residual block; `factor = inf` makes its own code (not a submodule) produce inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.Tanh()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x)) * self.factor


class CheckpointedNet(nn.Module):
    """Linear -> 2 blocks -> Linear; the blocks run under `checkpoint(use_reentrant=reentrant)`, or plainly (None)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        for block in self.blocks:
            if self.reentrant is None:
                hidden = block(hidden)
            else:
                hidden = checkpoint(block, hidden, use_reentrant=self.reentrant)
        return self.out(hidden)


def _net(reentrant: bool | None) -> CheckpointedNet:
    torch.manual_seed(0)
    return CheckpointedNet(reentrant)


def _calls(module: nn.Module) -> list[int]:
    """A counter of `module`'s forward calls, recompute included (a hook of the test's own)."""
    calls = [0]

    def count(*_: object) -> None:
        calls[0] += 1

    module.register_forward_hook(count)
    return calls


@REENTRANT
def test_recompute_adds_no_forward_frame(reentrant: bool) -> None:
    plain, checkpointed = _net(None), _net(reentrant)
    calls = _calls(checkpointed.blocks[1].fc)
    frames = {}
    for key, model in (("plain", plain), ("checkpointed", checkpointed)):
        with watch(model, max_frames_to_save=1000) as handle:
            for _ in range(3):
                x = torch.randn(3, 4, requires_grad=True)
                model(x).sum().backward()
                handle.step()
            frames[key] = [(f.batch_number, f.module_name, f.class_name) for f in handle.watcher.recent_frames()]
    assert calls == [6]  # each batch ran blocks.1.fc twice: once forward, once recomputed in backward
    assert frames["checkpointed"] == frames["plain"]
    assert Counter(name for _, name, _ in frames["checkpointed"])["blocks.1.fc"] == 3  # one frame per batch


@REENTRANT
def test_backward_frames_hold_each_gradient_once(reentrant: bool) -> None:
    lines = {}
    for key, model in (("plain", _net(None)), ("checkpointed", _net(reentrant))):
        with watch(model, watch_gradients=True, max_frames_to_save=1000) as handle:
            model(torch.randn(3, 4, requires_grad=True)).sum().backward()
            frames = handle.watcher.recent_frames()
            lines[key] = Counter(
                (frame.module_name, entry.label)
                for frame in frames
                if frame.direction is Direction.BACKWARD
                for entry in frame.entries
            )
            handle.step()
    # The same lines, each once: a reentrant checkpoint backpropagates through the recomputed graph (its first
    # forward ran without grad), a non-reentrant one through the first graph, from the very same inputs.
    assert lines["checkpointed"] == lines["plain"]
    assert lines["checkpointed"][("blocks.1.fc", "grad input[0]")] == 1
    assert lines["checkpointed"][("blocks.1.act", "grad input[0]")] == 1


@REENTRANT
def test_a_nan_in_a_checkpointed_block_is_reported_at_its_batch_with_no_call_twice(
    reentrant: bool, tmp_path: Path
) -> None:
    model = _net(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    before: list[torch.Tensor] = []

    def loop() -> None:
        with watch(model, optimizer=optimizer, report_dir=tmp_path, max_frames_to_save=30) as handle:
            for batch in range(4):
                if batch == 2:
                    model.blocks[1].factor = math.inf
                model(torch.randn(3, 4, requires_grad=True)).sum().backward()
                before[:] = [p.detach().clone() for p in model.parameters()]
                optimizer.step()
                optimizer.zero_grad()
                handle.step()

    with pytest.raises(NonFiniteError) as info:
        loop()
    assert (info.value.batch_number, info.value.module_name) == (2, "blocks.1")
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    report = json.loads((tmp_path / "nanwatch-report-rank0-batch2.json").read_text(encoding="utf-8"))
    calls = Counter((frame["batch_number"], frame["module"]) for frame in report["frames"])
    assert {batch for batch, _ in calls} == {0, 1, 2}  # room for a recompute of batch 1, were it recorded
    assert set(calls.values()) == {1}, calls


def test_checkpoint_wrapper_is_looked_through_and_its_recompute_not_recorded() -> None:
    model = _net(None)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])  # torch.distributed's wrapper: non-reentrant checkpoint
    calls = _calls(model.blocks[0]._checkpoint_wrapped_module.fc)
    with watch(model, include_modules=["blocks.0*"]) as handle:
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
        frames = [(f.module_name, f.class_name) for f in handle.watcher.recent_frames()]
        handle.step()
    assert calls == [2]
    assert frames == [("blocks.0.fc", "Linear"), ("blocks.0.act", "Tanh"), ("blocks.0", "Block")]


def test_a_transformers_model_with_gradient_checkpointing_records_each_call_once() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=50)
    frames = {}
    for key in ("plain", "checkpointed"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).train()
        if key == "checkpointed":
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        calls = _calls(model.transformer.h[1].mlp.c_fc)
        ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
        with watch(model, max_frames_to_save=1000) as handle:
            model(ids, labels=ids).loss.backward()
            frames[key] = [(f.module_name, f.class_name) for f in handle.watcher.recent_frames()]
            handle.step()
        if key == "checkpointed":
            assert calls == [2]  # the layer ran again in backward
    assert frames["checkpointed"] == frames["plain"]


@REENTRANT
def test_with_watch_gradients_each_recompute_is_a_frame_marked_recompute(reentrant: bool) -> None:
    model = _net(reentrant)
    with watch(model, watch_gradients=True, max_frames_to_save=1000) as handle:
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
        frames = handle.watcher.recent_frames()
        handle.step()
    forward = [f.module_name for f in frames if f.direction is Direction.FORWARD]
    recomputed = [f.module_name for f in frames if f.direction is Direction.RECOMPUTE]
    # Each call once among the forward frames, as without checkpointing.
    assert forward == ["inp", "blocks.0.fc", "blocks.0.act", "blocks.0", "blocks.1.fc", "blocks.1.act", "blocks.1"] + [
        "out",
        "",
    ]
    # Each checkpointed block ran again in backward, the later block first (a non-reentrant checkpoint stops its
    # recompute once it has what backward needs: there, only the Linear).
    expected = ["blocks.1.fc", "blocks.0.fc"] if not reentrant else ["blocks.1.fc", "blocks.1.act", "blocks.1"]
    assert recomputed[: len(expected)] == expected
    assert "blocks.0.fc" in recomputed
    first_recompute = next(i for i, f in enumerate(frames) if f.direction is Direction.RECOMPUTE)
    assert all(f.direction is not Direction.FORWARD for f in frames[first_recompute:])  # recorded in backward
    shown = resolve([f for f in frames if f.direction is Direction.RECOMPUTE])
    assert "Linear (recompute)" in {f.shown_class for f in shown}


class FailsWhenRecomputed(nn.Linear):
    """A Linear whose recompute, and only that, makes inf: a kernel that does not give the same numbers twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recomputing = torch._C._current_graph_task_id() != -1
        return super().forward(x) * (math.inf if recomputing else 1.0)


@REENTRANT
def test_a_nan_born_in_a_recompute_is_reported_at_its_recompute_frame(reentrant: bool, tmp_path: Path) -> None:
    model = _net(reentrant)
    model.blocks[1].fc = FailsWhenRecomputed(8, 8)

    def step() -> None:
        with watch(model, watch_gradients=True, report_dir=tmp_path) as handle:
            model(torch.randn(3, 4, requires_grad=True)).sum().backward()
            handle.step()

    with pytest.raises(NonFiniteError) as info:
        step()
    assert (info.value.batch_number, info.value.module_name) == (0, "blocks.1.fc")
    assert "blocks.1.fc FailsWhenRecomputed (recompute)" in info.value.report
    report = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text(encoding="utf-8"))
    assert report["frames"][-1]["class"] == "FailsWhenRecomputed (recompute)"
