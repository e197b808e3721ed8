"""The model's forward hooks, taken out of the way of a cause's tests: the user's hooks (a logger, a counter) must not
see a rerun as a forward of the run."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["HOOK_DICTS", "no_forward_hooks", "without_hooks"]

# The hook dicts a forward runs.
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


@contextlib.contextmanager
def no_forward_hooks(model: torch.nn.Module) -> Iterator[None]:
    """Every module of `model` with empty forward hook dicts for the block; each module's own dicts (the same objects,
    the same hooks in the same order) put back after it. Hooks added during the block go with the empty dicts."""
    saved: list[tuple[torch.nn.Module, str, Any]] = []
    for module in model.modules():
        for name in HOOK_DICTS:
            found = module.__dict__.get(name)
            if found:
                saved.append((module, name, found))
                module.__dict__[name] = OrderedDict()
    try:
        yield
    finally:
        for module, name, found in saved:
            module.__dict__[name] = found


def without_hooks(module: torch.nn.Module) -> None:
    """Empty a copy's forward hook dicts (a deep copy takes the user's hooks along)."""
    for inner in module.modules():
        for name in HOOK_DICTS:
            if inner.__dict__.get(name):
                inner.__dict__[name] = OrderedDict()
