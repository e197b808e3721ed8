"""The hooks two or more adapters add beside the watcher's own, all removed by `watcher.close()`: on the root module
(where each top-level forward starts), on optimizers (a check before each step, and a warning when another optimizer
steps the watched weights); and stopping cleanly, every hook gone before an error of nanwatch's leaves it.

A hook only one adapter adds lives beside that adapter: the HF Trainer's on a failing forward
(`hf_trainer/_trainer.py`), Accelerate's on `accelerator.backward` (`accelerate/_accelerator.py`)."""

from __future__ import annotations

import logging
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from nanwatch.adapters._checks import real_optimizer
from nanwatch.core.contract import AdapterContract
from nanwatch.core.log import warn
from nanwatch.errors import NanwatchError

__all__ = [
    "Runner",
    "PreHook",
    "stop_on_error",
    "close_after",
    "add_phase_hook",
    "hook_root",
    "guard_optimizers",
    "guard_steps",
    "watch_root",
    "warn_if_steps_unguarded",
]

Runner = Callable[[Callable[[], None]], None]  # runs an engine call (see stop_on_error)
PreHook = Callable[[torch.nn.Module, tuple[Any, ...]], None]  # a forward pre-hook: (module, args)

# -------------------------------------------------------------------------------------------- stopping


def stop_on_error(
    watcher: AdapterContract,
    action: Callable[[], None],
    *,
    close: Callable[[], None] | None = None,
    errors: type[BaseException] = NanwatchError,
) -> None:
    """Run an engine call; if it raises nanwatch's own error (a detection, the batch limit), remove every hook
    (`close`, by default `watcher.close(check=False)`) before the error leaves nanwatch, so a run that stops carries no
    hook of ours. A framework that tells adapters nothing when training raises (the HF Trainer) has `errors` catch
    every error."""
    try:
        action()
    except errors:
        if close is None:
            watcher.close(check=False)
        else:
            close()
        raise


def close_after(failure: BaseException | None, close: Callable[[], None], logger: logging.Logger, what: str) -> None:
    """`close()` after the user's own error, which goes on: never hide it, so an error of ours is only logged."""
    try:
        close()
    except Exception as error:
        logger.warning(f"nanwatch could not {what} after {failure!r}: {error!r}")


def _run(action: Callable[[], None]) -> None:
    action()


# -------------------------------------------------------------------------------- the root's hooks


def add_phase_hook(watcher: AdapterContract, root: torch.nn.Module, before: PreHook, *, prepend: bool = False) -> None:
    """A forward pre-hook on the root module (where each top-level forward starts), removed by `watcher.close()`.
    A graph that compiles the root with its hooks (an `nn.Sequential` given to torch.compile) does not trace it: the
    hook runs as the graph's records are turned into frames (`Watcher.outside_graph`)."""
    hook = watcher.outside_graph(root, before, ())
    watcher.hooks.add_handle(root.register_forward_pre_hook(hook, prepend=prepend))


def hook_root(watcher: AdapterContract, root: torch.nn.Module, before: PreHook, *, prepend: bool = False) -> None:
    """`before` each top-level forward (`add_phase_hook`), and after it the end of an eval forward's batch: nobody
    ends it otherwise (no step() in a loop's evaluation), so it is checked as soon as the forward returns, on this
    rank alone (evaluation may run on some ranks only). For adapters that see no batch events, only the forwards."""

    def after(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if watcher.counters.phase == "eval" and watcher.recording:
            stop_on_error(watcher, watcher.end_batch)

    add_phase_hook(watcher, root, before, prepend=prepend)
    # Registered after the watcher's own hooks (attach() came first): it runs after the root's frame was recorded.
    watcher.hooks.add_forward(root, watcher.outside_graph(root, after, (), None))


# --------------------------------------------------------------------------------------- optimizers


def guard_optimizers(
    watcher: AdapterContract,
    optimizers: Iterable[Any],
    *,
    count_steps: bool = True,
    run: Runner = _run,
) -> None:
    """Check before each step of these optimizers (a step that would apply inf/nan never runs), and count steps.

    Args:
        optimizers: torch optimizers or wrappers of them.
        count_steps: count the steps of the first one (several optimizers step together) as `optimizer_step`.
        run: runs the check; an adapter that cleans up when nanwatch raises passes its own (see `stop_on_error`).
    """
    for index, optimizer in enumerate(optimizers):
        real = real_optimizer(optimizer)
        watcher.on_optimizer_step("guarded", real)
        # A subclass whose step() calls super().step() runs the hooks twice when torch wrapped both classes' step:
        # the inner call is recognised by the outer one still running (its wrapper's frame on the stack).
        outer: list[types.FrameType] = []

        def before(
            opt: torch.optim.Optimizer, args: Any, kwargs: Any, outer: list[types.FrameType] = outer
        ) -> tuple[Any, Any] | None:
            caller = sys._getframe(1)
            if outer and _on_stack(outer[0], caller.f_back):
                return None
            outer[:] = [caller]
            # `args` starts with the optimizer itself: step(self, closure=None).
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
            if closure is None:
                run(lambda: watcher.on_optimizer_step("before", opt))
                return None

            # A closure (LBFGS, Lightning) computes the gradients inside step(): check each time it has run.
            def checked() -> Any:
                result = closure()
                run(lambda: watcher.on_optimizer_step("before", opt))
                return result

            if "closure" in kwargs:
                return args, {**kwargs, "closure": checked}
            return (args[0], checked, *args[2:]), kwargs

        def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any, outer: list[types.FrameType] = outer) -> None:
            if outer and outer[0] is not sys._getframe(1):
                return  # the inner step of a subclass: the outer one counts
            outer.clear()
            watcher.on_optimizer_step("after", opt)

        watcher.hooks.add_handle(real.register_step_pre_hook(before))
        if count_steps and index == 0:
            watcher.hooks.add_handle(real.register_step_post_hook(after))


def _on_stack(frame: types.FrameType, top: types.FrameType | None) -> bool:
    """Whether `frame` is `top` or one of its callers."""
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


def guard_steps(watcher: AdapterContract, optimizers: list[Any]) -> None:
    """`guard_optimizers` that stops cleanly, its steps counted from 0 where the framework counts none."""
    if optimizers and watcher.counters.optimizer_step is None:
        watcher.set_counters(optimizer_step=0)
    guard_optimizers(watcher, optimizers, run=lambda action: stop_on_error(watcher, action))


def watch_root(
    watcher: AdapterContract,
    root: torch.nn.Module,
    before: PreHook,
    *,
    optimizers: list[Any],
    models: Iterable[torch.nn.Module],
    fix: str,
    prepend: bool = False,
) -> None:
    """Attach; hook the root (`hook_root`); guard `optimizers` (`guard_steps`); and say once when another optimizer
    steps the weights of `models` unguarded, with `fix` (`warn_if_steps_unguarded`)."""
    watcher.attach()
    hook_root(watcher, root, before, prepend=prepend)
    guard_steps(watcher, optimizers)
    warn_if_steps_unguarded(watcher, models, fix)


def warn_if_steps_unguarded(watcher: AdapterContract, models: Iterable[torch.nn.Module], fix: str) -> None:
    """An optimizer that nanwatch does not guard can apply inf/nan to the weights before nanwatch checks, at the end
    of the micro-batch: say so once, with `fix`, as the first step of such an optimizer that updates a parameter of
    `models` is about to run (a global optimizer step pre-hook, removed when the watcher closes). A run that steps no
    optimizer over the model (inference, evaluation, gradients looked at and never applied), or only guarded ones,
    hears nothing."""
    # Torch walks the global hooks while it calls them: one never removes itself (a mutated dict raises there). A
    # watcher dropped without close() leaves its hook behind, doing nothing; the next registration removes it.
    for entry in list(_STEP_HOOKS):
        earlier = entry[0]()
        if earlier is None or not earlier.attached:
            _STEP_HOOKS.remove(entry)
            entry[1].remove()
    owned = {id(param) for model in models for param in model.parameters()}
    said = False
    # Held weakly: a global hook must not keep a handle that was dropped without close() (and its model) alive.
    watcher_ref = weakref.ref(watcher)
    touches: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()

    def before_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nonlocal said
        watcher = watcher_ref()
        if said or watcher is None or not watcher.attached or watcher.guards(optimizer):
            return
        found = touches.get(optimizer)
        if found is None:  # asked once per optimizer: whether it updates the watched model's weights
            params = (param for group in optimizer.param_groups for param in group["params"])
            found = touches[optimizer] = any(id(param) in owned for param in params)
        if not found:
            return  # another model's optimizer
        said = True
        warn(
            f"nanwatch: this {type(optimizer).__name__} steps the watched model's weights unguarded: a step that "
            "applies inf/nan runs, and nanwatch only reports it at the end of the micro-batch, with the weights "
            f"already changed. {fix} (Said once.)"
        )

    handle = register_optimizer_step_pre_hook(before_any_step)
    watcher.hooks.add_handle(handle)
    _STEP_HOOKS.append((watcher_ref, handle))


# The global step pre-hooks of `warn_if_steps_unguarded`, with their watchers (weakly).
_STEP_HOOKS: list[tuple[weakref.ref[AdapterContract], RemovableHandle]] = []
