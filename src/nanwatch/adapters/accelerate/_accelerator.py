"""What only the Accelerate adapter reads from and wraps on the `Accelerator`, beside accelerate/__init__.py: the
optimizers it prepared (`optimizer_list`), the epoch of its running dataloader (`dataloader_epoch`), summaries sent to
its trackers (`to_trackers`), the loss handed to `accelerator.backward` recorded first (`watch_loss_of`), and
`save_state()` checked first (`guard_accelerate_saves`). Duck-typed: Accelerate is not imported."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from nanwatch.adapters._checkpoints import WrappedOnInstance, quarantine_beside, torch_save_writer
from nanwatch.adapters._checks import real_optimizer
from nanwatch.core.contract import AdapterContract
from nanwatch.core.feature_api import QUARANTINE_FOLDER, WriteAside
from nanwatch.core.readouts import Summary
from nanwatch.core.rewinds import RewindPoint

__all__ = ["optimizer_list", "dataloader_epoch", "to_trackers", "watch_loss_of", "guard_accelerate_saves"]


def optimizer_list(given: Any, default: Iterable[Any]) -> list[Any]:
    """The optimizers an adapter guards: those `given` (one, or a list), or `default` (the framework's) when None."""
    if given is None:
        return list(default)
    return [given] if isinstance(given, torch.optim.Optimizer) else list(given)


def dataloader_epoch(accelerator: Any, otherwise: int | None) -> int | None:
    """Accelerate: the epoch of the prepared dataloader running now (its `iteration`); `otherwise` when it has none."""
    iteration = getattr(accelerator.gradient_state.active_dataloader, "iteration", None)
    return iteration if isinstance(iteration, int) else otherwise


def to_trackers(accelerator: Any, watcher: AdapterContract, tracker: object) -> Callable[[Summary], None]:
    """Accelerate, whose trackers log on the main process only (the other ranks have no sink: they never read a
    summary back, and there is no collective here): to the trackers other than `tracker` through
    `accelerator.log`, at the optimizer steps done so far (`tracker`'s own log() ignores it); to the "nanwatch" logger
    when there are none (asked at each summary, not once at attach)."""

    def send(summary: Summary) -> None:
        if not any(other is not tracker for other in accelerator.trackers):
            watcher.logger.info(summary.to_text())
            return
        step = (
            watcher.counters.optimizer_step
            if watcher.counters.optimizer_step is not None
            else watcher.counters.batch_number
        )
        accelerator.log(summary.metrics(), step=step)

    return send


class _WrappedMethod:
    """`obj.name` replaced by a wrapper on the instance; `remove()` puts back what was there (a handle for HookSet)."""

    def __init__(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self._obj, self._name, self._wrapper = obj, name, wrapper
        self._own = vars(obj).get(name, _NOTHING)  # an attribute of the instance itself, set before us
        setattr(obj, name, wrapper)

    def remove(self) -> None:
        if vars(self._obj).get(self._name) is not self._wrapper:
            return  # replaced again since: not ours to undo
        if self._own is _NOTHING:
            delattr(self._obj, self._name)
        else:
            setattr(self._obj, self._name, self._own)


_NOTHING = object()


def watch_loss_of(watcher: AdapterContract, obj: Any, method: str) -> None:
    """Have `obj.method(loss, ...)` (Accelerate's `accelerator.backward`) record its loss first, until the watcher
    closes (a loss the user recorded already is not recorded twice: `Watcher.watch_loss`)."""
    original = getattr(obj, method)

    def wrapper(loss: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(loss, torch.Tensor):
            watcher.watch_loss(loss)
        return original(loss, *args, **kwargs)

    watcher.hooks.add_handle(_WrappedMethod(obj, method, wrapper))


def guard_accelerate_saves(watcher: AdapterContract, accelerator: Any) -> None:
    """Check the prepared models and optimizers before `accelerator.save_state()` does anything (with automatic
    checkpoint naming it deletes the oldest checkpoints first)."""

    def make(save_state: Callable[..., Any]) -> Callable[..., Any]:
        def checked_save_state(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
            models = list(getattr(accelerator, "_models", []))
            optimizers = [real_optimizer(o) for o in getattr(accelerator, "_optimizers", [])]
            state = {"models": models, "optimizers": optimizers}
            path, quarantine = _accelerate_paths(accelerator, output_dir)
            dicts = torch_save_writer(
                lambda: {key: [part.state_dict() for part in parts] for key, parts in state.items()}
            )
            watcher.verify_checkpoint(state, path, write_aside=WriteAside(quarantine, dicts))
            written = save_state(output_dir, *args, **kwargs)
            # Written and verified: under on_detect="rewind", the folder a rewind restores (load_state reads it).
            where = os.fspath(written) if isinstance(written, (str, os.PathLike)) else path
            watcher.note_rewind_point(RewindPoint(where, watcher.counters.optimizer_step))
            return written

        return checked_save_state

    watcher.hooks.add_handle(WrappedOnInstance(accelerator, "save_state", make))


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
    return path, quarantine_beside(path)
