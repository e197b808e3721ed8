"""Where the ranks of one run post detections and settle on one verdict, through the process group's store.

Ranks tell each other of a detection through the store every `init_process_group` sets up (no collective of
nanwatch's own: one would pair with whatever the user's ranks run next). The protocol costs the store nothing while
no rank detects anything, and a constant number of round trips per rank when one does, however many ranks there are:

- *post* (a rank that saw inf/nan): `append` its detection to one key, then `add` 1 to the count of posts.
- *decide* (one rank, whom the count names): the rank whose `add` completed the count, or the first rank to close
  the count (adding a large constant: a rank that may not wait, as it posts; a rank whose wait ran out with posts
  missing, after the wait). It reads every post in one `get` and writes the verdict into every rank's bell in one
  `multi_set`. Exactly one rank finds the count complete or first closes it, so one verdict is ever written.
- *hear* (every rank): its bell (core/listener.py), through a listener thread where the store can be cloned.
- *acknowledge* (every rank): `add` 1 to the count of ranks that have the verdict; the rank that completes it says
  so, and every rank waits for that (bounded by `wait_s`) before it raises: no rank exits, and no launcher kills the
  others, before every rank has the verdict.

So a rank makes 4 round trips per detection, the deciding rank 6 (benchmarks/agreement.py counts them);
the store's work per detection is O(N). A rank that posted has the verdict within `wait_s` when every rank posts,
within `2 * wait_s` when some never does, and raises at most `wait_s` after that (the acknowledgements): at most
`3 * wait_s` in all, never a hang. Every call to the store is guarded: a store that fails (its host rank exited,
`destroy_process_group()`) turns the agreement off with one warning, and each rank stops on what it saw itself.

Keys come from what every rank shares: the group's ranks, the watched model's structure (module classes and
parameter names) and how many boards this process made for that pair, so a watcher of another model on one rank
only, or a second run of a sweep on other ranks, shifts nothing.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from nanwatch.core.listener import CLOSED, Bell, PolledBell, bell_for
from nanwatch.core.ranks import Detection

__all__ = ["DetectionBoard", "StoreLost", "board_prefix", "group_of"]

_logger = logging.getLogger("nanwatch")
# Boards made in this process per (group, model structure): every rank makes its boards for a model in one order.
_generations: defaultdict[str, Iterator[int]] = defaultdict(itertools.count)
# Added to the count of posts by a rank that closes it (no waiting, or the wait ran out): counts at or above it say
# the count is closed, and the first rank to close it (the only one that found it below) decides.
_CLOSED = 1 << 40


class StoreLost(RuntimeError):
    """The store failed earlier: this board no longer reaches the other ranks."""


def group_of(model: torch.nn.Module) -> Any:
    """The process group a model is parallel over: DDP's or FSDP1's own; None (the default group) otherwise."""
    return getattr(model, "process_group", None) if hasattr(model, "module") else None


def board_prefix(model: torch.nn.Module | None, group_ranks: list[int]) -> str:
    """The keys' prefix: the group's ranks, the model's structure, and this process's count of such boards."""
    digest = hashlib.sha1(",".join(map(str, group_ranks)).encode())
    if model is not None:
        for name, module in model.named_modules():
            digest.update(f"{name}:{type(module).__qualname__};".encode())
        for name, _ in model.named_parameters():
            digest.update(f"{name};".encode())
    tag = digest.hexdigest()[:16]
    return f"nanwatch/{tag}/{next(_generations[tag])}"


class DetectionBoard:
    """The agreement of one watcher's ranks (see the module's docstring for the protocol).

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
        self._start_round(prefix)

    def _start_round(self, prefix: str) -> None:
        self._posts_key = f"{prefix}/posts"
        self._count_key = f"{prefix}/count"
        self._verdict_key = f"{prefix}/verdict"
        self._acks_key = f"{prefix}/acks"
        self._acked_key = f"{prefix}/acked"
        self._bell_prefix = f"{prefix}/bell/"
        self._posted = False
        self._bell: Bell = bell_for(self._store, f"{self._bell_prefix}{self.member}")

    def next_round(self) -> None:
        """Settle the next detection on fresh keys (after a verdict every rank acted on without stopping: a skipped
        step). Every rank that had the verdict calls this once, so the rounds stay in step."""
        self._bell.close()
        self.round += 1
        if self.lost is None:
            self._start_round(f"{self._prefix}/round{self.round}")

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
            if count == self.world_size or (not wait and count - added < _CLOSED):
                return self._decide()
        heard = self._hear(deadline)
        if heard is not None:
            return heard
        # The wait ran out with posts missing (a rank died, or waits in a collective): the first rank to close the
        # count decides from what was posted, unless every rank had posted (then the last poster decides), and
        # every rank still waiting hears it.
        count = int(self._call("add", self._count_key, _CLOSED))
        if count - _CLOSED < _CLOSED and count - _CLOSED != self.world_size:
            if count - _CLOSED == 0:
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
        if value is None or value == CLOSED:
            return None
        return Detection.decode(value)

    def _decide(self) -> Detection:
        """Read every post (one get), pick the verdict, write it into every rank's bell (one multi_set). Only one rank
        of a board ever gets here: the count says which (`_settle`)."""
        raw = self._call("get", self._posts_key)
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        posted = [Detection.decode(entry) for entry in text.split(";") if entry.strip()]
        verdict = min(posted, key=Detection.order).encode()
        bells = [f"{self._bell_prefix}{member}" for member in range(self.world_size)]
        self._call("multi_set", [*bells, self._verdict_key], [verdict] * (len(bells) + 1))
        return Detection.decode(verdict)

    def _acknowledge(self) -> None:
        """Count this rank as having the verdict; wait (up to `wait_s`) until every rank does, so that no rank
        exits, and no launcher kills the others, before each has it. A failure here changes no verdict."""
        try:
            if int(self._call("add", self._acks_key, 1)) >= self.world_size:
                self._call("set", self._acked_key, "1")
            else:
                self._call("wait", [self._acked_key], datetime.timedelta(seconds=self.wait_s))
        except Exception:  # a rank that never acknowledges (it finished, or died): raise anyway
            return

    # ------------------------------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop listening: the listener thread, if any, ends (nothing else hears this rank's bell)."""
        self._bell.close()

    # ------------------------------------------------------------------------------------------ the store

    def _call(self, name: str, *args: Any) -> Any:
        self.round_trips += 1
        return getattr(self._store, name)(*args)

    def _fall_back(self) -> None:
        self._bell = PolledBell(self._store, self._bell.key)

    def _lose(self, error: BaseException) -> None:
        if self.lost is None:
            self.lost = error
            _logger.warning(
                f"nanwatch: the process group's store failed ({error!r}): ranks no longer agree on detections, and "
                "each rank stops on what it sees itself"
            )
