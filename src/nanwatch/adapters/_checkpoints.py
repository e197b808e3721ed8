"""The checkpoint guard in each framework: what is about to be written is handed to `verify_checkpoint` first.

Where a framework has no event before it writes (Lightning's strategy writes what its callbacks built; Accelerate's
`save_state` rotates old checkpoints out before its pre-hooks run), the framework object's own method is wrapped, on
that one instance, for as long as the watcher watches: the wrapping is a handle in `watcher.hooks`, undone with the
watcher's other hooks when it closes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.adapters._checks import real_optimizer
from nanwatch.core.contract import AdapterContract

__all__ = ["guard_lightning_saves", "guard_accelerate_saves", "verify_trainer_save", "save_checked"]


class _Wrapped:
    """A method wrapped on one instance; `remove()` puts the class's own back (a `HookSet` handle)."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self._owner, self._name = owner, name
        self._wrapped = make(getattr(owner, name))
        setattr(owner, name, self._wrapped)

    def remove(self) -> None:
        if self._owner.__dict__.get(self._name) is self._wrapped:
            delattr(self._owner, self._name)


def save_checked(watcher: AdapterContract, state: Any, path: str | os.PathLike[str], step: int | None) -> None:
    """The plain loop's `torch.save(state, path)`, after the check."""
    target = os.fspath(path)
    watcher.verify_checkpoint(state, target, step=step, write_aside=lambda aside: torch.save(state, aside))
    torch.save(state, target)


def guard_lightning_saves(watcher: AdapterContract, trainer: Any) -> None:
    """Check each checkpoint Lightning's strategy is about to write (`trainer.save_checkpoint`, `ModelCheckpoint`):
    on every rank (the weights are the same under DDP), before the file is written or an older one removed."""

    def make(save: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> Any:
            step = checkpoint.get("global_step", trainer.global_step)
            # The weights and the optimizers' state; not the callbacks' (ModelCheckpoint keeps an inf on purpose).
            state = {key: checkpoint[key] for key in ("state_dict", "optimizer_states") if key in checkpoint}
            watcher.verify_checkpoint(
                state, os.fspath(filepath), step=step, write_aside=lambda aside: save(checkpoint, aside)
            )
            return save(checkpoint, filepath, storage_options=storage_options)

        return save_checkpoint

    watcher.hooks.add_handle(_Wrapped(trainer.strategy, "save_checkpoint", make))


def guard_accelerate_saves(watcher: AdapterContract, accelerator: Any) -> None:
    """Check the prepared models and optimizers before `accelerator.save_state()` does anything (with automatic
    checkpoint naming it deletes the oldest checkpoints first)."""

    def make(save_state: Callable[..., Any]) -> Callable[..., Any]:
        def checked_save_state(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
            models = list(getattr(accelerator, "_models", []))
            optimizers = [real_optimizer(o) for o in getattr(accelerator, "_optimizers", [])]
            state = {"models": models, "optimizers": optimizers}
            path = output_dir if output_dir is not None else _automatic_dir(accelerator)

            def write_aside(aside: str) -> None:
                torch.save({key: [part.state_dict() for part in parts] for key, parts in state.items()}, aside)

            watcher.verify_checkpoint(state, os.fspath(path), write_aside=write_aside)
            return save_state(output_dir, *args, **kwargs)

        return checked_save_state

    watcher.hooks.add_handle(_Wrapped(accelerator, "save_state", make))


def _automatic_dir(accelerator: Any) -> str:
    """Where `save_state()` without a directory writes (Accelerate's automatic checkpoint naming)."""
    config = accelerator.project_configuration
    iteration = getattr(config, "iteration", getattr(accelerator, "save_iteration", 0))
    return os.path.join(accelerator.project_dir or ".", "checkpoints", f"checkpoint_{iteration}")


def verify_trainer_save(watcher: AdapterContract, output_dir: str, global_step: int, kwargs: dict[str, Any]) -> None:
    """The HF Trainer is about to save checkpoint-<global_step> (its control says so): check the model and the
    optimizer (from the event's `kwargs`) it will write."""
    optimizer = kwargs.get("optimizer")
    state: dict[str, Any] = {"model": kwargs.get("model")}
    if optimizer is not None:
        state["optimizer"] = real_optimizer(optimizer)

    def write_aside(aside: str) -> None:
        dicts = {name: value.state_dict() for name, value in state.items()}
        torch.save(dicts, aside)

    path = os.path.join(output_dir, f"checkpoint-{global_step}")
    watcher.verify_checkpoint(state, path, step=global_step, write_aside=write_aside)
