"""What only `nanwatch.watch()` and its handle need, beside plain/__init__.py: the arguments of `watch()` checked
(`check_config`, `check_optimizer`), one live handle per model (`take_over`, `hold`, `let_go`), and the scale of the
loop's GradScaler read once per micro-batch (`ScaleAfterStep`)."""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

from nanwatch.core.contract import AdapterContract
from nanwatch.core.log import warn
from nanwatch.errors import ConfigError

__all__ = ["check_config", "check_optimizer", "LiveHandle", "hold", "let_go", "take_over", "ScaleAfterStep"]

# ------------------------------------------------------------------------------------- watch()'s arguments


def check_config(config: object, caller: str) -> None:
    """A `ConfigError` naming the keyword when the config argument is an optimizer or a GradScaler."""
    if isinstance(getattr(config, "optimizer", config), torch.optim.Optimizer):
        keyword = "optimizer"
    elif callable(getattr(config, "get_scale", None)) and callable(getattr(config, "unscale_", None)):
        keyword = "scaler"
    else:
        return
    raise ConfigError(
        f"{caller}: the second argument is the config (a WatchConfig, a dict, or the path of a YAML/JSON file), got "
        f"{type(config).__name__}, {'an' if keyword == 'optimizer' else 'a'} {keyword}: pass it by keyword, "
        f"nanwatch.watch(model, {keyword}={keyword})"
    )


def check_optimizer(optimizer: object, caller: str) -> None:
    """A one-line `TypeError` unless `optimizer` is a torch optimizer (or a framework's wrapper of one)."""
    if not isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.Optimizer):
        hint = " (the optimizer itself, not model.parameters())" if hasattr(optimizer, "__next__") else ""
        raise TypeError(f"{caller} needs optimizer= a torch.optim.Optimizer{hint}, got {type(optimizer).__name__}")


# ------------------------------------------------------------------------------ one live handle per model


class LiveHandle(Protocol):
    """A handle whose hooks may be on a model until it is closed."""

    @property
    def watcher(self) -> AdapterContract | None: ...

    @property
    def batch_number(self) -> int: ...

    def close(self) -> None: ...


# The handles whose hooks may still be on a model (a handle is kept alive by its hooks, not by this set).
_LIVE: weakref.WeakSet[LiveHandle] = weakref.WeakSet()


def hold(handle: LiveHandle) -> None:
    """`handle` watches its model now, until `let_go(handle)`: a later `take_over` of that model closes it."""
    _LIVE.add(handle)


def let_go(handle: LiveHandle) -> None:
    """`handle` is closed (or shares its model on purpose, as the benchmarks do): no `take_over` closes it."""
    _LIVE.discard(handle)


def take_over(model: torch.nn.Module, *, caller: str, fix: str) -> None:
    """One watcher per model: close every live handle that still has hooks on a module of `model`, with a warning
    that names `caller` and how to close a handle (`fix`). Two handles on one model would both record every call and
    both count batches; a nan in the new run would be raised by the old handle with its own batch number."""
    if not _LIVE:
        return
    ours = {id(module) for module in model.modules()}
    for old in list(_LIVE):
        watcher = old.watcher
        if watcher is None or not watcher.attached or ours.isdisjoint(map(id, watcher.model.modules())):
            continue
        warn(
            f"nanwatch: {caller} on a model that an earlier {caller} handle still watches (at its "
            f"batch_number={old.batch_number}): that handle is closed now, and the new one takes over. Close a "
            f"handle when its run ends: {fix}"
        )
        old.close()


# ----------------------------------------------------------------------- the scale of the loop's GradScaler


class ScaleAfterStep:
    """A hand-written loop calls `handle.step()` before or after `scaler.step()` and `update()`: the scale that a
    micro-batch's step left is read once (none without a scaler), as the next training micro-batch starts or watching
    ends, when that step is surely done (`watch_scaler(read_scale="when_settled")`)."""

    def __init__(self, watcher: AdapterContract) -> None:
        self._watcher = watcher
        self._unread = False  # a micro-batch ended; the scaler's verdict on its step is not read yet

    def step_done(self) -> None:
        """A micro-batch ended: its optimizer step is done, or will be by the next forward."""
        self._unread = True

    def read(self, *, in_hook: bool = False) -> None:
        """Read the scale of the last micro-batch's step, if not read yet; may raise `LossScaleBelowFloor`.

        `in_hook`: called from a forward pre-hook, where reading a GPU's scale would wait for the GPU: the scale is
        copied there and read with the next check (the "settling" stage)."""
        if self._unread:
            self._unread = False
            self._watcher.on_optimizer_step("settling" if in_hook else "settled")
