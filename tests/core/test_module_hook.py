"""core/engine/recording/module_hook.py and core/torch_glue/hooks.py: nanwatch's hooks stay out of a watched model's
pickles and deep copies.
`torch.save(model)` and `pickle` work mid-training and store each hook of ours as a no-op of the standard library; a
deep copy (an EMA copy) is not watched and gets no hook of ours at all; the watched model goes on being watched. Real
modules, no mocks."""

from __future__ import annotations

import copy
import io
import math
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models import small_mlp

import nanwatch
from nanwatch import NonFiniteError
from nanwatch.core.torch_glue.hooks import is_pickled_away

# Every dict of a module that holds hooks, or the marks of the hooks (with_kwargs, always_call).
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
MODES = {
    "full": {},
    "sentinel": {"mode": "sentinel"},
    "gradients": {"watch_gradients": True},
    "capture": {"capture_on_detect": True},
    "spikes": {"spike_window": 4},
}


def _hooks(model: torch.nn.Module) -> list[Any]:
    """Every value in every hook dict of every module of `model`."""
    return [value for module in model.modules() for name in HOOK_DICTS for value in getattr(module, name).values()]


def _watch(tmp_path: Path, overrides: dict[str, Any]) -> tuple[torch.nn.Sequential, torch.optim.SGD, Any]:
    model = small_mlp(out_features=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nanwatch.watch(model, optimizer=optimizer, report_dir=tmp_path, **overrides)
    return model, optimizer, handle


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, handle: Any, x: torch.Tensor) -> None:
    handle.watch_loss(model(x).sum()).backward()
    optimizer.step()
    optimizer.zero_grad()
    handle.step()


def _still_watched(model: torch.nn.Sequential, optimizer: torch.optim.Optimizer, handle: Any) -> None:
    """A nan injected now is still found, at the module it appears in."""
    model[2].factor = math.inf
    with pytest.raises(NonFiniteError) as caught:
        _train_step(model, optimizer, handle, torch.randn(3, 4))
    assert caught.value.module_name == "2"


@pytest.mark.parametrize("overrides", list(MODES.values()), ids=list(MODES))
def test_a_deep_copy_made_while_watching_is_not_watched_and_saves_after_close(
    overrides: dict[str, Any], tmp_path: Path
) -> None:
    # Before: the copy shared the original's hooks (ModuleHook.__deepcopy__ returned itself), closures and features'
    # bound methods were copied along, and after close() the copy kept them all: torch.save(ema) failed for ever.
    model, optimizer, handle = _watch(tmp_path, overrides)
    x = torch.randn(3, 4)
    _train_step(model, optimizer, handle, x)
    ema = copy.deepcopy(model)  # an EMA copy made while watching, as training loops do
    assert _hooks(ema) == []  # not even a mark left in a with_kwargs or always_call dict
    assert _hooks(model)  # the original keeps its hooks
    assert torch.equal(ema(x), model(x))
    for _ in range(2):
        _train_step(model, optimizer, handle, x)
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
    # A batch in which only the copy runs records nothing into the watcher.
    batch = handle.batch_number
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ema(x).sum().backward()
        handle.step()
    assert [frame for frame in handle.watcher.recent_frames() if frame.batch_number == batch] == []
    if overrides.get("mode") != "sentinel":  # sentinel mode records no frame of any batch that stays finite
        assert any("no watched module recorded anything" in str(warning.message) for warning in said)
    _still_watched(model, optimizer, handle)
    handle.close()
    assert _hooks(ema) == []
    assert _hooks(model) == []
    buffer = io.BytesIO()
    torch.save(ema, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), ema(x))


@pytest.mark.parametrize("overrides", list(MODES.values()), ids=list(MODES))
def test_a_watched_model_pickles_and_saves_mid_training_without_nanwatch_s_hooks(
    overrides: dict[str, Any], tmp_path: Path
) -> None:
    # Before: TypeError ("nanwatch's hook on module 'Sequential' cannot be pickled"; in sentinel mode "cannot pickle
    # 'weakref.ReferenceType' object"), in the middle of training.
    model, optimizer, handle = _watch(tmp_path, overrides)
    x = torch.randn(3, 4)
    _train_step(model, optimizer, handle, x)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    for loaded in (torch.load(path, weights_only=False), pickle.loads(pickle.dumps(model))):
        # Each hook of ours is there as the standard library's no-op: nothing that records, nothing of nanwatch.
        assert _hooks(loaded)
        assert all(is_pickled_away(hook) or hook is True for hook in _hooks(loaded))
        assert torch.equal(loaded(x), model(x))
        assert all(is_pickled_away(hook) or hook is True for hook in _hooks(loaded))
    _still_watched(model, optimizer, handle)
    handle.close()


def test_a_saved_watched_model_loads_where_nanwatch_is_not_installed(tmp_path: Path) -> None:
    model, optimizer, handle = _watch(tmp_path, {})
    _train_step(model, optimizer, handle, torch.randn(3, 4))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    handle.close()
    script = (
        "import sys; sys.modules['nanwatch'] = None\n"  # any import of nanwatch fails
        "import torch\n"
        f"model = torch.load({str(path)!r}, weights_only=False)\n"
        "print(model(torch.ones(1, 4)).shape)\n"
    )
    root = Path(__file__).resolve().parents[2]  # where `tests.models` (the model's Scale) imports from
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch.Size([1, 2])" in done.stdout


def test_watching_a_loaded_model_again_clears_the_no_ops_its_pickle_left(tmp_path: Path) -> None:
    model, optimizer, handle = _watch(tmp_path, {})
    _train_step(model, optimizer, handle, torch.randn(3, 4))
    loaded = pickle.loads(pickle.dumps(model))
    handle.close()
    again = nanwatch.watch(loaded)
    assert not any(is_pickled_away(hook) for hook in _hooks(loaded))
    loaded(torch.randn(3, 4))
    again.step()
    again.close()
    assert _hooks(loaded) == []


@pytest.mark.slow
@pytest.mark.parametrize("overrides", list(MODES.values()), ids=list(MODES))
def test_a_loaded_watched_model_compiles_without_a_graph_break_at_the_no_ops(
    overrides: dict[str, Any], tmp_path: Path
) -> None:
    # A module hook of ours pickles as a plain Python no-op torch.compile traces inline; `sys.audit` (what any other
    # hook of ours pickles as) is a builtin Dynamo stops at: it broke the graph at every module.
    from torch._dynamo.utils import counters

    model, optimizer, handle = _watch(tmp_path, overrides)
    _train_step(model, optimizer, handle, torch.randn(3, 4))
    loaded = pickle.loads(pickle.dumps(model))
    handle.close()
    assert _hooks(loaded)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loaded, backend="aot_eager")
    x = torch.randn(3, 4)
    assert torch.equal(compiled(x), loaded(x))
    assert dict(counters["graph_break"]) == {}
