"""nanwatch changes no class: torch's and the user's module classes hold the same attributes before a watch, while it
watches (through training, evaluation, a detection) and after it closes. Its hooks are torch's forward hooks in each
module's own hook dicts, run by torch's own `Module.__call__`."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tests.models import Scale, small_mlp
from torch import nn

import nanwatch


def _classes(model: nn.Module) -> dict[type, dict[str, Any]]:
    kinds = {type(module) for module in model.modules()} | {nn.Module, nn.Linear, nn.Sequential}
    return {kind: dict(vars(kind)) for kind in kinds}


@pytest.mark.parametrize("overrides", [{}, {"mode": "sentinel"}, {"watch_gradients": True}], ids=str)
def test_no_attribute_of_a_torch_or_user_class_changes_during_a_watch(overrides: dict[str, Any]) -> None:
    model = small_mlp()  # Linear, ReLU, Scale (a user's class), Linear
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _classes(model)
    handle = nanwatch.watch(model, optimizer=optimizer, **overrides)
    for batch in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert _classes(model) == before, f"a class changed while watching, batch {batch}"
        handle.step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 4))
    model.train()
    model[2].factor = math.inf
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(nanwatch.NonFiniteError):
        optimizer.step()  # the guard: a step that would apply inf/nan never runs
    assert handle.watcher is None or handle.watcher.disabled_reason is None
    assert _classes(model) == before
    handle.close()
    assert _classes(model) == before
    assert type(model[2]) is Scale
