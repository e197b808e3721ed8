"""core/torch_glue/hooks.py: every module once under its first name; every handle kept, so every hook can be removed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanwatch.core.torch_glue.hooks import HookSet, named_unique_modules


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.decoder = nn.Sequential(self.encoder[0], nn.Tanh())  # the Linear is reachable under two names


def test_named_unique_modules_gives_each_module_once_under_its_first_name() -> None:
    model = Shared()
    named = list(named_unique_modules(model))
    assert [name for name, _ in named] == ["", "encoder", "encoder.0", "encoder.1", "decoder", "decoder.1"]
    assert named[0][1] is model
    assert named[2][1] is model.decoder[0]
    assert len({id(module) for _, module in named}) == len(named)


def _count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hookset_removes_every_hook_it_added() -> None:
    model = Shared()
    calls: list[str] = []

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        calls.append("post")

    def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        calls.append("pre")

    hooks = HookSet()
    for _, module in named_unique_modules(model):
        hooks.add_forward(module, hook)
    hooks.add_handle(model.register_forward_pre_hook(pre_hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks.add_handle(optimizer.register_step_pre_hook(lambda *args: None))
    assert len(hooks) == 8
    assert _count(model) == 7
    model.encoder(torch.ones(1, 2))
    assert calls == ["post", "post", "post"]

    hooks.remove_all()
    assert len(hooks) == 0
    assert _count(model) == 0
    assert len(optimizer._optimizer_step_pre_hooks) == 0
    calls.clear()
    model.encoder(torch.ones(1, 2))
    assert calls == []
    hooks.remove_all()  # a second call is harmless


def test_hookset_leaves_other_peoples_hooks_alone() -> None:
    layer = nn.Linear(2, 2)
    theirs = layer.register_forward_hook(lambda *args: None)
    hooks = HookSet()
    hooks.add_forward(layer, lambda *args: None)
    hooks.remove_all()
    assert list(layer._forward_hooks) == [theirs.id]
