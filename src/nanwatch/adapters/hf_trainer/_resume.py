"""The HF Trainer: `trainer.train(resume_from_checkpoint=...)` refuses a checkpoint that holds inf/nan before the
first step (`verify_resumed`).

The Trainer tells its callbacks neither that it resumes nor from where: it loads the model, the optimizer and the
scheduler from the folder, then calls `on_train_begin`, with its state (`global_step`, read from the folder's
`trainer_state.json`) and the model and optimizer it loaded. So the check is of what was loaded, there, before the
first step: the model's tensors and the optimizer's state, named as the guard names them before a save
(`model.net.0.weight`, `optimizer.state.0.exp_avg`). A fresh start (`global_step` 0) resumed nothing and is not checked.

The masks (a buffer that holds -inf by design) are the model's as the Trainer was built (`on_init_end`), before any
checkpoint was loaded into it. A callback added after that (`trainer.add_callback`) never saw the model so: a tensor
whose every value is 0 or -inf is then taken for a mask. Duck-typed: transformers is not imported.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nanwatch.adapters._checks import real_optimizer
from nanwatch.core.features.checkpoint_load import ModelMasks, verify_state

__all__ = ["verify_resumed"]


def verify_resumed(args: Any, state: Any, model: torch.nn.Module, optimizer: Any, masks: ModelMasks | None) -> None:
    """In `on_train_begin`: when the Trainer resumed, check the model and optimizer it loaded."""
    step = state.global_step
    if not step:
        return
    checked: dict[str, Any] = {"model": model}
    if optimizer is not None:
        checked["optimizer"] = real_optimizer(optimizer)
    folder = _resumed_folder(args, step)
    verify_state(
        checked,
        folder,
        described=f"the model and optimizer state train() resumed at optimizer step {step} (from {folder!r})",
        outcome="train() stops before its first step",
        masks=masks,
    )


def _resumed_folder(args: Any, step: int) -> str:
    """Where the Trainer resumed from, as far as a callback can tell: `args.resume_from_checkpoint` when it names a
    folder, else `<output_dir>/checkpoint-<global_step>`, the folder the Trainer wrote at that step (the one
    `resume_from_checkpoint=True` picks)."""
    given = getattr(args, "resume_from_checkpoint", None)
    if isinstance(given, str) and os.path.isdir(given):
        return given
    return os.path.join(args.output_dir or ".", f"checkpoint-{step}")
