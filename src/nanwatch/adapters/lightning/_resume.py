"""Lightning: `trainer.fit(model, ckpt_path=...)` refuses a checkpoint that holds inf/nan before anything of it is
restored (`refuse_poisoned_resume`).

Lightning reads the checkpoint through its strategy (`strategy.load_checkpoint`, whichever strategy and file system),
then restores the model, the callbacks, the optimizers and the loops from the dict it read, all before the first step.
The callback has no event between the read and the restore (its `on_load_checkpoint` comes after the model's weights
are loaded), so the strategy's `load_checkpoint` is wrapped on that one instance, from the callback's `setup` of a fit
to its `teardown`: the dict it returns is checked (its `state_dict` and `optimizer_states`, as the guard checks them
before writing), and a poisoned one raises `NonFiniteCheckpoint` before Lightning restores any of it. The masks (a
buffer that holds -inf by design) are the LightningModule's as it is just before the read: built, not yet restored.
Duck-typed: Lightning is not imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.adapters._checkpoints import WrappedOnInstance
from nanwatch.core.features.checkpoint_load import ModelMasks, verify_state

__all__ = ["refuse_poisoned_resume"]


def refuse_poisoned_resume(trainer: Any, pl_module: torch.nn.Module) -> WrappedOnInstance:
    """Check the checkpoint `trainer.fit(ckpt_path=...)` reads before Lightning restores anything of it; `remove()` on
    what this returns puts the strategy's own `load_checkpoint` back."""

    def make(load: Callable[..., Any]) -> Callable[..., Any]:
        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            masks = ModelMasks([pl_module])  # as built, before the checkpoint's buffers are copied into it
            checkpoint = load(checkpoint_path, *args, **kwargs)
            path = str(os.fspath(checkpoint_path) if isinstance(checkpoint_path, os.PathLike) else checkpoint_path)
            verify_state(
                checkpoint,
                path,
                described=f"the checkpoint {path!r} that trainer.fit() resumes from",
                outcome="nothing of it was restored, and the run stops before its first step",
                masks=masks,
            )
            return checkpoint

        return load_checkpoint

    return WrappedOnInstance(trainer.strategy, "load_checkpoint", make)
