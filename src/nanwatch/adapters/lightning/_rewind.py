"""`on_detect="rewind"` in Lightning, beside lightning/__init__.py: which checkpoints a rewind may restore
(`rewind_point_of`), and restoring one in place, the way Lightning's own resume does (`restorer_for`).

A checkpoint the strategy wrote after the checkpoint guard verified it (`ModelCheckpoint`'s, `trainer.save_checkpoint`)
is a rewind point if it holds the optimizers' state: a weights-only one (`save_weights_only=True`) is passed over, the
last full one stays the point. At a rewind, through the strategy (any strategy, any file system, as
`trainer.fit(ckpt_path=...)` reads and restores): `strategy.load_checkpoint`, then `load_model_state_dict` (the
LightningModule's weights and buffers) and `load_optimizer_state_dict`; then each LR scheduler's state and the precision
plugin's (a GradScaler's scale). The loops, the callbacks' state and `global_step` are left as they are: the run goes
on counting. Duck-typed: Lightning is not imported.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import Any

from nanwatch.core.rewinds import Restorer, RewindPoint

__all__ = ["restorer_for", "rewind_point_of"]


def rewind_point_of(checkpoint: Mapping[str, Any], filepath: Any, step: int | None) -> RewindPoint | None:
    """The rewind point a checkpoint just written makes, or None when a rewind could not restore it in full."""
    if "state_dict" not in checkpoint or "optimizer_states" not in checkpoint:
        return None
    return RewindPoint(str(os.fspath(filepath)), step)


def restorer_for(trainer: Any) -> Restorer:
    """Puts a rewind point back into `trainer`'s LightningModule, optimizers, schedulers and precision plugin.
    Holds the trainer weakly."""
    held = weakref.ref(trainer)

    def restore(point: RewindPoint) -> tuple[str, ...]:
        trainer = held()
        if trainer is None:
            raise RuntimeError("the Trainer no longer exists")
        strategy, plugin = trainer.strategy, trainer.precision_plugin
        checkpoint = strategy.load_checkpoint(point.path)
        schedulers = list(trainer.lr_scheduler_configs)
        optimizer_states = checkpoint.get("optimizer_states", [])
        scheduler_states = checkpoint.get("lr_schedulers", [])
        # Every part there before anything is touched: most failures leave the live objects as they were.
        if "state_dict" not in checkpoint or len(optimizer_states) != len(trainer.optimizers):
            raise RuntimeError(
                f"{point.path!r} holds {len(optimizer_states)} optimizer states for {len(trainer.optimizers)} "
                "optimizers, or no state_dict"
            )
        if len(scheduler_states) != len(schedulers):
            raise RuntimeError(
                f"{point.path!r} holds {len(scheduler_states)} LR scheduler states for {len(schedulers)} schedulers"
            )
        module = trainer.lightning_module
        strategy.load_model_state_dict(checkpoint, strict=getattr(module, "strict_loading", True))
        strategy.load_optimizer_state_dict(checkpoint)
        restored = ["state_dict", "optimizer_states"]
        for config, state in zip(schedulers, scheduler_states, strict=True):
            config.scheduler.load_state_dict(state)
        if schedulers:
            restored.append("lr_schedulers")
        name = type(plugin).__qualname__  # where Lightning keeps the precision plugin's state (its GradScaler's)
        if name in checkpoint:
            plugin.load_state_dict(checkpoint[name])
            restored.append(name)
        return tuple(restored)

    return restore
