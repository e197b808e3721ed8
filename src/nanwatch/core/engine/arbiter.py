"""Agreement: what happens to a detection between the check that finds it and the error every rank raises.

One small state machine per watcher:

    clear --(a check finds inf/nan)--> held --(the optimizer step, or a check that does not hold)--> agreed --> raised
      |                                                                                                 ^
      +------------------(another rank posted a detection: this rank learns of it at a check)----------+

- *held*: the report is kept (and, where this rank saw inf/nan itself, already published) until the optimizer
  step, where a nan on any rank has reached every rank's gradients. In a single process nothing is held (the
  detection is raised at once) unless `on_detect="skip"`, which acts at the step. With no guarded optimizer there
  is no step to wait for: it is raised at once too.
- *agreed*: ranks settle on one detection through the store (core/distributed/; no collective): the earliest batch,
  then the lowest rank, a rank that saw inf/nan itself before one that saw only the shared gradients.
- *raised*: every rank raises the same `NonFiniteError`; the detecting rank's carries its report. The machine is
  clear again (a loop that catches the error and goes on starts afresh).
- *skipped* (`on_detect="skip"`, instead of raised, when the verdict is reached before an optimizer step): every rank
  clears the gradients that step would apply (so the optimizer changes nothing), the report is on disk, the
  micro-batch joins `report_dir/skipped.jsonl`, and the machine is clear again on fresh keys. The
  `max_consecutive_skips + 1`-th detection in a row raises `StepsSkippedInARow` instead.
- *rewound* (`on_detect="rewind"`, where a skip would skip): the gradients are cleared as for a skip, and every rank
  puts the last certified checkpoint back in place (rewinder.py); with no such checkpoint, after `max_rewinds`
  rewinds, or when a restore fails, every rank raises instead.

Under `on_detect="skip"` (and `"rewind"`) with more than one rank, the ranks vote before every optimizer step
(stepvote.py): each learns, before it steps, whether any rank detected inf/nan in that step's window, so every rank
skips the same step whatever the rank-local cause (an inf in a diagnostic output that never reaches the gradients, a
spike on one rank). The vote replaces the board's settling there; the board still carries what raises (evaluation,
`check()`).

A step the GradScaler skips itself is not skipped again: a detection held for a step that the scaler skipped (the
scale went down at or after the detection's micro-batch: no `optimizer.step()` came for that window) is let go, its
report on disk, and a step the optimizer is told to skip (`found_inf`, fused optimizers) is neither listed nor
counted as nanwatch's.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from nanwatch.core.distributed.board import DetectionBoard, StoreLost
from nanwatch.core.distributed.ranks import Detection, Kind
from nanwatch.core.distributed.stepvote import StepVote, VoteLost
from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.publisher import Publisher
from nanwatch.core.engine.rewinder import CannotRewind, Rewinder
from nanwatch.core.frames import counter_name
from nanwatch.core.log import warn
from nanwatch.core.optimizers import skips_this_step
from nanwatch.core.report import Report
from nanwatch.errors import NonFiniteError, StepsSkippedInARow

__all__ = ["Arbiter", "SKIP_LIST", "Stage", "kind_of"]

# The skip list's name in report_dir: one JSON object per skipped micro-batch.
SKIP_LIST = "skipped.jsonl"


class Stage(enum.Enum):
    CLEAR = "clear"  # nothing detected on this rank
    HELD = "held"  # detected on this rank, held until ranks meet


def kind_of(report: Report) -> Kind:
    """What a detection rests on: what this rank saw itself (a frame holding inf/nan, the sentinel's sum of the model's
    output), or only the gradients about to be applied, which an all-reduce spreads to every rank."""
    seen_here = report.section("sentinel") is not None or any(frame.non_finite for frame in report.frames)
    return "frames" if seen_here else "gradients"


class Arbiter:
    """Holds this rank's detection, settles it with the other ranks, raises the agreed one.

    Args:
        board: where ranks tell each other of a detection; None in a single process.
        publisher: logs and writes a report (once per detection) before anything raises.
        on_raise: called just before the error is raised (the micro-batch ends there).
        on_detect: "raise", "skip" (a verdict reached before an optimizer step skips that step), or "rewind" (acts
            where a skip would, and rewinds through `rewinder`).
        max_consecutive_skips: with "skip", the steps that may be skipped in a row.
        report_dir: where the skip list goes (rank 0 writes it); None: nowhere.
        votes: with "skip" and more than one rank, the vote every rank takes before each optimizer step.
        scaler_skipped_since: whether the run's GradScaler skipped a step at or after a training micro-batch (its
            scale went down there); None without a scaler.
        rewinder: with "rewind", what puts the last certified checkpoint back.
    """

    def __init__(
        self,
        board: DetectionBoard | None,
        publisher: Publisher,
        counters: Counters,
        logger: logging.Logger,
        *,
        rank: int,
        world_size: int,
        on_raise: Callable[[], None],
        on_detect: str = "raise",
        max_consecutive_skips: int = 3,
        report_dir: Path | None = None,
        votes: StepVote | None = None,
        scaler_skipped_since: Callable[[int], bool] | None = None,
        rewinder: Rewinder | None = None,
    ) -> None:
        self._board = board
        self._votes = votes
        self._scaler_skipped_since = scaler_skipped_since
        self._rewinder = rewinder
        self._publisher = publisher
        self._counters = counters
        self._logger = logger
        self._rank = rank
        self._world_size = world_size
        self._on_raise = on_raise
        self._held: Report | None = None
        self._published = False
        self._on_detect = on_detect
        self._max_skips = max_consecutive_skips
        self._report_dir = report_dir
        self._about_to_step: torch.optim.Optimizer | None = None  # set while settling before its step
        self._applied_nothing = False  # set while settling a step its optimizer was told to skip on the device
        self.skipped_in_a_row = 0
        self.skipped: list[dict[str, object]] = []  # every skipped micro-batch, as the skip list has it

    @property
    def stage(self) -> Stage:
        return Stage.CLEAR if self._held is None else Stage.HELD

    @property
    def held(self) -> Report | None:
        """This rank's detection, held until ranks meet; None when clear."""
        return self._held

    def posted_elsewhere(self) -> bool:
        """Whether another rank posted a detection (one cheap store read; False in a single process)."""
        return self._board is not None and self._board.posted_elsewhere()

    def detect(self, report: Report | None) -> None:
        """A check's result: the first detection is held (later ones are the same story, told again)."""
        if report is None:
            return
        if self._held is not None and not self._drop_if_the_scaler_skipped_its_step():
            return
        self._held = report
        # On disk before anything else: once other ranks learn of it they may exit, and a launcher such as
        # torchrun can then kill this process before it gets further. Non-finite gradients alone are what
        # every rank sees after the all-reduce: published only if no rank saw where they came from.
        if self._board is None or kind_of(report) == "frames":
            self._publish_held()

    def settle(
        self,
        *,
        hold: bool,
        wait: bool = True,
        before_step: torch.optim.Optimizer | None = None,
        applied_nothing: bool = False,
    ) -> None:
        """Raise on every rank if this rank or another detected inf/nan; keep holding when `hold` (the adapter
        checks before each optimizer step, where ranks will meet). `before_step`: the optimizer about to step, whose
        step `on_detect="skip"` skips instead of raising. `applied_nothing`: that step ran already, told by nanwatch's
        `found_inf` to apply nothing where anything was inf/nan (core/engine/decided_on_device.py): a skip has
        nothing left to clear."""
        self._about_to_step, skipped_before = before_step, len(self.skipped)
        self._applied_nothing = applied_nothing
        # Fused optimizers are called for a step the GradScaler skips, told so by `found_inf`.
        scaler_skips = before_step is not None and not applied_nothing and skips_this_step(before_step)
        try:
            if before_step is not None and self.skips:
                self._drop_if_the_scaler_skipped_its_step()
            if before_step is not None and self.skips and self._votes is not None:
                self._vote(scaler_skips)
            elif before_step is not None and self.skips and scaler_skips and self._held is not None:
                self._let_go_for_the_scaler(self._held)
            else:
                self._settle(hold, wait)
        finally:
            self._about_to_step = None
            self._applied_nothing = False
        if before_step is not None and len(self.skipped) == skipped_before and not scaler_skips:  # this step applies
            self.skipped_in_a_row = 0

    @property
    def skips(self) -> bool:
        """A verdict is acted on at the optimizer step, by skipping it (or rewinding there), not by raising."""
        return self._on_detect in ("skip", "rewind")

    def _drop_if_the_scaler_skipped_its_step(self) -> bool:
        """Under skip, let go of the held detection if the GradScaler skipped a step at or after its micro-batch
        (no `optimizer.step()` came for its window: the scaler did what a skip does). True when nothing is held."""
        held = self._held
        if held is None:
            return True
        if not self.skips or self._scaler_skipped_since is None or held.phase != "train":
            return False
        if not self._scaler_skipped_since(held.batch_number):
            return False
        self._let_go_for_the_scaler(held)
        return True

    def _let_go_for_the_scaler(self, held: Report) -> None:
        """The GradScaler skips (or skipped) the step of `held`'s window itself: nothing to skip, nothing listed."""
        if not self._published and (self._board is None or kind_of(held) == "frames"):
            self._publish_held()
        self._held, self._published = None, False
        self._logger.info(
            f"nanwatch: inf/nan during batch_number={held.batch_number}: the GradScaler skipped that optimizer step "
            "itself (on_detect='skip' skips nothing more, and lists nothing)"
        )

    def _vote(self, scaler_skips: bool) -> None:
        """Before an optimizer step, with skip and more than one rank: every rank learns whether any rank detected
        inf/nan in this step's window, and every rank applies or skips it alike (core/distributed/stepvote.py)."""
        assert self._votes is not None
        if self._held is None and self.posted_elsewhere():  # a verdict that raises (evaluation, check())
            self._settle(hold=False, wait=True)
            return
        mine = self._held
        detection = None if mine is None else Detection(mine.batch_number, self._rank, mine.phase, kind_of(mine))
        try:
            posted = self._votes.vote(detection)
        except VoteLost:  # said once: this rank acts on what it saw itself
            posted = [] if detection is None else [detection]
        if not posted:  # no rank detected (a detection of this rank that reached the vote late waits for the next)
            return
        verdict = min(posted, key=Detection.order)
        if scaler_skips and verdict.phase == "train":  # found_inf: the same on every rank (all-reduced gradients)
            if mine is not None:
                self._let_go_for_the_scaler(mine)
            return
        self._conclude(mine, verdict, voted=True)

    def _settle(self, hold: bool, wait: bool) -> None:
        mine = self._held
        if mine is None:
            if self.posted_elsewhere():
                self._agree_and_raise(None, wait=True)
            return
        if hold and (self._board is not None or self.skips):  # held for the step (where a skip can skip it)
            return
        if self._board is None:
            self._conclude(mine, Detection(mine.batch_number, self._rank, mine.phase))
            return
        self._agree_and_raise(mine, wait=wait)

    def close(self) -> None:
        """Watching ended: stop listening for verdicts."""
        if self._board is not None:
            self._board.close()

    def release(self) -> Report | None:
        """Closing: the detection held for a step that never came (published now if it was not), or None."""
        held = self._held
        if held is not None and not self._published:
            self._publish_held()
        return held

    def _publish_held(self) -> None:
        assert self._held is not None
        self._publisher.publish(self._held)
        self._published = True

    def _agree_and_raise(self, mine: Report | None, *, wait: bool) -> None:
        """Settle with the other ranks on one detection (bounded by `rank_wait_s`) and raise it."""
        assert self._board is not None
        detection = None if mine is None else Detection(mine.batch_number, self._rank, mine.phase, kind_of(mine))
        try:
            verdict = self._board.settle(detection, wait=wait)
        except TimeoutError:
            if detection is None:
                return  # no verdict reached this rank after all: nothing to raise
            verdict = detection  # no rank decided in time: this rank stops on what it saw itself
        except StoreLost:  # the board warned once: this rank stops on what it saw itself
            if detection is None:
                return
            verdict = detection
        except Exception as error:  # anything else of ours: the same, said here
            self._logger.warning(f"nanwatch could not reach the other ranks ({error!r}); raising on this rank")
            if detection is None:
                return
            verdict = detection
        if (
            mine is not None
            and not self._published
            and (verdict.batch_number, verdict.rank)
            == (
                mine.batch_number,
                self._rank,
            )
        ):
            self._publish_held()
        self._conclude(mine, verdict)

    def _conclude(self, local: Report | None, agreed: Detection, *, voted: bool = False) -> None:
        """Raise the verdict, or skip the step about to run (`on_detect="skip"`, a training detection, within the
        limit of steps skipped in a row). `voted`: the ranks agreed through the vote before this step, not the board
        (so every rank has read the vote before any raises, and the board's keys stay as they are)."""
        optimizer = self._about_to_step
        raises = optimizer is None or not self.skips or agreed.phase != "train"
        rewinds = self._rewinder is not None
        at_the_limit = not rewinds and self.skipped_in_a_row >= self._max_skips
        if voted and self._votes is not None and (raises or at_the_limit):
            self._votes.acknowledge()
        if raises:
            self.raise_error(local, agreed)
        assert optimizer is not None
        if rewinds:
            self._rewind(local, agreed, optimizer, voted=voted)
            return
        if self.skipped_in_a_row >= self._max_skips:
            self.raise_error(local, agreed, skipped=self.skipped_in_a_row)
        if (
            local is not None
            and not self._published
            and (local.batch_number, self._rank)
            == (
                agreed.batch_number,
                agreed.rank,
            )
        ):
            self._publish_held()
        if not self._applied_nothing:  # (else: told on the device, it applied nothing; the gradients are the next's)
            for group in optimizer.param_groups:  # nothing to apply: the optimizer leaves every parameter as it is
                for param in group["params"]:
                    param.grad = None
        self._held, self._published = None, False
        self.skipped_in_a_row += 1
        if self._board is not None and not voted:
            self._board.next_round()
        self._list_skip(agreed)  # the micro-batch goes on to its end, as any other

    def _rewind(
        self, local: Report | None, agreed: Detection, optimizer: torch.optim.Optimizer, *, voted: bool
    ) -> None:
        """`on_detect="rewind"`: this step applies nothing (as a skip), and the last certified checkpoint is put back
        in place on every rank (rewinder.py); raised instead where it cannot be."""
        assert self._rewinder is not None
        ours = local is not None and (local.batch_number, self._rank) == (agreed.batch_number, agreed.rank)
        if ours and not self._published:
            self._publish_held()
        for group in optimizer.param_groups:  # nothing to apply: the step leaves every parameter as it is
            for param in group["params"]:
                param.grad = None
        try:
            self._rewinder.rewind(agreed, self._votes if voted else None)
        except CannotRewind as refused:
            self.raise_error(local, agreed, why=str(refused))
        self._held, self._published = None, False
        if self._board is not None and not voted:
            self._board.next_round()

    def _list_skip(self, agreed: Detection) -> None:
        counters = self._counters
        entry: dict[str, object] = {
            "batch_number": agreed.batch_number,
            "rank": agreed.rank,
            "optimizer_step": counters.optimizer_step,
            "epoch": counters.epoch,
            "skipped_in_a_row": self.skipped_in_a_row,
        }
        self.skipped.append(entry)
        where = ""
        if self._report_dir is not None and self._rank == 0:
            path = self._report_dir / SKIP_LIST
            try:
                with path.open("a", encoding="utf-8") as file:
                    file.write(json.dumps(entry) + "\n")
                where = f"; listed in {path}"
            except OSError as error:  # a full disk must not end the run it was asked to keep going
                warn(f"nanwatch could not append to {path}: {error!r}")
        on_rank = f" on rank {agreed.rank}" if self._world_size > 1 else ""
        self._logger.warning(
            f"nanwatch: inf/nan during batch_number={agreed.batch_number}{on_rank}: optimizer step "
            f"{counters.optimizer_step} skipped (on_detect='skip', {self.skipped_in_a_row} in a row of at most "
            f"{self._max_skips}){where}"
        )

    def raise_error(
        self, local: Report | None, agreed: Detection, *, skipped: int | None = None, why: str | None = None
    ) -> NoReturn:
        """Raise `NonFiniteError` (`StepsSkippedInARow` after `skipped` steps skipped in a row): the same on every
        rank, for the detecting rank and batch `agreed` names. `why`: a sentence that ends the message (why a rewind
        could not be made)."""
        self._on_raise()
        self._held, self._published = None, False  # raised once: it is the caller's now
        if self._board is not None and self._board.lost is None and self.skips:
            self._board.next_round()  # a loop that catches it and goes on settles its next detection afresh
        ours = local is not None and (local.batch_number, self._rank) == (agreed.batch_number, agreed.rank)
        mine = local if ours else None
        counters = self._counters
        message = self._message(mine, agreed)
        if why is not None:
            message += f" {why}."
        if skipped is not None:
            self.skipped_in_a_row = 0
            message += f" {skipped} optimizer steps were skipped in a row before it (max_consecutive_skips={skipped})."
            error_type: type[NonFiniteError] = StepsSkippedInARow
            extra: dict[str, int] = {"skipped": skipped}
        else:
            error_type, extra = NonFiniteError, {}
        raise error_type(
            message,
            **extra,
            batch_number=agreed.batch_number,
            rank=agreed.rank,
            module_name=mine.module_name if mine is not None else None,
            report=self._publisher.text(mine) if mine is not None else "",
            optimizer_step=counters.optimizer_step,
            epoch=counters.epoch,
            phase=agreed.phase,
            culprit=mine.culprit if mine is not None else None,
            replay=_replay_verdict(mine),
            cause=mine.cause if mine is not None else None,
            capsule=_written(mine.capsule) if mine is not None else None,
        )

    def _message(self, mine: Report | None, agreed: Detection) -> str:
        where = f" on rank {agreed.rank}" if self._world_size > 1 else ""
        # A detection no frame holds (the guard's gradients): the section that made it says where it was found.
        headline = None
        if mine is not None and kind_of(mine) == "gradients":
            headline = next((section.headline for section in mine.sections if section.headline), None)
        if headline is not None:
            first = headline
        elif mine is not None and mine.module_name is not None:
            first = f", first in module {mine.module_name!r}"
        else:
            first = ""
        if mine is not None and mine.culprit is not None:
            first += f": {mine.culprit}"
        shown = "the frames that led there" if headline is None else "the last frames recorded, then the gradients"
        after = f"The report above shows {shown}." if mine is not None else "See that rank's report."
        during = f"{counter_name(agreed.phase)}={agreed.batch_number}"
        return f"nanwatch: inf/nan detected during {during}{where}{first}. {after}"


def _written(capsule: str | None) -> str | None:
    """The capsule a report names, where it was written (a full disk leaves the report naming it, with a warning)."""
    return capsule if capsule is not None and os.path.isfile(capsule) else None


def _replay_verdict(report: Report | None) -> str | None:
    """Sentinel mode's verdict on running the micro-batch again (its "replay" section), or None."""
    section = report.section("replay") if report is not None else None
    verdict = section.data.get("verdict") if section is not None and isinstance(section.data, dict) else None
    return verdict if isinstance(verdict, str) else None
