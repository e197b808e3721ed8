"""The plain wrapper when something fails: the user's own exception always wins, nanwatch's never replaces it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.core.watcher import Watcher


class UsersOwnError(Exception):
    pass


def test_a_failing_close_never_replaces_the_users_exception(
    monkeypatch: pytest.MonkeyPatch, nanwatch_log: pytest.LogCaptureFixture
) -> None:
    # Before: a flush that failed in __exit__ replaced the user's exception (which was left as its __context__).
    def broken_close(self: Watcher, **kwargs: object) -> None:
        raise RuntimeError("simulated failure while closing")

    model = nn.Sequential(nn.Linear(2, 2))
    raised = UsersOwnError("the user's own bug")

    def run() -> None:
        with nanwatch.watch(model):
            model(torch.ones(1, 2))
            monkeypatch.setattr(Watcher, "close", broken_close)
            raise raised

    with pytest.raises(UsersOwnError) as info:
        run()
    assert info.value is raised
    assert info.value.__context__ is None
    assert any("could not close cleanly" in r.getMessage() for r in nanwatch_log.records)


def test_the_users_exception_passes_through_and_the_hooks_go() -> None:
    model = nn.Sequential(nn.Linear(2, 2))

    def run() -> None:
        with nanwatch.watch(model):
            model(torch.ones(1, 2))
            raise UsersOwnError("bug")

    with pytest.raises(UsersOwnError, match="bug"):
        run()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
