"""Under `on_detect="rewind"` with more than one rank: which checkpoint every rank rewinds to.

In a DDP loop one rank usually writes the checkpoints (`if rank == 0: handle.save_checkpoint(...)`), yet every rank
must restore the same one. So the rank that certifies a checkpoint also writes it (a `RewindPoint`: its path, its
optimizer step, what each part of it is) to one key of the process group's store, the detection board's prefix and
`/rewind_point`: one `set` per checkpoint, nothing per step. At a rewind, after the step vote has decided it, every
rank reads that key, and then waits until every rank has read the vote (`StepVote.acknowledge`), so no rank can
certify a newer checkpoint over it before the others have read it. No collective.
"""

from __future__ import annotations

from typing import Any

from nanwatch.core.log import warn
from nanwatch.core.rewinds import RewindPoint

__all__ = ["RewindNotice"]


class RewindNotice:
    """The last certified checkpoint of one group's watchers, shared through the store.

    Args:
        store: the process group's store (`torch.distributed` `Store`), shared by every rank.
        prefix: the keys' prefix, the same on every rank (the detection board's).
    """

    def __init__(self, store: Any, prefix: str) -> None:
        self._store = store
        self._key = f"{prefix}/rewind_point"
        self._said = False

    def announce(self, point: RewindPoint) -> None:
        """This rank certified `point`: every rank rewinds to it from now on (a failure is said once; each rank then
        falls back on the checkpoints it certified itself)."""
        try:
            self._store.set(self._key, point.encode())
        except Exception as error:
            self._say(error)

    def read(self) -> RewindPoint | None:
        """The last point any rank announced, or None (none yet, or the store failed: said once)."""
        try:
            if not self._store.check([self._key]):
                return None
            return RewindPoint.decode(self._store.get(self._key))
        except Exception as error:
            self._say(error)
            return None

    def _say(self, error: BaseException) -> None:
        if not self._said:
            self._said = True
            warn(
                f"nanwatch: on_detect='rewind': the process group's store failed ({error!r}); each rank now rewinds "
                "to the last checkpoint it certified itself"
            )
