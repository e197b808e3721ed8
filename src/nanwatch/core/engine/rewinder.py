"""`on_detect="rewind"`: an agreed detection puts the last certified checkpoint back in place, on every rank alike.

The arbiter (arbiter.py) reaches a rewind where a skip would skip: at the optimizer step the detection reaches, after
every rank voted (core/distributed/stepvote.py), with the step's gradients cleared (the step applies nothing). Here:

1. the point: the last checkpoint certified (verified finite, then written) by any rank: the store's
   (core/distributed/rewind_notice.py) with more than one rank, this watcher's own otherwise;
2. every rank waits until every rank has read the vote and the point (`StepVote.acknowledge`);
3. refused, the same on every rank (each read the same point and counts the same rewinds): no point yet, or
   `max_rewinds` rewinds done already; the arbiter raises `NonFiniteError` saying which;
4. the adapter's `Restorer` puts the checkpoint back into the live objects, in place;
5. with more than one rank, a second vote: a rank whose restore failed posts it, and every rank learns whether any
   did. One that failed may hold half-restored state: every rank raises rather than go on (never a collective);
6. the rewind is listed: `rewinds`, `report_dir/rewinds.jsonl` (rank 0), one warning in the log.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from nanwatch.core.distributed.ranks import Detection
from nanwatch.core.distributed.rewind_notice import RewindNotice
from nanwatch.core.distributed.stepvote import StepVote, VoteLost
from nanwatch.core.log import warn
from nanwatch.core.rewinds import REWIND_LIST, Restorer, Rewind, RewindPoint

__all__ = ["CannotRewind", "Rewinder"]


class CannotRewind(Exception):
    """Why this detection is raised instead of rewound: its message ends the `NonFiniteError`'s."""


class Rewinder:
    """The checkpoint a rewind restores, the adapter's way of restoring it, and the rewinds done.

    Args:
        max_rewinds: the rewinds a run may make; the detection after them raises.
        rank: this process's rank.
        world_size: the number of ranks.
        report_dir: where rank 0 appends each rewind (`rewinds.jsonl`); None: nowhere.
        notice: with more than one rank, the store's record of the last certified checkpoint.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        max_rewinds: int,
        rank: int,
        world_size: int,
        report_dir: Path | None,
        notice: RewindNotice | None,
    ) -> None:
        self._logger = logger
        self._max = max_rewinds
        self._rank = rank
        self._world_size = world_size
        self._report_dir = report_dir
        self._notice = notice
        self._restorer: Restorer | None = None
        self._point: RewindPoint | None = None  # the last checkpoint this rank certified
        self.rewinds: list[Rewind] = []

    def restore_with(self, restorer: Restorer) -> None:
        """The adapter's way of putting a checkpoint back into its live objects."""
        self._restorer = restorer

    def certified(self, point: RewindPoint) -> None:
        """A checkpoint was verified finite and written: the one to rewind to from now on, on every rank."""
        self._point = point
        if self._notice is not None:
            self._notice.announce(point)

    def rewind(self, agreed: Detection, votes: StepVote | None) -> Rewind:
        """Put the last certified checkpoint back in place for the detection `agreed` (see the module's docstring).

        Args:
            votes: the step vote, when the ranks agreed through it (every rank calls this then, at the same vote).

        Raises:
            CannotRewind: nothing to rewind to, `max_rewinds` reached, or a restore failed (here or on another rank).
        """
        point = self._target()
        if votes is not None:
            votes.acknowledge()  # every rank has the vote and the point before any certifies a newer one, or raises
        if point is None:
            raise CannotRewind(
                "on_detect='rewind' has no checkpoint to rewind to: none was verified finite and written yet (the "
                "plain loop's handle.save_checkpoint(), or the framework's own saves). The run stops here"
            )
        if len(self.rewinds) >= self._max:
            done = ", ".join(str(rewind.batch_number) for rewind in self.rewinds)
            raise CannotRewind(
                f"on_detect='rewind' rewound {len(self.rewinds)} times already (max_rewinds={self._max}"
                f"{f'; at batch_number {done}' if done else ''}): a run that keeps going non-finite is not saved by "
                "rewinding. The run stops here"
            )
        restored, failure = self._restore(point)
        failed_elsewhere = self._failed_elsewhere(agreed, votes, failure is not None)
        if failure is not None or failed_elsewhere:
            if failure is not None:
                why = f"restoring it failed: {failure}"
            else:
                why = f"restoring it failed on rank {', '.join(map(str, failed_elsewhere))} (that rank says why)"
            raise CannotRewind(
                f"on_detect='rewind' went back to {point.path!r} (optimizer step {point.optimizer_step}), and {why}. "
                "What was restored before the failure may not match the rest: the run stops here rather than go on "
                "from half-restored state"
            )
        assert restored is not None
        done_now = Rewind(agreed.batch_number, agreed.rank, point.path, point.optimizer_step, restored)
        self.rewinds.append(done_now)
        self._list(done_now)
        return done_now

    def _target(self) -> RewindPoint | None:
        if self._notice is not None:
            shared = self._notice.read()
            if shared is not None:
                return shared
        return self._point

    def _restore(self, point: RewindPoint) -> tuple[tuple[str, ...] | None, str | None]:
        """What was restored, or why not."""
        if self._restorer is None:  # an adapter that allows rewind registers one as it attaches
            return None, "this adapter registered no way to restore a checkpoint"
        try:
            return tuple(self._restorer(point)), None
        except Exception as error:
            return None, str(error) or repr(error)

    def _failed_elsewhere(self, agreed: Detection, votes: StepVote | None, failed_here: bool) -> list[int]:
        """With the ranks: the other ranks whose restore failed (each learns it from one more vote)."""
        if votes is None:
            return []
        mine = Detection(agreed.batch_number, self._rank, agreed.phase) if failed_here else None
        try:
            posted = votes.vote(mine)
        except VoteLost:  # said once by the vote: this rank goes on what it knows itself
            posted = []
        failed = sorted({detection.rank for detection in posted if detection.rank != self._rank})
        if failed_here or failed:
            votes.acknowledge()  # every rank read the outcome before any raises (and may take the store with it)
        return failed

    def _list(self, rewind: Rewind) -> None:
        where = ""
        if self._report_dir is not None and self._rank == 0:
            path = self._report_dir / REWIND_LIST
            try:
                with path.open("a", encoding="utf-8") as file:
                    file.write(json.dumps(rewind.to_json()) + "\n")
                where = f"; listed in {path}"
            except OSError as error:  # a full disk must not end the run it was asked to keep going
                warn(f"nanwatch could not append to {path}: {error!r}")
        on_rank = f" on rank {rewind.rank}" if self._world_size > 1 else ""
        self._logger.warning(
            f"nanwatch: inf/nan during batch_number={rewind.batch_number}{on_rank}: rewound to {rewind.path!r} "
            f"(optimizer step {rewind.optimizer_step}; restored {', '.join(rewind.restored)}), the step of this "
            f"micro-batch left out (on_detect='rewind', {len(self.rewinds)} of at most {self._max}){where}"
        )
