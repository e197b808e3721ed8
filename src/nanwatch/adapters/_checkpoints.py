"""The checkpoint guard's pieces that the adapters share: what is about to be written is handed to
`verify_checkpoint` first.

Where a framework has no event before it writes (Lightning's strategy writes what its callbacks built; Accelerate's
`save_state` rotates old checkpoints out before its pre-hooks run), the framework object's own method is wrapped, on
that one instance, for as long as the watcher watches (`WrappedOnInstance`): the wrapping is a handle in
`watcher.hooks`, undone with the watcher's other hooks when it closes.

Under `checkpoint_guard="quarantine"` a refused checkpoint is written into `nanwatch-quarantine/` (`WriteAside`), a
folder out of every one the framework scans for a checkpoint to resume from or rotates: beside Accelerate's
`project_dir/checkpoints/` (whose every entry `load_state()` and `total_limit` take for a checkpoint), beside a
`ModelCheckpoint`'s `dirpath`, inside the HF Trainer's `output_dir` (it looks at `checkpoint-*` only), and beside the
plain loop's file.

Each framework's guard lives beside its adapter: `lightning/_trainer.py` (`guard_lightning_saves`),
`accelerate/_accelerator.py` (`guard_accelerate_saves`), `hf_trainer/_trainer.py` (`verify_trainer_save`); the plain
loop's and Accelerate's `save_checkpoint` (`UserHandle`) is `save_checked`, here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.core.contract import AdapterContract
from nanwatch.core.feature_api import QUARANTINE_FOLDER, WriteAside

__all__ = ["WrappedOnInstance", "torch_save_writer", "quarantine_beside", "save_checked"]


class WrappedOnInstance:
    """A method wrapped on one instance; `remove()` puts the class's own back (a `HookSet` handle)."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self._owner, self._name = owner, name
        self._wrapped = make(getattr(owner, name))
        setattr(owner, name, self._wrapped)

    def remove(self) -> None:
        if self._owner.__dict__.get(self._name) is self._wrapped:
            delattr(self._owner, self._name)


def torch_save_writer(build: Callable[[], Any]) -> Callable[[str], None]:
    """A `WriteAside.write` that `torch.save`s what `build()` returns, creating the quarantine folder first."""

    def write(path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(build(), path)

    return write


def quarantine_beside(folder: str) -> str:
    """The quarantine folder next to `folder` (in its parent)."""
    return os.path.join(os.path.dirname(folder.rstrip("/")), QUARANTINE_FOLDER)


def save_checked(watcher: AdapterContract, state: Any, path: str | os.PathLike[str], step: int | None) -> None:
    """`UserHandle.save_checkpoint`'s `torch.save(state, path)` (the plain loop's, Accelerate's tracker's), after the
    check."""
    target = os.fspath(path)
    aside = WriteAside(os.path.join(os.path.dirname(target), QUARANTINE_FOLDER), torch_save_writer(lambda: state))
    watcher.verify_checkpoint(state, target, step=step, write_aside=aside)
    torch.save(state, target)
