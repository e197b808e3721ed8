"""core/engine/module_hook.py: each watched module's hook is a bound method of one object, which a copy of the model
shares (as it would share a function hook) and which refuses, by name, to be pickled. Real modules, no mocks."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from tests.models import small_mlp

import nanwatch
from nanwatch import NonFiniteError
from nanwatch.core.engine.module_hook import ModuleHook


def _hooks(model: torch.nn.Module) -> list[ModuleHook]:
    """The objects of the recorder's hooks on `model` (the plain adapter puts hooks of its own on the root)."""
    return [
        hook.__self__
        for module in model.modules()
        for hook in module._forward_hooks.values()
        if isinstance(getattr(hook, "__self__", None), ModuleHook)
    ]


def test_a_deep_copy_of_a_watched_model_shares_its_hooks_and_copies_nothing_of_the_watcher() -> None:
    model = small_mlp(out_features=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nanwatch.watch(model, optimizer=optimizer)
    ema = copy.deepcopy(model)  # an EMA copy made while watching, as training loops do
    ours, copied = _hooks(model), _hooks(ema)
    assert len(ours) == len(list(model.modules()))
    # The same objects (a deep copy would copy the recorder, the statistics cache and the frames with them).
    assert all(a is b for a, b in zip(ours, copied, strict=True))
    x = torch.randn(3, 4)
    assert torch.equal(ema(x), model(x))
    model[2].factor = math.inf  # the original is still watched

    def train_step() -> None:
        model(x).sum().backward()
        optimizer.step()
        handle.step()

    with pytest.raises(NonFiniteError) as caught:
        train_step()
    handle.close()
    assert caught.value.module_name == "2"


def test_pickling_a_watched_model_says_why_not_and_works_once_the_watch_is_closed() -> None:
    model = small_mlp(out_features=2)
    handle = nanwatch.watch(model)
    with pytest.raises(TypeError, match="nanwatch's hook on module .* cannot be pickled: pickle or save the model's"):
        pickle.dumps(model)
    handle.close()
    loaded = pickle.loads(pickle.dumps(model))
    x = torch.randn(3, 4)
    assert torch.equal(loaded(x), model(x))
