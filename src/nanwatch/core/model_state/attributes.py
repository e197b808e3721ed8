"""The modules' plain Python attributes, kept and put back around a rerun of the live model."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["keep_attributes"]

# Values a forward may change in a module's plain Python attributes (a call counter, a cache list) that a replay puts
# back. Other objects a module holds (a cache object, a config) get their own attributes put back, one level deep;
# modules, tensors, classes, functions and Python modules are left as they are.
_PLAIN = (bool, int, float, complex, str, bytes, tuple, frozenset, type(None))
_NOT_STATE = (torch.nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType, types.ModuleType)
_MISSING = object()


def keep_attributes(model: torch.nn.Module) -> Callable[[], None]:
    """The modules' public attributes as they are now (plain values; lists, dicts and sets by their contents; other
    objects by their own attributes), and a function that puts them back: a replay runs the live model, and must not
    advance the user's state (a call counter, a list the forward appends to) as if the run had taken one more step."""
    values: list[tuple[dict[str, Any], str, Any]] = []
    containers: list[tuple[Any, Any]] = []
    objects: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for module in model.modules():
        attributes = vars(module)
        for name, value in attributes.items():
            if name.startswith("_"):
                continue
            values.append((attributes, name, value))
            if type(value) in (list, dict, set):
                containers.append((value, value.copy()))
            elif not isinstance(value, _PLAIN + _NOT_STATE) and isinstance(getattr(value, "__dict__", None), dict):
                objects.append((vars(value), dict(vars(value))))

    def restore() -> None:
        for attributes, name, value in values:
            attributes[name] = value
        for container, contents in containers:
            container.clear()  # the same object, as the user's code may hold it
            if isinstance(container, list):
                container.extend(contents)
            else:
                container.update(contents)
        for state, saved in objects:
            for key in [key for key in state if key not in saved]:
                del state[key]
            for key, value in saved.items():
                if state.get(key, _MISSING) is not value:
                    state[key] = value

    return restore
