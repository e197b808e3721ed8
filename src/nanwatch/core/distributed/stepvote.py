"""Under `on_detect="skip"`, every rank of a group learns before each optimizer step whether any rank detected inf/nan
in that step's window, so that every rank skips the same step, whatever the rank-local cause.

A nan that reaches the gradients reaches every rank's (DDP all-reduces them first), and every rank's guard sees it at
the same step. A cause that stays on one rank does not: an inf in a diagnostic output that never reaches the
gradients, a spike on one rank. Ranks would learn of it through the detection board (board.py) only later, once
some of them had applied the step, and the replicas would differ from then on. So, with skip and more than one rank,
the ranks take one vote per optimizer step, through the process group's store (no collective of nanwatch's own):

- *arrive* (every rank, before its step): a rank that holds a detection first `append`s it to the step's posts; then
  every rank `add`s to the step's count: 1 for arriving, plus `_POSTED` when it posted.
- *decide* (one rank, whom the count names): the rank whose `add` completed the count (every rank arrived), or the
  first rank to close it (adding `_CLOSED`: a rank whose wait ran out, or one that no longer waits, see below). It
  reads the posts (one `get`, only when the count says some rank posted) and `set`s the step's decision: the posts
  it read, which may be none.
- *hear* (every other rank): `wait` for the decision (bounded by `wait_s`), then `get` it.

Every rank acts on the one decision, so every rank applies or skips the same step: a rank that arrives after the
decision (its post too late to be read) follows it, and keeps its detection for the next step's vote. So a rank makes
2 to 4 round trips per optimizer step (3 without a detection unless it completes the count: then 2); nothing else,
and nothing at all in a single process or under `on_detect="raise"`.

A rank that does not arrive within `wait_s` (it finished early, waits in `join()`, never made a watcher, or died):
the first rank whose wait ran out closes the count and decides without it, with one `NanwatchWarning`; from then on
that rank waits for nobody (it decides from what was posted when it arrives, or hears the decision of a rank that
came first), so the missing rank costs `wait_s` once, not at every step. A decision never reached within a second
`wait_s` (the deciding rank died between its `add` and its `set`), or a store that fails: this rank acts on what it
saw itself, with one `NanwatchWarning` (the ranks may then differ).

Keys are the detection board's prefix (the launch, the group, the model, this process's count of boards) and the
step's index in this vote: a later step or a restarted attempt never reads an earlier step's keys.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from nanwatch.core.distributed.ranks import Detection
from nanwatch.core.log import warn

__all__ = ["StepVote", "VoteLost"]

# The count: arrivals in its low bits, posts above them, and a rank that closed it above both.
_POSTED = 1 << 20
_CLOSED = 1 << 40
_ARRIVALS = _POSTED - 1
_DECISION = "decided:"  # the decision's value: this, then the posts read (never empty, so never mistaken for absent)


class VoteLost(RuntimeError):
    """No decision reached this rank (the store failed, or the deciding rank never wrote it)."""


class StepVote:
    """One group's vote before each optimizer step (see the module's docstring).

    Args:
        store: the process group's store (`torch.distributed` `Store`), shared by every rank.
        prefix: the keys' prefix, the same on every rank (the detection board's).
        members: how many ranks vote (the group's size).
        wait_s: how long a rank waits for the others, then for a decision (`rank_wait_s`).
    """

    def __init__(self, store: Any, prefix: str, members: int, wait_s: float) -> None:
        self._store = store
        self._prefix = f"{prefix}/steps"
        self.members = members
        self.wait_s = wait_s
        self.step = 0  # votes taken: the next vote's index
        self.waits = True  # False once a wait ran out: this rank waits for nobody from then on
        self.lost: BaseException | None = None
        self.round_trips = 0

    def vote(self, mine: Detection | None) -> list[Detection]:
        """Every detection posted for this step and read by the rank that decided (this rank's, if in time).

        Raises:
            VoteLost: no decision reached this rank (said once as a `NanwatchWarning`); act on what it saw itself.
        """
        keys = f"{self._prefix}/{self.step}"
        self.step += 1
        if self.lost is not None:
            raise VoteLost(f"the store failed earlier: {self.lost!r}")
        try:
            decision = self._vote(keys, mine)
        except VoteLost:
            raise
        except Exception as error:
            self._lose(error)
            raise VoteLost(repr(error)) from error
        return [Detection.decode(entry) for entry in decision.split(";") if entry.strip()]

    def _vote(self, keys: str, mine: Detection | None) -> str:
        deadline = time.monotonic() + self.wait_s
        added = 1
        if mine is not None:
            self._call("append", f"{keys}/posts", f"{mine.encode()};")
            added += _POSTED
        if not self.waits:
            added += _CLOSED
        count = int(self._call("add", f"{keys}/count", added))
        before = count - added
        if before < _CLOSED and ((count & _ARRIVALS) == self.members or not self.waits):
            return self._decide(keys, count)  # every rank arrived, or this rank closed the count first
        decision = self._hear(keys, deadline)
        if decision is not None:
            return decision
        # The wait ran out with ranks missing: the first rank to close the count decides without them, and this
        # rank waits for nobody from then on.
        before = int(self._call("add", f"{keys}/count", _CLOSED)) - _CLOSED
        arrived = before & _ARRIVALS
        if arrived != self.members:
            self.waits = False
            warn(
                f"nanwatch: on_detect='skip': {self.members - arrived} of {self.members} ranks did not reach the vote "
                f"before an optimizer step within rank_wait_s={self.wait_s:g} s (a rank that finished, waits in "
                "join(), has no watcher, or died). The step is decided without them, the same on every rank that "
                "votes, and this rank waits for no rank at later steps: a detection that reaches a vote late is "
                "acted on at the next step, on every rank alike"
            )
            if before < _CLOSED:
                return self._decide(keys, before)
        decision = self._hear(keys, time.monotonic() + self.wait_s)
        if decision is None:
            error = TimeoutError(f"no decision within {2 * self.wait_s:g} s")
            self._lose(error)
            raise VoteLost(repr(error))
        return decision

    def _decide(self, keys: str, count: int) -> str:
        """Read the posts (only when some rank posted) and write the decision; only one rank per step gets here."""
        posts = ""
        if (count % _CLOSED) >= _POSTED:
            raw = self._call("get", f"{keys}/posts")
            posts = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._call("set", f"{keys}/decision", _DECISION + posts)
        return posts

    def _hear(self, keys: str, deadline: float) -> str | None:
        try:
            self._call(
                "wait", [f"{keys}/decision"], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))
            )
        except Exception as error:
            if "timeout" not in str(error).lower() and "timed out" not in str(error).lower():
                raise
            return None
        raw = self._call("get", f"{keys}/decision")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return text[len(_DECISION) :] if text.startswith(_DECISION) else text

    def acknowledge(self) -> None:
        """Before every rank raises on the last decision: wait (up to `wait_s`) until every rank has read it, so that
        no rank exits, and takes a store it hosts with it, before the others have it. A failure changes nothing."""
        if self.lost is not None or self.step == 0:
            return
        keys = f"{self._prefix}/{self.step - 1}"
        try:
            if int(self._call("add", f"{keys}/read", 1)) >= self.members:
                self._call("set", f"{keys}/all_read", "1")
            else:
                self._call("wait", [f"{keys}/all_read"], datetime.timedelta(seconds=self.wait_s))
        except Exception:  # a rank that never reads it (it died): raise anyway
            return

    def _call(self, name: str, *args: Any) -> Any:
        self.round_trips += 1
        return getattr(self._store, name)(*args)

    def _lose(self, error: BaseException) -> None:
        if self.lost is None:
            self.lost = error
            warn(
                f"nanwatch: the process group's store failed before an optimizer step ({error!r}): under "
                "on_detect='skip' each rank now skips on what it sees itself, and the replicas may differ"
            )
