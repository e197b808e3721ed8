"""A closed handle lets the model go: after `close()` nothing reachable from the handle (its watcher, the features,
the statistics cache, the staging buffers, the frames kept) holds a tensor of the model or one of its modules, so a
notebook that deletes the model gets its memory back while the handle lives on; what a user reads after close (the
counters, the frames, the summary) still works."""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.engine_helpers import fail_internally
from torch import nn

import nanwatch
from nanwatch.core.engine.recording.deferred_frames import DeferredFrame
from nanwatch.core.frames import Frame


def _model() -> nn.Module:
    torch.manual_seed(0)
    # A BatchNorm: buffers, which sentinel mode keeps a window of.
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.BatchNorm1d(4), nn.Linear(4, 1))


def _paths_to(root: object, wanted: Callable[[object], str | None], beyond: tuple[type, ...]) -> list[str]:
    """The paths from `root` to every object `wanted` names (it returns what to show after the path, or None to walk
    on): a walk over `gc.get_referents`, not into classes, modules, frames or objects of the types `beyond` (a
    function's closure and defaults, not its globals)."""
    seen = {id(root)}
    stack: list[tuple[object, str]] = [(root, type(root).__name__)]
    found = []
    while stack:
        obj, path = stack.pop()
        referents: list[Any] = (
            list(obj.__closure__ or ()) + list(obj.__defaults__ or ())
            if isinstance(obj, types.FunctionType)
            else gc.get_referents(obj)
        )
        for ref in referents:
            if isinstance(ref, (type, types.ModuleType, types.FrameType, *beyond)) or id(ref) in seen:
                continue
            seen.add(id(ref))
            where = f"{path} -> {type(ref).__name__}"
            shown = wanted(ref)
            if shown is not None:
                found.append(where + shown)
            else:
                stack.append((ref, where))
    return found


def holding(root: object, model: nn.Module, *, beyond: tuple[type, ...] = ()) -> list[str]:
    """The paths from `root` to any module of `model`, or to a tensor that shares storage with its parameters or
    buffers (`_paths_to`)."""
    storages = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())} - {0}
    modules = {id(module) for module in model.modules()}

    def of_the_model(ref: object) -> str | None:
        shares = isinstance(ref, torch.Tensor) and not ref.is_meta and ref.untyped_storage().data_ptr() in storages
        return "" if id(ref) in modules or shares else None

    return _paths_to(root, of_the_model, beyond)


CASES = {
    "full": {},
    "gradients": {"watch_gradients": True},
    "sentinel": {"mode": "sentinel"},
    "traced, summed up, captured": {
        "trace_batch_nums": [0, 1],
        "summary_every_n_batches": 1,
        "capture_on_detect": True,
        "count_underflow": True,
        "target_dtype": "float16",
    },
}


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("how", ["after step", "mid-batch"])
def test_a_closed_handle_holds_nothing_of_the_model(overrides: dict[str, Any], how: str, tmp_path: Path) -> None:
    # Before: the handle and its watcher held the model, its modules and the statistics cache's tracked parameters.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nanwatch.watch(model, optimizer=optimizer, report_dir=tmp_path, **overrides)
    for batch in range(2):
        loss = handle.watch_loss(model(torch.randn(5, 3)).sum())
        loss.backward()
        if how == "mid-batch" and batch == 1:
            break  # the loop raised, say: frames pending, staged rows not read, the collector paused
        optimizer.step()
        optimizer.zero_grad()
        handle.step()
    del loss
    handle.close()

    assert holding(handle, model) == []
    model_ref, weight_ref = weakref.ref(model), weakref.ref(model[0].weight)
    del model, optimizer
    gc.collect()
    assert model_ref() is None  # gone, while the handle lives on
    assert weight_ref() is None
    # What a user reads after close still works.
    assert handle.batch_number == (1 if how == "mid-batch" else 2)
    if overrides.get("mode") != "sentinel":
        assert handle.watcher.recent_frames()
    with pytest.raises(ReferenceError, match="no longer exists"):
        handle.model  # noqa: B018


def test_a_detection_lets_the_model_go_too(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nanwatch.watch(model, optimizer=optimizer, report_dir=tmp_path, capture_on_detect=True)
    x = torch.randn(5, 3)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    with pytest.raises(nanwatch.NonFiniteError) as raised:
        optimizer.step()  # the handle closes its watcher as the error leaves nanwatch
    del raised, x
    assert holding(handle, model) == []
    handle.close()
    model_ref = weakref.ref(model)
    del model, optimizer
    gc.collect()
    assert model_ref() is None


def test_a_watcher_that_stopped_on_an_internal_failure_lets_the_model_go_at_close() -> None:
    # Closed with no check: what the optimizer guard screened at the last step (the parameters) was still held.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nanwatch.watch(model, optimizer=optimizer)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    with pytest.warns(nanwatch.NanwatchWarning, match="stopped watching"):
        fail_internally(handle.watcher, "a bug of ours, say")
    handle.close()
    assert holding(handle, model) == []


def test_the_model_is_there_while_watching_and_after_close_while_the_user_keeps_it() -> None:
    model = _model()
    handle = nanwatch.watch(model)
    assert handle.model is model
    model(torch.randn(2, 3))
    handle.step()
    handle.close()
    assert handle.model is model  # held weakly now, alive as long as the user keeps it
    assert holding(handle, model) == []


def test_a_closed_accelerate_tracker_holds_nothing_of_the_model(fresh_accelerate_state: None) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from nanwatch.adapters.accelerate import OverflowTracker

    tracker = OverflowTracker(watch_gradients=True)
    accelerator = Accelerator(cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tracker.attach(accelerator, model, optimizers=optimizer)
    for _ in range(2):
        accelerator.backward(model(torch.randn(5, 3)).sum())
        optimizer.step()
        optimizer.zero_grad()
    tracker.detach()
    # The user's accelerator, which the tracker keeps, holds the model itself: what is asked is the tracker's own.
    assert holding(tracker, model, beyond=(Accelerator,)) == []


def tensors_held(root: object, *, beyond: tuple[type, ...]) -> list[str]:
    """The paths from `root` to any tensor (`_paths_to`)."""
    return _paths_to(root, lambda ref: f" {tuple(ref.shape)}" if isinstance(ref, torch.Tensor) else None, beyond)


TENSOR_CASES = {
    "full": {},
    "sentinel": {"mode": "sentinel"},
    "gradients": {"watch_gradients": True},
    "captured": {"capture_on_detect": True},
    "spikes": {"spike_window": 4},
}


@pytest.mark.parametrize("overrides", list(TENSOR_CASES.values()), ids=list(TENSOR_CASES))
def test_a_closed_handle_holds_no_tensor(overrides: dict[str, Any], tmp_path: Path) -> None:
    # Before: with capture_on_detect the RNG states copied at the last forward (a 5,056-element tensor), with spikes
    # the windows of recent values, stayed reachable from the closed handle. The frames the ring keeps for reading
    # after close (`recent_frames()`) hold their statistics as they were measured, and are not walked.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nanwatch.watch(model, optimizer=optimizer, report_dir=tmp_path, **overrides)
    for _ in range(6):
        loss = handle.watch_loss(model(torch.randn(5, 3)).sum())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.step()
    del loss
    handle.close()
    assert tensors_held(handle, beyond=(Frame, DeferredFrame)) == []
