"""Forward hooks on every submodule, named by qualified name, and removed without a trace.

Three things of the training stacks people use shape where hooks go and when they record:

- wrappers: FSDP1 (`FullyShardedDataParallel`) and `checkpoint_wrapper` put a module of their own around the user's
  (`_fsdp_wrapped_module`, `_checkpoint_wrapped_module`). The wrapper sees what the module it wraps sees, so it gets
  no hook of its own, and names leave those components out: `layers.0.fc`, not
  `layers.0._fsdp_wrapped_module.fc`;
- FSDP2 (`fully_shard`) gathers a module's parameters in a forward pre-hook and frees them again in its forward hook;
  a hook that measures them goes before that one (`prepend=True`), while they are whole and plain tensors;
- activation checkpointing (`torch.utils.checkpoint`, reentrant or not) runs forwards again during backward to
  recompute what it did not keep: `recomputing()` says a forward hook fires in one of those.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

__all__ = [
    "HookSet",
    "named_unique_modules",
    "clean_name",
    "is_wrapper",
    "wrapped_module",
    "WRAPPER_ATTRIBUTES",
    "reshards_after_forward",
    "module_class_name",
    "recomputing",
]

# The attribute under which a wrapper module keeps the module it wraps (FSDP1, torch.distributed's checkpoint_wrapper).
WRAPPER_ATTRIBUTES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_graph_task_id = torch._C._current_graph_task_id


class Removable(Protocol):
    """A torch hook handle, or anything else an adapter put in place and can take away again."""

    def remove(self) -> None: ...


def named_unique_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Every module once, under the first name `named_modules()` gives it (the root is named ""); wrappers left out,
    and their components left out of the names (`clean_name`)."""
    for name, module in model.named_modules():
        if not is_wrapper(module):
            yield clean_name(name), module


def is_wrapper(module: torch.nn.Module) -> bool:
    """True for a module that only wraps another (FSDP1's `FullyShardedDataParallel`, `CheckpointWrapper`)."""
    return wrapped_module(module) is not None


def wrapped_module(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a wrapper (`is_wrapper`) wraps, or None when `module` is no such wrapper."""
    children = module._modules
    for attribute in WRAPPER_ATTRIBUTES:
        inner = children.get(attribute)
        if inner is not None:
            return inner
    return None


def clean_name(name: str) -> str:
    """A module or parameter name without the wrappers' components: `0._fsdp_wrapped_module.fc.weight` is
    `0.fc.weight`."""
    if "_wrapped_module" not in name:  # the common case, at the cost of one substring search
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)


def reshards_after_forward(module: torch.nn.Module) -> bool:
    """True for a module FSDP2 manages (`fully_shard`): its own forward hook frees the parameters it gathered, so a
    hook that reads them must run before it."""
    # Without torch.distributed.fsdp imported, no module can be one (and nanwatch does not import it for nothing).
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    return kind is not None and isinstance(module, kind)


def module_class_name(module: torch.nn.Module) -> str:
    """The class a report names: the user's (`Linear`), not the subclass FSDP2 swaps in for it (`FSDPLinear`)."""
    kind = type(module)
    if reshards_after_forward(module):
        fsdp = sys.modules["torch.distributed.fsdp"].FSDPModule
        kind = next((base for base in kind.__bases__ if not issubclass(base, fsdp)), kind)
    return kind.__name__


def recomputing() -> bool:
    """True while autograd runs a backward on this thread: a forward hook firing now is in a forward that activation
    checkpointing runs again to recompute what it did not keep (reentrant or not), not a new call of the module."""
    # Inside a compiled graph the recompute is part of the compiled backward (no hook fires there), and the graph task
    # is not something dynamo can trace: asked only in eager mode.
    return not torch.compiler.is_compiling() and _graph_task_id() != -1


class HookSet:
    """Owns the hook handles it registers, so all of them can be removed (transformers throws them away)."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle | Removable] = []

    def add_forward(
        self, module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False, prepend: bool = False
    ) -> None:
        """A forward hook on `module`, after its other forward hooks (`prepend=True`: before them); with
        `with_kwargs=True` it is called with the keyword arguments too (`hook(module, args, kwargs, output)`). Only
        torch's own hook registration: nothing is set on the module's class, so torch's `Module.__call__` runs every
        hook, nanwatch's and other tools', as it would without nanwatch."""
        self._handles.append(module.register_forward_hook(hook, with_kwargs=with_kwargs, prepend=prepend))

    def add_handle(self, handle: RemovableHandle | Removable) -> None:
        self._handles.append(handle)

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Take every hook of this set out of the module and tensor hook dicts for the block, then put each dict back
        exactly as it was (same keys, same order). For running a forward again without this set's hooks firing."""
        dicts: dict[int, dict[int, Any]] = {}
        ours: set[int] = set()
        for handle in self._handles:
            if not isinstance(handle, RemovableHandle):  # not a torch hook (a wrapped method): nothing fires in it
                continue
            refs = (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ()))
            for ref in refs:
                found = ref()
                if found is not None:
                    dicts.setdefault(id(found), found)
            ours.add(handle.id)
        saved = {key: list(found.items()) for key, found in dicts.items()}
        for found in dicts.values():
            for hook_id in ours & set(found):
                del found[hook_id]
        try:
            yield
        finally:
            for key, found in dicts.items():
                found.clear()
                found.update(saved[key])

    def __len__(self) -> int:
        return len(self._handles)
