"""Pausing Python's automatic garbage collection while a watched micro-batch runs (`WatchConfig.pause_gc`).

Full mode makes a frame, its lines and their measurements at every module call, and they live until the micro-batch
is checked. That is longer than the collector's young generations last, so without a pause every one of them is
promoted to the oldest generation, whose full passes walk every object of the process (torch's, the model's, the
user's): on a model of many small modules that added 4 % to 6 % to a step (benchmarks/overhead.py --dispatch
--gc-pause-too). Paused, they are freed by reference counting when the check lets them go, before any collection sees
them.

Only automatic collection pauses (`gc.collect()` still works), and only from a watched micro-batch's start to its
check: reference counting frees everything as usual, and only garbage in reference cycles waits. It is one switch
for the process, not a count of holders: whichever watcher ends a micro-batch, raises or closes resumes the
collector, and a loop that never ends its micro-batches gets it back once 20,000 frames are pending. A watcher
abandoned mid-batch (its loop raised in a notebook cell, and it was never closed) would keep it paused until some
watcher's next check, maybe never: a watchdog thread resumes any pause that no micro-batch renewed for
`PAUSE_LIMIT_S` seconds (a micro-batch that long only loses the pause's benefit). A collector that was already
disabled is left alone, and a forked child (a DataLoader worker) starts with the collector on.
"""

from __future__ import annotations

import gc
import os
import threading
import time

__all__ = ["pause_collection", "resume_collection", "collection_paused", "PAUSE_LIMIT_S"]

# The longest a pause lasts without a new micro-batch renewing it.
PAUSE_LIMIT_S = 30.0
_LOCK = threading.Lock()
_PAUSED = False  # whether nanwatch disabled the collector (and so must enable it again)
_PAUSED_AT = 0.0  # time.monotonic() of the latest pause_collection() while paused
_WATCHDOG: threading.Thread | None = None


def pause_collection() -> None:
    """Disable automatic collection, unless it is disabled already (by nanwatch or by the user); renew the pause."""
    global _PAUSED, _PAUSED_AT
    with _LOCK:
        if not _PAUSED and gc.isenabled():
            gc.disable()
            _PAUSED = True
        if _PAUSED:
            _PAUSED_AT = time.monotonic()
            _start_watchdog()


def _start_watchdog() -> None:
    global _WATCHDOG
    if _WATCHDOG is None:
        _WATCHDOG = threading.Thread(target=_watch, name="nanwatch-gc-pause-watchdog", daemon=True)
        _WATCHDOG.start()


def _watch() -> None:
    """Wake a few times per limit (at least once a second); resume a pause older than the limit."""
    global _PAUSED
    while True:
        time.sleep(min(1.0, PAUSE_LIMIT_S / 4))
        with _LOCK:
            if _PAUSED and time.monotonic() - _PAUSED_AT > PAUSE_LIMIT_S:
                _PAUSED = False
                gc.enable()


def _after_fork_in_child() -> None:
    """A forked child has no watchdog thread, and none of the parent's micro-batches: collector on, as it was."""
    global _PAUSED, _WATCHDOG
    _WATCHDOG = None
    if _PAUSED:
        _PAUSED = False
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
