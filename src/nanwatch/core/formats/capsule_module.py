"""A module as a repro capsule keeps it: its tensors by name, and the module itself pickled without them.

The module is pickled so that it can be rebuilt without knowing its constructor's arguments. Its parameters and
buffers are not in that pickle: a skeleton of the module (shallow copies of it and of every submodule) holds meta
tensors in their place, of the same shapes and dtypes, and the tensors themselves are kept once, as CPU copies in
`state`, which a weights-only load reads. Rebuilding unpickles the skeleton and puts a fresh copy of each tensor
back, tied weights tied again.

The skeleton leaves out what belongs to the run rather than to the module: nanwatch's own hooks, the compiled call
that `module.compile()` installs (the capsule records the backend instead), and any hook that cannot be pickled
(named in `dropped`). The user's other hooks are kept: a `weight_norm` pre-hook is part of what the module computes.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn

from nanwatch.core.formats.capsule_inputs import cpu_copy

__all__ = ["SavedModule", "save_module", "load_module", "unwrap_compiled", "class_path"]

# Each module's hook tables (hook id -> hook), and the tables of flags kept per hook id beside them.
_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


@dataclass(frozen=True)
class SavedModule:
    """A module ready for a capsule: the pickled skeleton, its tensors, and the hooks left out."""

    pickle: bytes
    state: dict[str, torch.Tensor]  # every parameter and buffer (non-persistent ones too), by qualified name
    dropped: list[str]


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module `torch.compile` wrapped, or `module` itself: the capsule keeps the module and the backend apart."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def class_path(cls: type) -> str:
    """`package.module:Qual.Name`, the form the capsule names a class in."""
    return f"{cls.__module__}:{cls.__qualname__}"


def save_module(module: nn.Module) -> SavedModule:
    """The skeleton pickled and the tensors copied to the CPU (see the module's docstring).

    Raises:
        pickle.PicklingError, TypeError, AttributeError, ...: whatever pickling the skeleton raises (a module that
            holds a lock, a local class).
    """
    memo: dict[int, torch.Tensor] = {}
    state = {name: cpu_copy(tensor, memo) for name, tensor in _named_tensors(module)}
    dropped: list[str] = []
    skeleton = _skeleton(module, "", {}, {}, dropped)
    buffer = io.BytesIO()
    torch.save(skeleton, buffer)
    return SavedModule(pickle=buffer.getvalue(), state=state, dropped=dropped)


def load_module(data: bytes, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """The module `save_module` kept, with a fresh copy of each of its tensors. Unpickling runs code: a trusted load.

    Raises:
        ValueError: the pickle is not a module, or `state` lacks one of its tensors or holds it in another shape.
        Exception: whatever unpickling raises (ImportError, AttributeError: a class that moved or is not importable).
    """
    module = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    if not isinstance(module, nn.Module):
        raise ValueError(f"the pickled module is a {type(module).__qualname__}, not a torch.nn.Module")
    restored: dict[int, torch.Tensor] = {}  # by the skeleton's meta tensor: a tied weight gets one tensor again
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for table in (submodule._parameters, submodule._buffers):
            for key, placeholder in table.items():
                if placeholder is None or not placeholder.is_meta:
                    continue  # None, or put back already (a submodule met again under another name)
                name = f"{prefix}.{key}" if prefix else key
                if id(placeholder) not in restored:
                    restored[id(placeholder)] = _restored(name, placeholder, state)
                table[key] = restored[id(placeholder)]
        if hasattr(submodule, "_init_flat_weights"):  # an RNN keeps a list of its weights beside them
            submodule._init_flat_weights()
    return module


# --------------------------------------------------------------------------------------------------------------------


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # Every name, tied weights under each of theirs: the skeleton is walked by name too.
    return chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))


def _restored(name: str, placeholder: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    tensor = state.get(name)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"the capsule's state holds no tensor {name!r}")
    if tensor.shape != placeholder.shape:
        raise ValueError(
            f"the capsule's state holds {name!r} as {list(tensor.shape)}, the module as {list(placeholder.shape)}"
        )
    fresh = tensor.clone()  # each rebuild its own: a forward may change a buffer in place (BatchNorm's statistics)
    if isinstance(placeholder, nn.Parameter):
        return nn.Parameter(fresh, requires_grad=placeholder.requires_grad)
    return fresh


def _skeleton(
    module: nn.Module,
    prefix: str,
    modules: dict[int, nn.Module],
    tensors: dict[int, torch.Tensor],
    dropped: list[str],
) -> nn.Module:
    """A shallow copy of `module` and of its submodules (the same submodule twice: one copy), meta tensors in place
    of its parameters and buffers, its hooks filtered. The original is not touched."""
    if id(module) in modules:
        return modules[id(module)]
    clone = copy.copy(module)  # a new __dict__; the entries replaced below are replaced in the copy only
    modules[id(module)] = clone
    fields = clone.__dict__
    fields["_parameters"] = {key: _meta(value, tensors) for key, value in module._parameters.items()}
    fields["_buffers"] = {key: _meta(value, tensors) for key, value in module._buffers.items()}
    fields["_modules"] = {
        key: None if child is None else _skeleton(child, f"{prefix}{key}.", modules, tensors, dropped)
        for key, child in module._modules.items()
    }
    if "_flat_weights" in fields:  # an RNN's list of its weights: rebuilt from its parameters on load
        fields["_flat_weights"] = []
    if fields.get("_compiled_call_impl") is not None:  # module.compile(): the capsule records the backend
        fields["_compiled_call_impl"] = None
    _filter_hooks(fields, prefix.rstrip(".") or "(the module)", dropped)
    return clone


def _meta(value: torch.Tensor | None, tensors: dict[int, torch.Tensor]) -> Any:
    if value is None:
        return None
    if id(value) not in tensors:
        empty = torch.empty_like(value, device="meta")
        tensors[id(value)] = (
            nn.Parameter(empty, requires_grad=value.requires_grad) if isinstance(value, nn.Parameter) else empty
        )
    return tensors[id(value)]


def _filter_hooks(fields: dict[str, Any], where: str, dropped: list[str]) -> None:
    left_out: set[int] = set()
    for table_name in _HOOK_TABLES:
        table = fields.get(table_name)
        if not table:
            continue
        kept = type(table)()
        for hook_id, hook in table.items():
            if _is_nanwatchs(hook):
                left_out.add(hook_id)
                continue
            problem = _pickle_problem(hook)
            if problem is None:
                kept[hook_id] = hook
            else:
                left_out.add(hook_id)
                dropped.append(
                    f"{table_name.strip('_').replace('_', ' ')[:-1]} {_hook_name(hook)} of {where}: "
                    f"not picklable ({problem})"
                )
        fields[table_name] = kept
    for flags_name in _HOOK_FLAGS:
        flags = fields.get(flags_name)
        if flags and left_out & set(flags):
            fields[flags_name] = type(flags)((key, value) for key, value in flags.items() if key not in left_out)


def _origin(hook: Any) -> Any:
    """The function behind a hook: through a bound method, a `functools.partial`, torch's `_WrappedHook`."""
    for attribute in ("__func__", "func", "hook"):
        inner = getattr(hook, attribute, None)
        if callable(inner):
            return _origin(inner)
    return hook


def _is_nanwatchs(hook: Any) -> bool:
    module = getattr(_origin(hook), "__module__", None) or ""
    return module == "nanwatch" or module.startswith("nanwatch.")


def _hook_name(hook: Any) -> str:
    return str(getattr(_origin(hook), "__qualname__", type(hook).__qualname__))


def _pickle_problem(hook: Any) -> str | None:
    try:
        pickle.dumps(hook)
    except Exception as error:  # PicklingError, TypeError, AttributeError: a lambda, a closure, a lock
        return " ".join(f"{type(error).__name__}: {error}".split())
    return None
