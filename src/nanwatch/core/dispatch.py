"""A shorter way through `Module.__call__` for a module whose only hooks are plain forward hooks, as nanwatch's are.

As soon as a module has any hook, torch's `Module._call_impl` leaves its fast path for a general one: it makes a
closure and a set, imports `is_compiling` and asks it, opens a `try`, unpacks eight hook dicts and asks two more of
each hook. On a small module that is about 3 us a call here, before a line of the hook runs: a third of what watching
a dispatch-bound step costs (issue 21).

`shortcut(module)` puts, on the module's class, a `__call__` that does what torch's `__call__` (`_wrapped_call_impl`,
then `_call_impl`) does in the one case nanwatch makes: the module has forward hooks, none of them `always_call`, and
no forward pre-hook, no backward hook, no global hook, no tracer and no compiler is at work, nobody compiled the
module on its own (`module.compile()`) and nobody patched `nn.Module.__call__` (torch.fx and export's tracers do).
Then it calls `forward` and the hooks, in the same order, with the same arguments, and takes their results as torch
does: one Python frame where torch has two. In every other case it calls torch's own `nn.Module.__call__`, read at the
call, so another library's hooks (FSDP's, a user's pre-hook) and tracers run exactly as they would. What stays the
same by construction:

- the hooks stay torch hooks, in the module's hook dicts, in their place: `HookSet.suspended()`, `torch.compile`
  (Dynamo traces torch's `__call__` when it sees this one is compiling) and removal work as before;
- a class attribute, not an instance one, so `copy.deepcopy`, pickling and `nn.DataParallel`'s replicas (which copy
  an instance's `__dict__`) call the right module; the class is the same class (`type(module) is nn.Linear`);
- a class that defines a `__call__` or a `_call_impl` of its own (`torch.fx.GraphModule`), or inherits one that is
  not torch's, is left alone (hooks as before), and so is `nn.Module` itself;
- the attribute is taken off the class when the last hooked module of it lets its hooks go (or its handle is
  garbage-collected unremoved).

While it is on, a module of the same class without hooks goes straight to its `forward` (the same tests first), as
torch's fast path does.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch
from torch.nn.modules import module as _torch_module

__all__ = ["Shortcut", "shortcut", "shortcut_on"]

_Module = torch.nn.Module
# The dicts torch's general path reads besides the module's own. torch fills and empties them in place, never binds
# new ones, so holding them is as good as reading the module attribute at each call.
_global_forward_hooks = _torch_module._global_forward_hooks
_global_forward_pre_hooks = _torch_module._global_forward_pre_hooks
_global_backward_hooks = _torch_module._global_backward_hooks
_global_backward_pre_hooks = _torch_module._global_backward_pre_hooks
# torch's own `__call__`: while `nn.Module.__call__` is something else (a tracer's patch), the shortcut steps aside.
_TORCH_CALL = getattr(_Module, "_wrapped_call_impl", None)
_tracing_state = torch._C._get_tracing_state
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_compiler = torch.compiler

# The classes that carry the shortcut, with how many hooked modules of each hold it there.
_CLASSES: dict[type, int] = {}
_LOCK = threading.Lock()

# The hook dicts torch 2.13's `_call_impl` reads on the module. A torch whose modules carry other hook dicts (a new
# kind of hook), or lack one of these, gets no shortcut: its modules keep torch's own path (`_torch_hooks_known`).
_CALL_HOOK_DICTS = frozenset(
    {
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks",
        "_forward_hooks_always_called",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_is_full_backward_hook",
    }
)
_OTHER_HOOK_DICTS = frozenset(
    {"_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"}
)


def _call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """torch's `Module.__call__` for a module with plain forward hooks only (none `always_call`), or with no hook at
    all, while no tracer and no compiler is at work; torch's own for anything else."""
    if (
        self._forward_pre_hooks
        or self._backward_hooks
        or self._backward_pre_hooks
        or self._forward_hooks_always_called
        or _global_forward_hooks
        or _global_forward_pre_hooks
        or _global_backward_hooks
        or _global_backward_pre_hooks
        or self._compiled_call_impl is not None
        or _Module.__call__ is not _TORCH_CALL
        or _tracing_state() is not None
    ):
        # torch's, read now: a tracer that patches `nn.Module.__call__` (torch.fx) is obeyed.
        return _Module.__call__(self, *args, **kwargs)
    hooks = self._forward_hooks
    if not hooks:  # a module of the class that is not hooked: torch's fast path, as torch's own would take it
        return self.forward(*args, **kwargs)
    if _dynamo_compiling() or _compiler._is_compiling_flag:
        return _Module.__call__(self, *args, **kwargs)
    # What torch's general path does here: `forward`, and after it each hook in order (those registered `with_kwargs`
    # get the keyword arguments too); a hook's result replaces the output. No hook is `always_call`, so when anything
    # raises there is nothing else to run: the exception goes up as it is.
    result = self.forward(*args, **kwargs)
    with_kwargs = self._forward_hooks_with_kwargs
    if len(hooks) == 1:  # nanwatch's one hook, most often: read out of the dict before it runs, as torch reads all
        ((hook_id, hook),) = hooks.items()
        hook_result = hook(self, args, kwargs, result) if hook_id in with_kwargs else hook(self, args, result)
        return result if hook_result is None else hook_result
    for hook_id, hook in (*hooks.items(),):
        hook_result = hook(self, args, kwargs, result) if hook_id in with_kwargs else hook(self, args, result)
        if hook_result is not None:
            result = hook_result
    return result


class Shortcut:
    """The handle `shortcut` returns: `remove()` (or the handle's garbage collection) lets go of the class, and the
    class's last handle takes the shortcut off it."""

    def __init__(self, kind: type | None) -> None:
        # A finalizer, not `__del__`: a watcher dropped without `close()` still lets the class go when collected.
        self._release = weakref.finalize(self, _release, kind) if kind is not None else None

    def remove(self) -> None:
        if self._release is not None:
            self._release()  # runs once: a second remove(), or the collection after, does nothing


def shortcut(module: torch.nn.Module) -> Shortcut:
    """Put the shortcut on `module`'s class, unless it cannot go there (see the module's docstring); remove the
    handle when the module's hooks go."""
    kind = type(module)
    with _LOCK:
        held = _CLASSES.get(kind, 0)
        if kind.__dict__.get("__call__") is not _call:  # not on yet (or taken off by someone else since)
            if not _fits(kind):
                return Shortcut(None)
            _leave_to_dynamo_what_it_calls()
            kind.__call__ = _call  # type: ignore[method-assign]
        _CLASSES[kind] = held + 1
    return Shortcut(kind)


def _release(kind: type) -> None:
    with _LOCK:
        left = _CLASSES.pop(kind) - 1
        if left:
            _CLASSES[kind] = left
        elif kind.__dict__.get("__call__") is _call:
            del kind.__call__


def shortcut_on(module: torch.nn.Module) -> bool:
    """Whether `module`'s class carries the shortcut (its calls take it while it has plain forward hooks only)."""
    return type(module).__call__ is _call


def _leave_to_dynamo_what_it_calls() -> None:
    """`torch.compile(model)` enters the model through `__call__`, and Dynamo compiles the first frame that is not
    torch's own: it would compile the shortcut, and trace the root's hooks into the graph. Told to run the shortcut's
    frame as it is and go on with the frames it calls (the `forward`), as it does past torch's `__call__` and
    `_call_impl`, it compiles the same graph as without the shortcut. A torch without this control compiles the
    shortcut, which steps aside to torch's `__call__` while compiling: the same calls, in one graph."""
    frames = sys.modules.get("torch._C._dynamo.eval_frame")
    action = getattr(frames, "_FrameAction", None)
    strategy = getattr(frames, "_FrameExecStrategy", None)
    setter = getattr(frames, "set_code_exec_strategy", None)
    if action is not None and strategy is not None and setter is not None:
        setter(_call.__code__, strategy(action.SKIP, action.DEFAULT))


def _fits(kind: type) -> bool:
    return (
        kind is not _Module
        and _TORCH_CALL is not None
        and kind.__call__ is _TORCH_CALL
        and getattr(kind, "_call_impl", None) is _Module._call_impl
        and _Module.__call__ is _TORCH_CALL
        and _torch_hooks_known()
    )


def _torch_hooks_known() -> bool:
    """True when this torch keeps no hook dict the shortcut does not know (on a module, or global), and has the other
    attributes it reads: a torch that adds a kind of hook keeps its own path until the shortcut learns it. Asked each
    time a class would get the shortcut (a few times per attach), so that a hook kind added at run time is seen too."""
    on_a_module = {name for name in vars(_Module()) if "hook" in name}
    global_ones = {name for name in vars(_torch_module) if name.startswith("_global_") and "hook" in name}
    read_globals = {f"_global{name}" for name in _CALL_HOOK_DICTS} & global_ones
    known_globals = read_globals | {
        "_global_buffer_registration_hooks",
        "_global_module_registration_hooks",
        "_global_parameter_registration_hooks",
    }
    return (
        _CALL_HOOK_DICTS <= on_a_module <= _CALL_HOOK_DICTS | _OTHER_HOOK_DICTS
        and global_ones <= known_globals
        and hasattr(_compiler, "_is_compiling_flag")
        and hasattr(_Module, "_compiled_call_impl")  # set on a module by `module.compile()`, None on the class
    )
