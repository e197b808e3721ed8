"""The adapters' helpers: the shared `_checks` and `_hooks`, and the HF Trainer's `close_when_forward_raises`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanwatch.adapters._checks import real_optimizer, unwrap_model
from nanwatch.adapters._hooks import guard_optimizers
from nanwatch.adapters.hf_trainer._trainer import close_when_forward_raises
from nanwatch.core.config import WatchConfig
from nanwatch.core.watcher import Watcher


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the user's own bug")
        return self.lin(x)


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_failing_forward_closes_the_watcher_and_its_error_goes_on_unchanged() -> None:
    model = Failing()
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    close_when_forward_raises(watcher, model, lambda: watcher.close(check=False))
    # Hooks the user adds afterwards, an always-called one among them: ours must still not break torch's walk.
    model.register_forward_hook(lambda module, args, output: None, always_call=True)
    model.register_forward_hook(lambda module, args, output: None)
    model(torch.ones(1, 2))  # a healthy forward closes nothing
    assert watcher.attached
    model.fail = True
    with pytest.raises(RuntimeError, match="the user's own bug") as info:
        model(torch.ones(1, 2))
    assert info.value.__context__ is None  # raised as the user raised it: nothing of ours in between
    assert not watcher.attached
    assert _hooks(model) == 2  # the user's two remain, ours are gone


def test_the_optimizer_guard_hooks_the_optimizer_inside_a_wrapper() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    class Wrapper:  # as Accelerate's AcceleratedOptimizer keeps the real one
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    assert real_optimizer(Wrapper(optimizer)) is optimizer
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        real_optimizer(object())
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    guard_optimizers(watcher, [Wrapper(optimizer)])
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert watcher.counters.optimizer_step == 1
    watcher.close()
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_step_post_hooks


def test_wrappers_are_looked_through() -> None:
    model = nn.Linear(2, 2)
    assert unwrap_model(nn.DataParallel(model)) is model
    assert unwrap_model(model) is model
