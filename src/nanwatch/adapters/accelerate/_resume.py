"""Accelerate: `accelerator.load_state(folder)` refuses a checkpoint that holds inf/nan before it loads any of it
(`guard_accelerate_loads`).

`load_state` finds its folder (the one given, or the latest of `project_dir/checkpoints/` under automatic checkpoint
naming), then calls its load-state pre-hooks with it, before it loads a model, an optimizer or anything else: there
every checkpoint file of the folder is read and checked (`verify_path`), and a poisoned one raises
`NonFiniteCheckpoint` out of `load_state`, with the model and optimizer as they were. A file that `weights_only=True`
refuses (an object registered for checkpointing, which Accelerate itself unpickles with `weights_only=False`) is not
checked, and a line on the `nanwatch` logger says so: nanwatch unpickles nothing that runs code. A folder nanwatch
cannot read as a checkpoint (FSDP's sharded `.distcp` files, no floating-point tensor in any file it reads) is left to
`load_state`, with a warning on the `nanwatch` logger that it was not verified. The hook is
registered by `tracker.attach()` and removed with the watcher's other hooks. The masks (a buffer that holds -inf by
design) are the prepared models' as `attach()` saw them, as the checkpoint guard knows them. Duck-typed: Accelerate
is not imported.
"""

from __future__ import annotations

import os
from typing import Any

from nanwatch.core.contract import AdapterContract
from nanwatch.core.features.checkpoint_load import ModelMasks, verify_path
from nanwatch.errors import CheckpointReadError

__all__ = ["guard_accelerate_loads"]


def guard_accelerate_loads(watcher: AdapterContract, accelerator: Any) -> None:
    """Check the folder `accelerator.load_state()` is about to load, until the watcher closes."""
    models = getattr(accelerator, "_models", [])
    masks = ModelMasks(accelerator.unwrap_model(model, keep_torch_compile=False) for model in models)

    def before_load(models: list[Any], input_dir: str | os.PathLike[str]) -> None:
        path = os.fspath(input_dir)
        try:
            verify_path(
                path,
                described=f"the checkpoint {path!r} that accelerator.load_state() was to load",
                outcome="load_state() loaded none of it",
                masks=masks,
                skip_refused=True,
            )
        except CheckpointReadError as error:  # a format Accelerate reads and nanwatch does not: its load decides
            watcher.logger.warning(f"{error}; not verified, left to accelerator.load_state()")

    watcher.hooks.add_handle(accelerator.register_load_state_pre_hook(before_load))
