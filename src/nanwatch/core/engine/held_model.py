"""Holding the watched model: strongly while watching, weakly once closed.

A closed watcher keeps no tensor of the model alive: a notebook that deletes the model gets its memory back while the
handle lives on, and the handle still says what it saw.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["Held"]


class Held:
    """One module, held strongly until `let_go()` and weakly after; `hold()` takes it back if it still exists.

    Args:
        what: how errors name it ("model", "entry module").
    """

    def __init__(self, module: torch.nn.Module, what: str) -> None:
        self._what = what
        self._strong: torch.nn.Module | None = module
        self._weak = weakref.ref(module)

    def get(self) -> torch.nn.Module:
        """The module. `ReferenceError` once let go and nothing else keeps it alive."""
        found = self._strong if self._strong is not None else self._weak()
        if found is None:
            raise ReferenceError(
                f"nanwatch: the watched {self._what} no longer exists (this watcher was closed, and let it go)"
            )
        return found

    def hold(self) -> None:
        """Hold it strongly again (watching again after a close)."""
        self._strong = self.get()

    def let_go(self) -> None:
        self._strong = None
