"""A store that counts the calls made through it, for the tests of the agreement (tests/core/test_board.py) and of the
vote before each optimizer step (tests/core/test_stepvote.py); import it as `tests.counted_store`."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class Counted:
    """A store that counts the calls made through it (and can be made to fail: `broken`). `clone()` is the store's
    own: a listener's connection is not counted."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: list[str] = []
        self.broken = False

    def clone(self) -> Any:
        return self._store.clone()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            if self.broken:
                raise dist.DistNetworkError("the store's host went away")
            self.calls.append(name)
            return method(*args)

        return call
