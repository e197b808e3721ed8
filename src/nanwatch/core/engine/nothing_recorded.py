"""What nanwatch says, once, when a watched training batch recorded nothing at all: why, as far as it is known."""

from __future__ import annotations

__all__ = ["nothing_recorded"]


def nothing_recorded(batch_number: int, *, attached: bool, hooked: bool, modules: bool, compiled: bool) -> str | None:
    """The warning for a watched training batch that recorded no frame, or None when there is nothing to say.

    Args:
        attached: the engine's hooks are on the model now.
        hooked: they were put on it once (full mode, some module in scope), whether or not they are still there.
        modules: some module is watched.
        compiled: torch.compile compiled something in this process.
    """
    if not attached:
        if not hooked:
            return None
        # The hooks are gone: close(), or the adapter's own cleanup when nanwatch raised.
        return (
            "nanwatch: the batches since nanwatch raised (or was closed) are not watched: its hooks went with "
            "the error. Watch the model again (nanwatch.watch) to go on watching. (Said once.)"
        )
    if not modules:
        return None
    batch = f"batch_number={batch_number}"
    if compiled:  # a compiled training step runs no hook added after it was compiled
        return (
            f"nanwatch: no watched module recorded anything during {batch}. If the model runs inside code "
            "compiled by torch.compile before watching began, that code runs no hook added later: start watching "
            "before the first compiled call, or call torch._dynamo.reset() after starting to watch. (Said once.)"
        )
    return (
        f"nanwatch: no watched module recorded anything during {batch}: no forward of the watched model ran "
        "in training mode since the previous batch ended (a forward in eval mode is not watched unless "
        "watch_eval=True). (Said once.)"
    )
