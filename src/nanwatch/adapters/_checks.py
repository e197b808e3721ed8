"""An adapter's arguments: the model looked through its wrappers, a wrong argument told in one line, the framework
present; the config every adapter takes."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, TypeAlias

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.torch_glue.compiler import compiled_inner
from nanwatch.core.torch_glue.hooks import wrapped_module
from nanwatch.errors import ConfigError

__all__ = [
    "ConfigLike",
    "optional_base",
    "require",
    "unwrap_model",
    "entry_module",
    "check_model",
    "check_skip",
    "real_optimizer",
]

# The config every adapter takes: a `WatchConfig`, a dict of its fields, or the path of a YAML/JSON file.
ConfigLike: TypeAlias = WatchConfig | dict[str, Any] | str | Path | None


def require(missing: ImportError | None, message: str) -> None:
    """Raise `message` (what to install) when the framework is missing: importing an adapter never fails."""
    if missing is not None:
        raise ImportError(message) from missing


def optional_base(module: str, name: str) -> tuple[Any, ImportError | None]:
    """`module.name`, a framework's class that an adapter subclasses; when the framework is missing, `object` and the
    error, for `require` to raise as the adapter is constructed."""
    try:
        return getattr(importlib.import_module(module), name), None
    except ImportError as error:
        return object, error
    except AttributeError as error:  # what `from module import name` raises as an ImportError
        return object, ImportError(f"cannot import name {name!r} from {module!r}: {error}")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel/DataParallel wrappers, so names read `encoder.0`, not
    `module.encoder.0`; and inside a wrapper at the top that core/torch_glue/hooks.py leaves out (FSDP1,
    `checkpoint_wrapper`)."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
            continue
        compiled = compiled_inner(model)  # torch.compile's wrapper: names without `_orig_mod.`, no frame of its own
        if compiled is not None:
            model = compiled
            continue
        inner = wrapped_module(model)
        if inner is None:
            return model
        model = inner


def entry_module(given: torch.nn.Module, watched: torch.nn.Module) -> torch.nn.Module:
    """The module the user calls, for `Watcher(entry=)`: a `torch.compile` wrapper stays the entry (sentinel mode hooks
    it, outside the compiled graph, and replays the module inside eagerly); otherwise the watched module itself."""
    compiled = isinstance(getattr(given, "_orig_mod", None), torch.nn.Module)
    return given if compiled and given is not watched else watched


def check_model(model: object, caller: str) -> torch.nn.Module:
    """`model`, if nanwatch can hook it; else a one-line `TypeError` that says what was given and what to do."""
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"{caller} cannot watch a torch.jit.ScriptModule: scripted modules run no Python hooks. Watch the module "
            "before scripting it (or use torch.compile, which keeps them)"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller} needs a torch.nn.Module, got {type(model).__name__}")
    return model


def check_skip(config: WatchConfig, optimizers: list[Any], caller: str, fix: str) -> None:
    """A one-line `ConfigError` when `on_detect="skip"` (or `"rewind"`) has no optimizer to skip: it acts at the
    step a detection reaches, and without a guarded optimizer there is none (it would raise at the first detection
    instead). `fix` says how to pass one, with `on_detect='skip'`: said with the config's own value."""
    if config.on_detect == "raise" or optimizers:
        return
    what = "skips" if config.on_detect == "skip" else "rewinds at"
    fix = fix.replace("on_detect='skip'", f"on_detect={config.on_detect!r}")
    raise ConfigError(
        f"nanwatch: on_detect={config.on_detect!r} {what} the optimizer step of a micro-batch that holds inf/nan, and "
        f"{caller} has no optimizer whose steps it can skip: {fix}"
    )


def real_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's `AcceleratedOptimizer` keeps it as
    `.optimizer` and is no torch Optimizer itself: hooks go on the real one)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a wrapper of one), got {type(optimizer).__name__}")
    return inner
