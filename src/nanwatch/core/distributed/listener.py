"""How a rank hears the verdict of a detection without asking the store every micro-batch.

Each rank has a bell: one key of its own in the process group's store (`<prefix>/bell/<member>`). The rank that
fixes a verdict writes it into every bell at once (one `multi_set`). A `BellListener` waits for its rank's bell on a
connection of its own (`store.clone()`) in a daemon thread, blocked in one `get` that the store answers when the bell
is written: the training loop reads a Python attribute, and the store sees nothing from an idle rank. Where the store
cannot be cloned (an in-memory `HashStore`, a store of another kind), or the listener's connection fails, a
`PolledBell` looks at the bell from the training thread instead, at most once per `POLL_INTERVAL_S`.

Closing rings the rank's own bell with `CLOSED`, which ends the thread. A process that hosts the store's server rings
the other ranks' bells with `GONE` before its server goes (core/distributed/board.py): their listeners end on a value,
where a dropped connection would end them with a C++ stack trace from torch's store client on stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import threading
import time
import weakref
from typing import Any

__all__ = ["CLOSED", "GONE", "POLL_INTERVAL_S", "Bell", "BellListener", "PolledBell", "bell_for"]

CLOSED = "closed"
GONE = "gone"  # the rank that hosts the store is leaving, and its store with it
# The fallback's pace: at most one look at the store per second and rank (a thousand ranks: a thousand ops a second,
# under 1 % of what one TCPStore server does on one core).
POLL_INTERVAL_S = 1.0
# The listener's `get` waits for this long before it gives up (and falls back to polling): a run's length.
_LISTEN_TIMEOUT = datetime.timedelta(days=30)
# Listeners whose thread may still be blocked in the store (a thread keeps its listener alive while it runs).
_LIVE: weakref.WeakSet[BellListener] = weakref.WeakSet()


class Bell:
    """What the training thread asks: has the verdict arrived? Both kinds answer without blocking."""

    key: str

    def rung(self) -> str | None:
        """The bell's value once written (a verdict, `CLOSED` or `GONE`), else None."""
        raise NotImplementedError

    def wait(self, timeout_s: float) -> str | None:
        """Block up to `timeout_s` for the bell; its value, or None."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop listening (the thread, if any, ends)."""


class BellListener(Bell):
    """A daemon thread blocked in `get(key)` on a connection of its own (`store.clone()`, made in the thread, so that
    attaching never waits for a connection)."""

    def __init__(self, store: Any, key: str) -> None:
        self.key = key
        self._store = store
        self._pid = os.getpid()
        self._value: str | None = None
        self.failure: BaseException | None = None
        self._done = threading.Event()
        self.ready = threading.Event()  # connected, about to block in get (tests and the benchmark wait for it)
        self._thread = threading.Thread(target=self._listen, name="nanwatch-bell", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _listen(self) -> None:
        try:
            own = self._store.clone()  # a blocked get must not hold up the training thread's calls
            own.set_timeout(_LISTEN_TIMEOUT)
            self.ready.set()
            raw = own.get(self.key)
            self._value = raw.decode() if isinstance(raw, bytes) else str(raw)
        except BaseException as error:  # no clone, the store went away (its host rank exited), or a month passed
            self.failure = error
        finally:
            self.ready.set()
            self._done.set()

    @property
    def listening(self) -> bool:
        """False once the thread ended without a value (the store failed): poll instead."""
        return not (self._done.is_set() and self._value is None)

    def rung(self) -> str | None:
        return self._value

    def wait(self, timeout_s: float) -> str | None:
        self._done.wait(max(0.0, timeout_s))
        return self._value

    def close(self) -> None:
        """Ring this bell with `CLOSED` through the training thread's connection: the blocked get returns, the
        thread ends (a verdict already there stays)."""
        # Not from a forked child: the connection is its parent's, and a call from here would garble the parent's.
        if self._value is None and not self._done.is_set() and os.getpid() == self._pid:
            with contextlib.suppress(Exception):  # the store is gone: so is the listener's connection
                self._store.compare_set(self.key, "", CLOSED)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


class PolledBell(Bell):
    """The bell, looked at from the training thread: at most once per `POLL_INTERVAL_S` in `rung`."""

    def __init__(self, store: Any, key: str) -> None:
        self.key = key
        self._store = store
        self._value: str | None = None
        self._next_look = 0.0

    def rung(self) -> str | None:
        if self._value is None and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + POLL_INTERVAL_S
            self._look()
        return self._value

    def wait(self, timeout_s: float) -> str | None:
        if self._value is None:
            try:
                self._store.wait([self.key], datetime.timedelta(seconds=max(0.001, timeout_s)))
            except Exception as error:  # a timeout: not rung (a lost store raises again on `get`)
                if "timeout" not in str(error).lower():
                    raise
                return None
            self._look()
        return self._value

    def _look(self) -> None:
        if self._store.check([self.key]):
            raw = self._store.get(self.key)
            self._value = raw.decode() if isinstance(raw, bytes) else str(raw)


def bell_for(store: Any, key: str) -> Bell:
    """A listener where the store can be cloned, else a polled bell (a listener that fails is replaced by one)."""
    return BellListener(store, key) if hasattr(store, "clone") else PolledBell(store, key)


@atexit.register
def _close_at_exit() -> None:
    """End every listener thread while the interpreter still runs: one still blocked in the store as the interpreter
    finalizes would be woken (the store's host closing its socket) into a dead interpreter, which aborts."""
    listeners = list(_LIVE)
    for listener in listeners:
        listener.close()
    deadline = time.monotonic() + 2.0
    for listener in listeners:
        listener.join(max(0.0, deadline - time.monotonic()))
