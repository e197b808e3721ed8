"""Forward hooks on every submodule, named by qualified name, and removed without a trace."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["HookSet", "named_unique_modules"]

ForwardHook = Callable[[torch.nn.Module, tuple[Any, ...], Any], None]


def named_unique_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Every module once, under the first name `named_modules()` gives it (the root is named "")."""
    yield from model.named_modules()


class HookSet:
    """Owns the hook handles it registers, so all of them can be removed (transformers throws them away)."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add_forward(self, module: torch.nn.Module, hook: ForwardHook) -> None:
        self._handles.append(module.register_forward_hook(hook))

    def add_forward_pre(
        self, module: torch.nn.Module, hook: Callable[[torch.nn.Module, tuple[Any, ...]], None]
    ) -> None:
        self._handles.append(module.register_forward_pre_hook(hook))

    def add_handle(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def __len__(self) -> int:
        return len(self._handles)
