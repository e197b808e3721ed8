"""Where the ranks of one run post detections and settle on one verdict, through the process group's store.

Ranks tell each other of a detection through the store every `init_process_group` sets up (no collective of
nanwatch's own: one would pair with whatever the user's ranks run next). The protocol costs the store nothing while
no rank detects anything, and a constant number of round trips per rank when one does, however many ranks there are:

- *attach* (every rank, when its watcher is made): `add` -1 to the count of posts and to the count of
  acknowledgements. Both counts reach 0 once every rank that attached has posted (acknowledged) or closed, so a rank
  that never attached (a watcher on some ranks only) or has closed (it finished) is never waited for.
- *post* (a rank that saw inf/nan): `append` its detection to one key, then `add` 1 to the count of posts.
- *decide* (one rank, whom the count names): the rank whose `add` completed the count (0), or the first rank to close
  the count (adding a large constant: a rank that may not wait, as it posts; a rank whose wait ran out with posts
  missing, after the wait). It reads every post in one `get`, writes the verdict key once (`compare_set`: a rank whose
  watcher attached after another had decided alone finds the verdict already there, and takes it) and the verdict
  into every rank's bell in one `multi_set`. One verdict is ever written.
- *hear* (every rank): its bell (core/distributed/listener.py), through a listener thread where the store can be cloned.
- *acknowledge* (every rank): `add` 1 to the count of ranks that have the verdict; the rank that completes it says
  so, and every rank waits for that (bounded by `wait_s`) before it raises: no rank exits, and no launcher kills the
  others, before every rank has the verdict.
- *close* (a rank whose watcher ends): `add` 1 to each count this rank has not added to in the current round (it
  will not post, nor acknowledge); a rank whose close completes the count of posts decides, as a poster would.

So a rank makes 4 round trips per detection, the deciding rank 7 (benchmarks/agreement.py counts them), and 2 when
it attaches and 2 when it closes (the last to close up to 4); the store's work per detection is O(N). A rank that
posted has the verdict within `wait_s` when every rank posts, within `2 * wait_s` when some never does, and raises at
most `wait_s` after that (the acknowledgements): at most `3 * wait_s` in all, never a hang. Every call to the store
is guarded: a store that fails (its host rank exited, `destroy_process_group()`) turns the agreement off with one
`NanwatchWarning`, and each rank stops on what it saw itself. A process that hosts the store's server rings the
other members' bells with `GONE` before its server goes (at exit, or when its board goes after the process group
was destroyed), so that their listeners end on a value rather than on a dropped connection, which torch's store
client would log with a C++ stack trace.

Keys come from what every rank shares: the launch (torchrun's run id and restart count), the group's ranks, the
watched model's structure (module classes and parameter names) and how many boards this process made for that pair,
so a watcher of another model on one rank only, or a second run of a sweep on other ranks, shifts nothing, and a
restarted attempt never reads what an earlier one wrote (torchrun's agent store outlives its attempts).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import itertools
import logging
import os
import socket
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from nanwatch.core.distributed.listener import CLOSED, GONE, Bell, PolledBell, bell_for
from nanwatch.core.distributed.ranks import Detection
from nanwatch.core.log import warn

__all__ = ["DetectionBoard", "StoreLost", "board_prefix", "group_of"]

_logger = logging.getLogger("nanwatch")
# Boards made in this process per (group, model structure): every rank makes its boards for a model in one order.
_generations: defaultdict[str, Iterator[int]] = defaultdict(itertools.count)
# Added to the count of posts by a rank that closes it (no waiting, or the wait ran out): counts at or above it say
# the count is closed, and the first rank to close it (the only one that found it below) decides. Counts start at
# minus the ranks that attached, so an open count is below half of it.
_CLOSED = 1 << 40
_OPEN_BELOW = _CLOSED // 2


class StoreLost(RuntimeError):
    """The store failed earlier: this board no longer reaches the other ranks."""


def group_of(model: torch.nn.Module) -> Any:
    """The process group a model is parallel over: DDP's or FSDP1's own; None (the default group) otherwise."""
    return getattr(model, "process_group", None) if hasattr(model, "module") else None


def launch_scope() -> str:
    """The part of the keys that names the launch: torchrun's run id and restart count ("" outside torchrun).

    torchrun's workers share the elastic agent's store, which outlives a failed attempt: the keys of attempt 0 are
    still there when attempt 1 comes up. Every worker of one attempt has the same restart count (a failure, which is
    what a verdict makes of every rank, restarts the worker group with the count one higher), so run id + restart
    count + this process's count of boards (which starts at 0 in every new worker process) is unique per attempt and
    the same on every rank of it, with no collective and nothing written at attach. A generation counted in the store
    instead could not be agreed on without one: ranks attach at different times, and an attempt that died
    half-attached would leave the count between two generations. What this leaves: torchrun counts restarts per
    agent, and one whose workers were still running when another node's failed (or that restarts them for a change of
    membership) does not count that restart; its ranks then share no keys with the other nodes' and reuse their own
    earlier attempt's, which holds no verdict (a verdict fails every rank's worker): they agree among themselves, never
    wait for the others, and at worst wait out `rank_wait_s` once. Outside torchrun the store is made with the
    process group and goes with it (a `FileStore` file must not be reused: torch's own rule).
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return ""
    return f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def board_prefix(model: torch.nn.Module | None, group_ranks: list[int]) -> str:
    """The keys' prefix: the launch, the group's ranks, the model's structure, and this process's count of such
    boards."""
    digest = hashlib.sha1(",".join(map(str, group_ranks)).encode())
    if model is not None:
        for name, module in model.named_modules():
            digest.update(f"{name}:{type(module).__qualname__};".encode())
        for name, _ in model.named_parameters():
            digest.update(f"{name};".encode())
    tag = digest.hexdigest()[:16]
    return f"nanwatch/{launch_scope()}{tag}/{next(_generations[tag])}"


class DetectionBoard:
    """The agreement of one watcher's ranks (see the module's docstring for the protocol).

    Making one attaches this rank (two round trips); `close` counts it out.

    Args:
        store: the store (`torch.distributed` `Store`) shared by every rank.
        rank: this process's rank, as detections name it.
        world_size: how many ranks take part.
        wait_s: how long a rank waits for the other ranks' posts, for a verdict, and for the acknowledgements.
        prefix: the keys' prefix (`board_prefix`), the same on every rank.
        member: this rank's index among those taking part (its bell), `rank` by default.
    """

    def __init__(
        self, store: Any, rank: int, world_size: int, wait_s: float, *, prefix: str = "nanwatch/0", member: int = -1
    ) -> None:
        self._store = store
        self.rank = rank
        self.member = rank if member < 0 else member
        self.world_size = world_size
        self.wait_s = wait_s
        self._prefix = prefix
        self.round = 0
        self.lost: BaseException | None = None
        self.round_trips = 0  # calls this board made to the store (its listener's one get aside)
        self._pid = os.getpid()
        self._closed = False
        self._host_exit = _HostExit(store, self.member, world_size)
        self._start_round(prefix)
        try:
            self._attach()
        except BaseException:
            self._bell.close()
            raise
        _HOST_EXITS.add(self._host_exit)
        weakref.finalize(self, self._host_exit, False).atexit = False  # at exit: _ring_at_exit

    def _start_round(self, prefix: str) -> None:
        self._posts_key = f"{prefix}/posts"
        self._count_key = f"{prefix}/count"
        self._verdict_key = f"{prefix}/verdict"
        self._acks_key = f"{prefix}/acks"
        self._acked_key = f"{prefix}/acked"
        self._bell_prefix = f"{prefix}/bell/"
        self._host_exit.bell_prefix = self._bell_prefix
        self._posted = False
        self._acked = False
        self._bell: Bell = bell_for(self._store, f"{self._bell_prefix}{self.member}")

    def _attach(self) -> None:
        """Count this rank in, on the round's two counts: they complete only once it posted (acknowledged) or closed."""
        self._call("add", self._count_key, -1)
        self._call("add", self._acks_key, -1)

    def next_round(self) -> None:
        """Settle the next detection on fresh keys (after a verdict every rank acted on without stopping: a skipped
        step). Every rank that had the verdict calls this once, so the rounds stay in step."""
        self._bell.close()
        self.round += 1
        if self.lost is None:
            self._start_round(f"{self._prefix}/round{self.round}")
            try:
                self._attach()
            except Exception as error:
                self._lose(error)

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, entry: torch.nn.Module, rank: int, world_size: int, wait_s: float
    ) -> DetectionBoard | None:
        """The board of the group `entry` (the module the user calls) is parallel over, the default group otherwise;
        None when not distributed (or when there is no store)."""
        if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
            group = group_of(entry)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
            size = len(ranks)
            if size <= 1:
                return None
            member = ranks.index(rank) if rank in ranks else rank
            return cls(store, rank, size, wait_s, prefix=board_prefix(model, ranks), member=member)
        except Exception as error:  # no store, or a group we cannot read: no agreement, the run goes on
            _logger.warning(f"nanwatch: ranks will not agree on detections (no process-group store: {error!r})")
            return None

    # ---------------------------------------------------------------------------------------- the hot path

    def posted_elsewhere(self) -> bool:
        """Whether a verdict has reached this rank: a Python attribute with a listener (no store call), else at
        most one look per second. Never raises: a store that fails turns the agreement off, with one warning."""
        if self.lost is not None:
            return False
        try:
            value = self._bell.rung()
        except Exception as error:
            self._lose(error)
            return False
        if value is None and getattr(self._bell, "listening", True) is False:
            self._fall_back()
        if value == GONE:
            self._lose_to_host()
            return False
        return value is not None and value != CLOSED

    # ------------------------------------------------------------------------------------------ settling

    def settle(self, mine: Detection | None, *, wait: bool = True) -> Detection:
        """The verdict every rank raises: the most telling detection posted, fixed once for all ranks.

        Args:
            mine: this rank's detection (posted first), or None when this rank saw nothing but heard a verdict.
            wait: wait up to `wait_s` for every rank's post before deciding (at the optimizer step, where a nan on
                one rank reaches every rank's gradients); without it, decide from what is posted now (a detection
                of kind "gradients" always waits).

        Raises:
            TimeoutError: no verdict within the waits (this rank saw nothing, or no rank decided).
            StoreLost: the store failed, now or earlier.
        """
        if self.lost is not None:
            raise StoreLost(f"the store failed earlier: {self.lost!r}")
        try:
            verdict = self._settle(mine, wait)
        except (TimeoutError, StoreLost):
            raise
        except Exception as error:
            self._lose(error)
            raise StoreLost(repr(error)) from error
        self._acknowledge()
        return verdict

    def _settle(self, mine: Detection | None, wait: bool) -> Detection:
        deadline = time.monotonic() + self.wait_s
        if mine is not None and not self._posted:
            self._posted = True
            self._call("append", self._posts_key, f"{mine.encode()};")
            wait = wait or mine.kind == "gradients"
            # A rank that may not wait closes the count as it posts: the first to close it decides, and no later
            # poster's count can then read as complete.
            added = 1 if wait else 1 + _CLOSED
            count = int(self._call("add", self._count_key, added))
            if count == 0 or (not wait and count - added < _OPEN_BELOW):
                return self._decide()
        heard = self._hear(deadline)
        if heard is not None:
            return heard
        # The wait ran out with posts missing (a rank died, or waits in a collective): the first rank to close the
        # count decides from what was posted, unless every rank had posted (then the last poster decides), and
        # every rank still waiting hears it.
        before = int(self._call("add", self._count_key, _CLOSED)) - _CLOSED
        if before < _OPEN_BELOW and before != 0:
            if not self._posted and not self._call("check", [self._posts_key]):
                raise TimeoutError(f"no rank posted a detection within {self.wait_s:g} s")
            return self._decide()
        heard = self._hear(time.monotonic() + self.wait_s)
        if heard is None:
            raise TimeoutError(f"no verdict within {2 * self.wait_s:g} s")
        return heard

    def _hear(self, deadline: float) -> Detection | None:
        if getattr(self._bell, "listening", True) is False:
            self._fall_back()
        value = self._bell.wait(deadline - time.monotonic())
        if value is None and getattr(self._bell, "listening", True) is False:  # it failed while waiting
            self._fall_back()
            value = self._bell.wait(deadline - time.monotonic())
        if value == GONE:
            self._lose_to_host()
        if self.lost is not None:
            raise StoreLost(f"the store failed: {self.lost!r}")
        if value is None or value == CLOSED:
            return None
        return Detection.decode(value)

    def _decide(self) -> Detection:
        """Read every post (one get), pick the verdict, write it into every rank's bell (one multi_set). Only one rank
        of a board ever gets here: the count says which (`_settle`, `close`)."""
        raw = self._call("get", self._posts_key)
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        posted = [Detection.decode(entry) for entry in text.split(";") if entry.strip()]
        verdict = min(posted, key=Detection.order).encode()
        # The verdict key is written once, whoever gets here: a rank that attached late (its watcher made after
        # another rank had posted and decided alone) may complete the count again, and must then take the verdict
        # already written, never ring the bells with a second one.
        written = self._call("compare_set", self._verdict_key, "", verdict)
        written = written.decode() if isinstance(written, bytes) else str(written)
        if written != verdict:
            return Detection.decode(written)
        bells = [f"{self._bell_prefix}{member}" for member in range(self.world_size)]
        self._call("multi_set", bells, [verdict] * len(bells))
        return Detection.decode(verdict)

    def _acknowledge(self) -> None:
        """Count this rank as having the verdict; wait (up to `wait_s`) until every rank that attached and has not
        closed does, so that no rank exits, and no launcher kills the others, before each has it. A failure here
        changes no verdict."""
        if self._acked:
            return
        self._acked = True
        try:
            if int(self._call("add", self._acks_key, 1)) >= 0:
                self._call("set", self._acked_key, "1")
            else:
                self._call("wait", [self._acked_key], datetime.timedelta(seconds=self.wait_s))
        except Exception:  # a rank that never acknowledges (it died): raise anyway
            return

    # ------------------------------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop listening (the listener thread, if any, ends) and count this rank out: the other ranks no longer wait
        for its post or its acknowledgement. A close that completes the count of posts decides for those waiting."""
        try:  # a store whose host has gone (its GONE already heard by the listener) is not called again
            heard = self._bell.rung() if getattr(self._bell, "listening", False) else None
        except Exception:
            heard = None
        self._bell.close()
        if heard == GONE and self.lost is None:
            self._lose_to_host()
        if self._closed or self.lost is not None or os.getpid() != self._pid:
            return
        self._closed = True
        try:
            if not self._posted:
                self._posted = True
                if int(self._call("add", self._count_key, 1)) == 0 and self._call("check", [self._posts_key]):
                    self._decide()
            if not self._acked:
                self._acked = True
                if int(self._call("add", self._acks_key, 1)) >= 0:
                    self._call("set", self._acked_key, "1")
        except Exception as error:
            self._lose(error)

    # ------------------------------------------------------------------------------------------ the store

    def _call(self, name: str, *args: Any) -> Any:
        self.round_trips += 1
        return getattr(self._store, name)(*args)

    def _fall_back(self) -> None:
        """The listener ended without a value: poll the bell instead, unless the store's server is gone (a poll would
        only fail, and torch's client would log each failure with a C++ stack trace)."""
        failure = getattr(self._bell, "failure", None)
        if not _reachable(self._store):
            self._lose(failure if failure is not None else ConnectionError("the store's server is gone"))
            return
        self._bell = PolledBell(self._store, self._bell.key)

    def _lose_to_host(self) -> None:
        self._lose(ConnectionError("the rank that hosts the store left, and its store with it"))

    def _lose(self, error: BaseException) -> None:
        if self.lost is None:
            self.lost = error
            warn(
                f"nanwatch: the process group's store failed ({error!r}): ranks no longer agree on detections, and "
                "each rank stops on what it sees itself"
            )


# ---------------------------------------------------------------------------------------- the store's host leaving


class _HostExit:
    """What a board leaves behind for when its store's server goes: in the process that hosts it, the other
    members' bells are rung with `GONE` (each only if not rung yet), so their listeners end on a value, not on a
    dropped connection. Called with `exiting=True` at interpreter exit, with False when the board goes (then only if
    the process group no longer uses this store: otherwise the server lives on)."""

    def __init__(self, store: Any, member: int, world_size: int) -> None:
        self.store: Any = store
        self.member = member
        self.world_size = world_size
        self.bell_prefix = ""
        self.pid = os.getpid()

    def __call__(self, exiting: bool) -> None:
        store, self.store = self.store, None
        if store is None or os.getpid() != self.pid:  # done already, or a forked child (its parent's connection)
            return
        with contextlib.suppress(Exception):
            if (exiting or not _serves_default_group(store)) and _hosts(store):
                for member in range(self.world_size):
                    if member != self.member:
                        store.compare_set(f"{self.bell_prefix}{member}", "", GONE)


_HOST_EXITS: weakref.WeakSet[_HostExit] = weakref.WeakSet()


def _tcp_store(store: Any) -> Any:
    """The TCPStore under `store`'s prefixes, or None (an in-memory or file store: no server of its own)."""
    tcp_store = getattr(dist, "TCPStore", None)  # absent where torch.distributed is not built in
    for _ in range(8):
        if tcp_store is not None and isinstance(store, tcp_store):
            return store
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def _serves_default_group(store: Any) -> bool:
    """Whether the default process group still uses `store`'s server (it then lives on, whatever this board does)."""
    ours = _tcp_store(store)
    if ours is None or not (dist.is_available() and dist.is_initialized()):
        return False
    default = _tcp_store(dist.distributed_c10d._get_default_store())
    return default is not None and (default.host, default.port) == (ours.host, ours.port)


def _hosts(store: Any) -> bool:
    """Whether this process runs `store`'s server: a socket of its own listens on the store's port (Linux's /proc;
    False where it cannot tell)."""
    base = _tcp_store(store)
    if base is None:
        return False
    own = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                own.add(os.readlink(f"/proc/self/fd/{fd}"))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                listening = len(fields) > 9 and fields[3] == "0A"  # state LISTEN
                if listening and int(fields[1].rsplit(":", 1)[1], 16) == base.port and f"socket:[{fields[9]}]" in own:
                    return True
    return False


def _reachable(store: Any) -> bool:
    """Whether `store`'s server still takes connections (a plain TCP connect, which the server does not log; True
    for a store with no server of its own)."""
    base = _tcp_store(store)
    if base is None:
        return True
    try:
        with socket.create_connection((base.host, base.port), timeout=2.0):
            return True
    except OSError:
        return False


@atexit.register
def _ring_at_exit() -> None:
    """Before the interpreter goes (and the server it may host with it), ring the other members' bells (`_HostExit`).
    Registered after core/distributed/listener.py's `_close_at_exit`, so it runs before that ends this process's
    listeners."""
    for host_exit in list(_HOST_EXITS):
        host_exit(True)
