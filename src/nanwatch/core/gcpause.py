"""Pausing Python's automatic garbage collection while a watched micro-batch runs (`WatchConfig.pause_gc`).

Full mode makes a frame, its lines and their measurements at every module call, and they live until the micro-batch
is checked. That is longer than the collector's young generations last, so without a pause every one of them is
promoted to the oldest generation, whose full passes walk every object of the process (torch's, the model's, the
user's): on a model of many small modules that added about 4 % to a step (benchmarks/overhead.py --dispatch
--gc-pause-too). Paused, they are freed by reference counting when the check lets them go, before any collection sees
them.

Only automatic collection pauses (`gc.collect()` still works), and only from a watched micro-batch's start to its
check: reference counting frees everything as usual, and only garbage in reference cycles waits. It is one switch
for the process, not a count of holders: whichever watcher ends a micro-batch, raises or closes resumes the
collector, so a watcher abandoned mid-batch (its loop raised, and it was never closed) keeps it paused only until
any watcher's next check, and a loop that never ends its micro-batches gets it back once 20,000 frames are pending.
A collector that was already disabled is left alone.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["pause_collection", "resume_collection", "collection_paused"]

_LOCK = threading.Lock()
_PAUSED = False  # whether nanwatch disabled the collector (and so must enable it again)


def pause_collection() -> None:
    """Disable automatic collection, unless it is disabled already (by nanwatch or by the user)."""
    global _PAUSED
    with _LOCK:
        if not _PAUSED and gc.isenabled():
            gc.disable()
            _PAUSED = True


def resume_collection() -> None:
    """Enable automatic collection again if nanwatch disabled it; otherwise nothing."""
    global _PAUSED
    with _LOCK:
        if _PAUSED:
            _PAUSED = False
            gc.enable()


def collection_paused() -> bool:
    """Whether nanwatch holds automatic collection paused now."""
    return _PAUSED
