"""`on_detect="rewind"` with Accelerate, beside accelerate/__init__.py: a rewind restores the last folder
`accelerator.save_state()` wrote after the checkpoint guard verified it, with Accelerate's own `load_state(folder)`.

`load_state` puts back, in place, what `save_state` saved: every prepared model, optimizer and LR scheduler, the
GradScaler, the RNG states, its step counter (`accelerator.step`, by which it tells the micro-batches of an
accumulation window apart), the samplers of its prepared dataloaders where it saves them, and the objects registered
with `register_for_checkpointing`. The tracker's own counters are left as they are, if it is registered too: the run
goes on counting its micro-batches. Duck-typed: Accelerate is not imported.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

from nanwatch.core.rewinds import Restorer, RewindPoint

__all__ = ["restorer_for"]


def restorer_for(accelerator: Any, keep_counters: Callable[[bool], None], tracker: object) -> Restorer:
    """Restores a rewind point through `accelerator.load_state`; `keep_counters(True)` while it runs (`tracker`, the
    one registered object whose state is not restored, then ignores its `load_state_dict`). Holds the Accelerator
    weakly."""
    held = weakref.ref(accelerator)

    def restore(point: RewindPoint) -> tuple[str, ...]:
        accelerator = held()
        if accelerator is None:
            raise RuntimeError("the Accelerator no longer exists")
        if not os.path.isdir(point.path):  # before anything is touched
            raise RuntimeError(f"{point.path!r} is no longer a folder that accelerator.save_state() wrote")
        keep_counters(True)
        try:
            accelerator.load_state(point.path)
        finally:
            keep_counters(False)
        parts = {
            "models": accelerator._models,
            "optimizers": accelerator._optimizers,
            "schedulers": accelerator._schedulers,
            "scaler": accelerator.scaler,
            "objects registered for checkpointing": [o for o in accelerator._custom_objects if o is not tracker],
        }
        return tuple(name for name, held_now in parts.items() if held_now) + ("random states",)

    return restore
