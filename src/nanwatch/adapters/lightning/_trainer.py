"""What only the Lightning adapter does to Lightning's `Trainer`, beside lightning/__init__.py: each checkpoint its
strategy is about to write checked first (`guard_lightning_saves`, the quarantine beside a `ModelCheckpoint`'s
`dirpath`), and summaries sent to its loggers (`to_loggers`). Duck-typed: Lightning is not imported."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from nanwatch.adapters._checkpoints import WrappedOnInstance, quarantine_beside
from nanwatch.adapters.lightning._rewind import rewind_point_of
from nanwatch.core.contract import AdapterContract
from nanwatch.core.feature_api import QUARANTINE_FOLDER, WriteAside
from nanwatch.core.readouts import Summary

__all__ = ["guard_lightning_saves", "to_loggers"]


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
            saved = save(checkpoint, filepath, storage_options=storage_options)
            point = rewind_point_of(checkpoint, target, step)
            if point is not None:  # written and verified: under on_detect="rewind", the one a rewind restores
                watcher.note_rewind_point(point)
            return saved

        return save_checkpoint

    watcher.hooks.add_handle(WrappedOnInstance(trainer.strategy, "save_checkpoint", make))


def _lightning_quarantine(trainer: Any, filepath: str) -> str:
    """Beside a `ModelCheckpoint`'s `dirpath` (its files are the ones it rotates, and `ckpt_path="last"` looks
    there); beside the file itself for a `trainer.save_checkpoint(path)` elsewhere."""
    folder = os.path.dirname(filepath)
    scanned = {str(callback.dirpath).rstrip("/") for callback in _checkpoint_callbacks(trainer)}
    if folder.rstrip("/") in scanned:
        return quarantine_beside(folder)
    return os.path.join(folder, QUARANTINE_FOLDER)


def _checkpoint_callbacks(trainer: Any) -> list[Any]:
    callbacks = getattr(trainer, "checkpoint_callbacks", None) or []
    return [callback for callback in callbacks if getattr(callback, "dirpath", None) is not None]


def to_loggers(trainer: Any) -> Callable[[Summary], None]:
    """Lightning: straight to `trainer.loggers` at its global step, at the interval nanwatch was given (`log_dict`
    would also apply `log_every_n_steps`)."""

    def send(summary: Summary) -> None:
        metrics = summary.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    return send
