"""Pausing Python's automatic garbage collection while a watched micro-batch runs (`WatchConfig.pause_gc`).

Full mode makes a frame, its lines and their measurements at every module call, and they live until the micro-batch
is checked. That is longer than the collector's young generations last, so without a pause every one of them is
promoted to the oldest generation, whose full passes walk every object of the process (torch's, the model's, the
user's): on a model of many small modules that added 4 % to 6 % to a step (benchmarks/overhead.py --dispatch
--gc-pause-too). Paused, they are freed by reference counting when the check lets them go, before any collection sees
them.

Only automatic collection pauses (`gc.collect()` still works), and only from a watched micro-batch's start to its
check: reference counting frees everything as usual, and only garbage in reference cycles waits. It is one pause for
the process, not a count of holders: whichever watcher ends a micro-batch, raises or closes resumes it, and a loop
that never ends its micro-batches gets it back once 20,000 frames are pending. A watcher abandoned mid-batch (its
loop raised in a notebook cell, and it was never closed) would keep it paused until some watcher's next check, maybe
never: a watchdog thread resumes any pause that no micro-batch renewed for `PAUSE_LIMIT_S` seconds (a micro-batch
that long only loses the pause's benefit). A forked child (a DataLoader worker) starts unpaused.

The collector's switch is the user's: nanwatch never calls `gc.disable()` or `gc.enable()`. It pauses by setting the
youngest generation's threshold to 0 (which stops automatic collection, as the `gc` docs say), and resumes by
putting the thresholds back as they were, unless the user set others meanwhile (theirs stay). So a `gc.disable()` or
`gc.enable()` the user makes before or during a watched micro-batch is what holds after it, and `gc.isenabled()`
always answers the user's own setting; only `gc.get_threshold()` shows the pause while it lasts.
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
_PAUSED = False  # whether nanwatch set the thresholds for a pause (and so must put them back)
_PAUSED_AT = 0.0  # time.monotonic() of the latest pause_collection() while paused
_SAVED: tuple[int, ...] = ()  # the thresholds before the pause
_PAUSING: tuple[int, ...] = ()  # the thresholds set for the pause: still these at the end, the pause is undone
_WATCHDOG: threading.Thread | None = None


def pause_collection() -> None:
    """Pause automatic collection (threshold 0 for the youngest generation), unless it is paused already (by nanwatch,
    or by the user's own threshold 0); renew the pause. The collector's switch (`gc.isenabled()`) is not touched."""
    global _PAUSED, _PAUSED_AT, _SAVED, _PAUSING
    with _LOCK:
        if not _PAUSED:
            thresholds = gc.get_threshold()
            if thresholds[0] != 0:
                _SAVED, _PAUSING = thresholds, (0, *thresholds[1:])
                gc.set_threshold(*_PAUSING)
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
    while True:
        time.sleep(min(1.0, PAUSE_LIMIT_S / 4))
        with _LOCK:
            if _PAUSED and time.monotonic() - _PAUSED_AT > PAUSE_LIMIT_S:
                _resume()


def _resume() -> None:
    """End the pause (with `_LOCK` held): the thresholds as they were, unless the user set others since."""
    global _PAUSED
    _PAUSED = False
    if gc.get_threshold() == _PAUSING:
        gc.set_threshold(*_SAVED)


def _after_fork_in_child() -> None:
    """A forked child has no watchdog thread, and none of the parent's micro-batches: unpaused, as it was."""
    global _WATCHDOG, _LOCK
    _WATCHDOG = None
    _LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    if _PAUSED:
        _resume()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def resume_collection() -> None:
    """End nanwatch's pause of automatic collection, if one is on; otherwise nothing."""
    with _LOCK:
        if _PAUSED:
            _resume()


def collection_paused() -> bool:
    """Whether nanwatch holds automatic collection paused now."""
    return _PAUSED
