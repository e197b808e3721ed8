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

torch keeps a module's hooks in dicts of the module, which `torch.save(model)`, `pickle` and `copy.deepcopy` take
along. nanwatch's hooks do not go with them: every hook a `HookSet` holds is one of ours (`_Own`, or the recorder's
`ModuleHook`, which does the same itself), which a pickle stores as a no-op of the standard library (a file that loads
without nanwatch, and a model that records nothing; watching it again clears those no-ops) and a deep copy leaves out
altogether (an EMA copy made while watching is not watched, and holds nothing of nanwatch).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import types
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
    "copied_away",
    "pickled_away",
    "pickled_module_hook",
    "is_pickled_away",
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


# ------------------------------------------------------------------------------ pickles and deep copies

# What a pickled hook of ours becomes: a no-op of the standard library, so the file loads without nanwatch. For a
# module's hook, whose arguments are known (a forward hook: module, args[, kwargs], output; a pre-hook: module,
# args[, kwargs]), a plain Python function that takes four and returns None, `AbstractContextManager.__exit__`, with
# `None` for the arguments a hook does not get: torch.compile traces it inline, so a loaded model compiles without a
# graph break per module. For any other hook, `sys.audit` with an event of its own (any arguments; it does nothing
# while no audit hook listens, and says what it is to one that does).
_UNWATCHED_EVENT = "nanwatch.unwatched"
_NOTHING = contextlib.AbstractContextManager.__exit__  # (self, exc_type, exc_value, traceback) -> None


def pickled_away(arity: int | None = None) -> tuple[Any, ...]:
    """What a hook of ours called with `arity` arguments (None: not known) pickles as (its `__reduce__`)."""
    if arity is not None and 1 <= arity <= 4:
        return (functools.partial, (_NOTHING, *([None] * (4 - arity))))
    return (functools.partial, (sys.audit, _UNWATCHED_EVENT))


def pickled_module_hook() -> tuple[Any, ...]:
    """What a `ModuleHook` (a forward hook with keyword inputs: four arguments) pickles as: an object whose
    `forward_hook` (what the pickle of the bound method in the hook dict reads back) is the no-op of `pickled_away`."""
    return (types.SimpleNamespace, (), {"forward_hook": _NoOp(4)})


def is_pickled_away(hook: Any) -> bool:
    """True for what a hook of ours became in a pickle (`pickled_away`), once loaded."""
    if type(hook) is not functools.partial or hook.keywords:
        return False
    if hook.func is sys.audit:
        return hook.args == (_UNWATCHED_EVENT,)
    return hook.func is _NOTHING and len(hook.args) <= 3 and all(arg is None for arg in hook.args)


def _arity(handle: RemovableHandle) -> int | None:
    """How many arguments torch calls the hook of a module's `handle` with: a forward hook's handle carries the
    with-kwargs and always-call marks (two extra dicts), a pre-hook's the with-kwargs mark alone; None for any other
    hook (a tensor's, an optimizer's)."""
    extra = [ref() for ref in getattr(handle, "extra_dict_ref", ())]
    if not extra or extra[0] is None:
        return None
    with_kwargs = handle.id in extra[0]
    if len(extra) == 2:
        return 4 if with_kwargs else 3
    return 3 if with_kwargs else 2


def _leaves_by_itself(hook: object) -> bool:
    """True for the object of a hook that leaves pickles and deep copies by itself (the recorder's `ModuleHook`, in the
    engine above this module: known by its class's mark, not imported)."""
    return getattr(type(hook), "leaves_pickles_and_copies", False) is True


def _stand_in() -> Any:
    """What stands, in a deep copy's hook dict, for one of our hooks until the copy is over and it is taken out:
    a no-op (also as `ModuleHook.forward_hook` bound to it: its recorder is never recording), pickled as one."""
    return types.SimpleNamespace(recorder=types.SimpleNamespace(recording=False), forward_hook=_NoOp())


class _NoOp(functools.partial[None]):
    """A no-op hook (any arguments, returns None) that pickles as `pickled_away(arity)`."""

    arity: int | None

    def __new__(cls, arity: int | None = None) -> _NoOp:
        made = super().__new__(cls, sys.audit, _UNWATCHED_EVENT)
        made.arity = arity
        return made

    def __reduce__(self) -> tuple[Any, ...]:
        return pickled_away(self.arity)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return pickled_away(self.arity)


# Where each hook of ours sits: the handle of its registration, under `id()` of the hook (of a `ModuleHook` for its
# bound method). Read when a deep copy copies the hook; an entry leaves with its handle (`HookSet.remove_all`).
_PLACES: dict[int, RemovableHandle] = {}


def _placed(hook: Any, handle: RemovableHandle) -> bool:
    found = handle.hooks_dict_ref()
    value = None if found is None else found.get(handle.id)
    return value is hook or getattr(value, "__self__", None) is hook


class _TakeOut:
    """Kept in a deep copy's memo: when the copy is over (the memo let go, at the end of `copy.deepcopy`), takes the
    stand-ins of our hooks out of the copied hook dicts, as `RemovableHandle.remove()` takes a hook out."""

    def __init__(self) -> None:
        self.places: list[tuple[dict[Any, Any], list[dict[Any, Any]], Any, object]] = []

    def __del__(self) -> None:
        for hooks, extra, key, stand_in in self.places:
            value = hooks.get(key)
            if value is stand_in or getattr(value, "__self__", None) is stand_in:
                del hooks[key]
                for found in extra:
                    found.pop(key, None)


_TAKE_OUT = id(_TakeOut)  # its key in a memo: no object a deep copy copies has this id while the class lives


def copied_away(hook: Any, memo: dict[int, Any]) -> Any:
    """What a hook of ours is in a deep copy (its `__deepcopy__`): a stand-in that records nothing, taken out of the
    copy's hook dicts (and their `with_kwargs`/`always_call` marks) as soon as the deep copy is over."""
    stand_in = _stand_in()
    handle = _PLACES.get(id(hook))
    if handle is None or not _placed(hook, handle):
        return stand_in if _leaves_by_itself(hook) else stand_in.forward_hook
    hooks = handle.hooks_dict_ref()
    copied = memo.get(id(hooks))  # the copy of the dict being filled (a dict is in the memo before its items)
    value = stand_in if _leaves_by_itself(hook) else stand_in.forward_hook
    if copied is not None:
        # The marks dicts: copied now (the module's own copy takes these same copies from the memo).
        extra = [
            copy.deepcopy(found, memo) for ref in getattr(handle, "extra_dict_ref", ()) if (found := ref()) is not None
        ]
        take_out = memo.get(_TAKE_OUT)
        if take_out is None:
            take_out = memo[_TAKE_OUT] = _TakeOut()
        take_out.places.append((copied, extra, handle.id, value))
    return value


class _Own(functools.partial[None]):
    """One of nanwatch's hooks, as the hook dict holds it: called as the hook itself (by C code, no frame of its own),
    pickled as a no-op (`pickled_away`, for the arguments it is called with) and left out of deep copies
    (`copied_away`)."""

    arity: int | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return pickled_away(self.arity)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return pickled_away(self.arity)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copied_away(self, memo)


def _drop_pickled_away(module: torch.nn.Module) -> None:
    """Take out of `module` the no-ops our hooks became in a pickle it was loaded from."""
    for name in ("_forward_hooks", "_forward_pre_hooks"):
        hooks = getattr(module, name, None)
        if not hooks:
            continue
        for key in [key for key, hook in hooks.items() if is_pickled_away(hook)]:
            del hooks[key]
            for marks in (
                "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called",
                "_forward_pre_hooks_with_kwargs",
            ):
                getattr(module, marks, {}).pop(key, None)


class HookSet:
    """Owns the hook handles it registers, so all of them can be removed (transformers throws them away)."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle | Removable] = []
        self._places: list[tuple[int, RemovableHandle]] = []  # this set's entries of `_PLACES`

    def add_forward(
        self, module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False, prepend: bool = False
    ) -> None:
        """A forward hook on `module`, after its other forward hooks (`prepend=True`: before them); with
        `with_kwargs=True` it is called with the keyword arguments too (`hook(module, args, kwargs, output)`). Only
        torch's own hook registration: nothing is set on the module's class, so torch's `Module.__call__` runs every
        hook, nanwatch's and other tools', as it would without nanwatch. The hook is left out of the module's pickles
        and deep copies (see this file's docstring)."""
        _drop_pickled_away(module)
        owner = getattr(hook, "__self__", None)
        if not _leaves_by_itself(owner):  # a ModuleHook leaves pickles and deep copies by itself
            hook = _Own(hook)
            hook.arity = 4 if with_kwargs else 3
        handle = module.register_forward_hook(hook, with_kwargs=with_kwargs, prepend=prepend)
        self._handles.append(handle)
        self._place(owner if _leaves_by_itself(owner) else hook, handle)

    def add_handle(self, handle: RemovableHandle | Removable) -> None:
        """Hold `handle` (removed by `remove_all`). A torch hook's handle (a module's, an optimizer's) has its hook
        made one of ours in place, under the same key: left out of pickles and deep copies."""
        if isinstance(handle, RemovableHandle):
            hooks = handle.hooks_dict_ref()
            hook = None if hooks is None else hooks.get(handle.id)
            owner = getattr(hook, "__self__", None)
            if _leaves_by_itself(owner):
                self._place(owner, handle)
            elif hook is not None and hooks is not None:
                if not isinstance(hook, _Own):
                    hook = hooks[handle.id] = _Own(hook)
                    hook.arity = _arity(handle)
                self._place(hook, handle)
        self._handles.append(handle)

    def _place(self, hook: object, handle: RemovableHandle) -> None:
        _PLACES[id(hook)] = handle
        self._places.append((id(hook), handle))

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._places:
            key, handle = self._places.pop()
            if _PLACES.get(key) is handle:
                del _PLACES[key]

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
