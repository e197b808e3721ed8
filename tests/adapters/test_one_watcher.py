"""One watcher per model: the plain handle removes its hooks when it raises, and a new `watch()` on a model that an
earlier handle still watches closes that handle (with a warning) before attaching its own."""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from tests.models import small_mlp
from torch import nn

from nanwatch import BatchLimitReached, NanwatchWarning, NonFiniteError, watch

TAKE_OVER = r"earlier watch\(\) handle still watches \(at its batch_number=(\d+)\)"


REPO = Path(__file__).resolve().parents[2]


def _hooks(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    count = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    if optimizer is not None:
        count += len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
    return count


def _run(model: nn.Sequential, optimizer: torch.optim.Optimizer, batches: int, bad_at: int) -> None:
    """A run without `with`: a training loop whose batch `bad_at` goes inf in `model[2]`."""
    handle = watch(model, optimizer=optimizer)
    model[2].factor = 1.0
    optimizer.zero_grad()  # the gradients the stopped step of an earlier run left behind
    for batch in range(batches):
        if batch == bad_at:
            model[2].factor = math.inf
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.step()


def test_a_second_watch_after_an_error_without_with_reports_the_new_runs_batch_number() -> None:
    # Before: the first handle kept its hooks after raising, and raised again for the new run's nan with its own
    # batch number (5 instead of 7).
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(NonFiniteError) as first:
        _run(model, optimizer, batches=6, bad_at=5)
    assert first.value.batch_number == 5
    assert _hooks(model, optimizer) == 0  # removed as the error was raised, though nothing closed the handle
    with pytest.raises(NonFiniteError) as second:  # no NanwatchWarning: nothing was left to take over
        _run(model, optimizer, batches=8, bad_at=7)
    assert second.value.batch_number == 7
    assert _hooks(model, optimizer) == 0


def test_a_second_watch_on_a_model_still_watched_closes_the_first_with_a_warning() -> None:
    model = small_mlp()
    first = watch(model)
    alone = _hooks(model)
    model(torch.randn(2, 4))
    first.step()
    with pytest.warns(NanwatchWarning, match=TAKE_OVER) as warned:
        second = watch(model)
    assert warned[0].filename == __file__  # the warning points at the watch() call
    assert "batch_number=1" in str(warned[0].message)
    assert _hooks(model) == alone  # the second handle's hooks only
    with pytest.raises(RuntimeError, match="closed"):
        first.step()
    model(torch.randn(2, 4))
    second.step()
    assert (second.batch_number, first.batch_number) == (1, 1)
    second.close()
    assert _hooks(model) == 0


def test_watching_the_whole_model_takes_over_from_a_handle_on_one_of_its_modules() -> None:
    model = small_mlp()
    part = watch(model[0])
    with pytest.warns(NanwatchWarning, match=TAKE_OVER):
        whole = watch(model)
    assert _hooks(model[0]) == 1  # the whole model's frame hook; the part's hooks (3) are gone
    whole.close()
    part.close()  # closed already: nothing to do
    assert _hooks(model) == 0


def test_handles_on_separate_models_leave_each_other_alone() -> None:
    first_model, second_model = small_mlp(), small_mlp()
    with watch(first_model) as first, watch(second_model) as second:  # no NanwatchWarning
        first_model(torch.randn(2, 4))
        second_model(torch.randn(2, 4))
        first.step()
        second.step()
        assert _hooks(first_model) > 0
        assert _hooks(second_model) > 0


def test_an_error_raised_at_the_optimizer_step_removes_the_optimizers_hooks_too() -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer=optimizer)
    model[2].factor = math.inf
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(NonFiniteError):
        optimizer.step()
    assert _hooks(model, optimizer) == 0
    with pytest.warns(NanwatchWarning, match="the batches since nanwatch raised .* are not watched"):
        handle.step()  # the handle goes on counting, recording nothing, and says so once
    assert handle.batch_number == 1
    model[2].factor = 1.0
    optimizer.step()  # no hook of ours is left to stop the user's next step


def test_the_batch_limit_removes_the_hooks_without_a_with_block() -> None:
    model = small_mlp()
    handle = watch(model, abort_after_batch_num=0)
    model(torch.randn(2, 4))
    with pytest.raises(BatchLimitReached):
        handle.step()
    assert _hooks(model) == 0


def test_a_handle_dropped_without_close_is_freed_with_its_model() -> None:
    # A notebook cell run again: the old model and its handle are dropped, never closed. Nothing of nanwatch's may
    # keep them (and the model's memory) alive.
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer=optimizer)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    handle.step()
    gone = [weakref.ref(model), weakref.ref(handle), weakref.ref(handle.watcher)]
    del model, optimizer, handle
    gc.collect()
    assert [ref() for ref in gone] == [None, None, None]


@pytest.mark.parametrize("stopped", [False, True], ids=["watching", "stopped by a bug of its own"])
@pytest.mark.slow
def test_a_handle_never_closed_leaves_no_error_at_interpreter_exit(stopped: bool) -> None:
    # The end of a script (or a notebook kernel) that never closed its handle: what nanwatch holds goes quietly,
    # whether it was still watching or had stopped itself (a failure in measuring: the run goes on).
    script = (
        "import torch, nanwatch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())\n"
        "handle = nanwatch.watch(model)\n"
        "model(torch.randn(2, 3)).sum().backward()\n"
        "handle.step()\n"
        "model(torch.randn(2, 3))\n"  # and a micro-batch left open
        # What the engine does when its own bookkeeping fails, called where the script runs: its warning keeps the
        # watcher until the interpreter's last clean-up, where a weakref.WeakMethod's callback used to raise.
        f"if {stopped}:\n"
        f"    import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "    from tests.engine_helpers import fail_internally\n"
        "    fail_internally(handle.watcher, 'a bug in nanwatch')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert ("stopped watching" in done.stderr) is stopped, done.stderr
