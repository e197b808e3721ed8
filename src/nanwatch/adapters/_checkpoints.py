"""The checkpoint guard in each framework: what is about to be written is handed to `verify_checkpoint` first.

Where a framework has no event before it writes (Lightning's strategy writes what its callbacks built; Accelerate's
`save_state` rotates old checkpoints out before its pre-hooks run), the framework object's own method is wrapped, on
that one instance, for as long as the watcher watches: the wrapping is a handle in `watcher.hooks`, undone with the
watcher's other hooks when it closes.

Under `checkpoint_guard="quarantine"` a refused checkpoint is written into `nanwatch-quarantine/` (`WriteAside`), a
folder out of every one the framework scans for a checkpoint to resume from or rotates: beside Accelerate's
`project_dir/checkpoints/` (whose every entry `load_state()` and `total_limit` take for a checkpoint), beside a
`ModelCheckpoint`'s `dirpath`, inside the HF Trainer's `output_dir` (it looks at `checkpoint-*` only), and beside the
plain loop's file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.adapters._checks import real_optimizer
from nanwatch.core.contract import AdapterContract
from nanwatch.core.feature_api import QUARANTINE_FOLDER, WriteAside

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


def _torch_save(build: Callable[[], Any]) -> Callable[[str], None]:
    """A `WriteAside.write` that `torch.save`s what `build()` returns, creating the quarantine folder first."""

    def write(path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(build(), path)

    return write


def _beside(folder: str) -> str:
    """The quarantine folder next to `folder` (in its parent)."""
    return os.path.join(os.path.dirname(folder.rstrip("/")), QUARANTINE_FOLDER)


def save_checked(watcher: AdapterContract, state: Any, path: str | os.PathLike[str], step: int | None) -> None:
    """The plain loop's `torch.save(state, path)`, after the check."""
    target = os.fspath(path)
    aside = WriteAside(os.path.join(os.path.dirname(target), QUARANTINE_FOLDER), _torch_save(lambda: state))
    watcher.verify_checkpoint(state, target, step=step, write_aside=aside)
    torch.save(state, target)


def guard_lightning_saves(watcher: AdapterContract, trainer: Any) -> None:
    """Check each checkpoint Lightning's strategy is about to write (`trainer.save_checkpoint`, `ModelCheckpoint`):
    on every rank (the weights are the same under DDP), before the file is written or an older one removed."""

    def make(save: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> Any:
            step = checkpoint.get("global_step", trainer.global_step)
            # The weights and the optimizers' state; not the callbacks' (ModelCheckpoint keeps an inf on purpose).
            state = {key: checkpoint[key] for key in ("state_dict", "optimizer_states") if key in checkpoint}
            target = os.fspath(filepath)
            # The strategy's own save: rank zero writes, through the checkpoint IO (which creates the folder).
            aside = WriteAside(_lightning_quarantine(trainer, target), lambda there: save(checkpoint, there))
            watcher.verify_checkpoint(state, target, step=step, write_aside=aside)
            return save(checkpoint, filepath, storage_options=storage_options)

        return save_checkpoint

    watcher.hooks.add_handle(_Wrapped(trainer.strategy, "save_checkpoint", make))


def _lightning_quarantine(trainer: Any, filepath: str) -> str:
    """Beside a `ModelCheckpoint`'s `dirpath` (its files are the ones it rotates, and `ckpt_path="last"` looks
    there); beside the file itself for a `trainer.save_checkpoint(path)` elsewhere."""
    folder = os.path.dirname(filepath)
    scanned = {str(callback.dirpath).rstrip("/") for callback in _checkpoint_callbacks(trainer)}
    if folder.rstrip("/") in scanned:
        return _beside(folder)
    return os.path.join(folder, QUARANTINE_FOLDER)


def _checkpoint_callbacks(trainer: Any) -> list[Any]:
    callbacks = getattr(trainer, "checkpoint_callbacks", None) or []
    return [callback for callback in callbacks if getattr(callback, "dirpath", None) is not None]


def guard_accelerate_saves(watcher: AdapterContract, accelerator: Any) -> None:
    """Check the prepared models and optimizers before `accelerator.save_state()` does anything (with automatic
    checkpoint naming it deletes the oldest checkpoints first)."""

    def make(save_state: Callable[..., Any]) -> Callable[..., Any]:
        def checked_save_state(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
            models = list(getattr(accelerator, "_models", []))
            optimizers = [real_optimizer(o) for o in getattr(accelerator, "_optimizers", [])]
            state = {"models": models, "optimizers": optimizers}
            path, quarantine = _accelerate_paths(accelerator, output_dir)
            dicts = _torch_save(lambda: {key: [part.state_dict() for part in parts] for key, parts in state.items()})
            watcher.verify_checkpoint(state, path, write_aside=WriteAside(quarantine, dicts))
            return save_state(output_dir, *args, **kwargs)

        return checked_save_state

    watcher.hooks.add_handle(_Wrapped(accelerator, "save_state", make))


def _accelerate_paths(accelerator: Any, output_dir: str | os.PathLike[str] | None) -> tuple[str, str]:
    """Where `save_state(output_dir)` writes, and where a refused checkpoint goes instead. Under automatic checkpoint
    naming (which ignores `output_dir`): `project_dir/checkpoints/checkpoint_<iteration>`, and
    `project_dir/nanwatch-quarantine`, since `load_state()` and `total_limit` take every entry of `checkpoints/` for a
    checkpoint. Otherwise `output_dir`, and the quarantine beside it."""
    config = accelerator.project_configuration
    if getattr(config, "automatic_checkpoint_naming", False) or output_dir is None:
        iteration = getattr(config, "iteration", getattr(accelerator, "save_iteration", 0))
        project = accelerator.project_dir or "."
        return os.path.join(project, "checkpoints", f"checkpoint_{iteration}"), os.path.join(project, QUARANTINE_FOLDER)
    path = os.fspath(output_dir)
    return path, _beside(path)


def verify_trainer_save(watcher: AdapterContract, output_dir: str, global_step: int, kwargs: dict[str, Any]) -> None:
    """The HF Trainer is about to save checkpoint-<global_step> (its control says so): check the model and the
    optimizer (from the event's `kwargs`) it will write."""
    optimizer = kwargs.get("optimizer")
    state: dict[str, Any] = {"model": kwargs.get("model")}
    if optimizer is not None:
        state["optimizer"] = real_optimizer(optimizer)

    dicts = _torch_save(lambda: {name: value.state_dict() for name, value in state.items()})
    path = os.path.join(output_dir, f"checkpoint-{global_step}")
    # In output_dir, out of the Trainer's way: it resumes from and rotates `checkpoint-<N>` folders only.
    quarantine = os.path.join(output_dir, QUARANTINE_FOLDER)
    watcher.verify_checkpoint(state, path, step=global_step, write_aside=WriteAside(quarantine, dicts))
