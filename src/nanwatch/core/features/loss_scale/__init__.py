"""Loss scaling (`torch.amp.GradScaler`): which inf/nan gradients are expected, the scale's history, and its floor.

Under a `GradScaler`, gradients are computed from `loss * scale`. When the scale is too large some of them overflow
to inf (or nan), `scaler.step()` finds that, skips the optimizer step (it never calls `optimizer.step()`), and
`scaler.update()` multiplies the scale by its backoff factor (0.5 by default). Those inf gradients are the scaler
working as designed, not a bug. So, with a scaler attached, a detection is judged by where it first appears:

- first in a backward frame, with no forward frame of the check holding inf/nan: a *gradient overflow*. It is
  recorded (logged, kept in the history) and the run goes on, as long as the scaler skips that step. It is confirmed
  as skipped when the scale is seen to go down (at the check that found it or later). If instead the optimizer step
  runs with no `found_inf` (the scaler looked at these gradients and let them through: they were not in its
  optimizer's parameters, or no longer non-finite when it looked), the step is not a skipped one and the detection
  is raised at the next check, on every rank.
- first in a forward frame (an activation, a weight, or the loss given to `watch_loss`): always raised, as without a
  scaler. Non-finite weights or a non-finite loss are never the scaler's doing.
- the scale below `min_loss_scale`: raised as `LossScaleBelowFloor`. Each skipped step halves the scale; a scale
  that keeps falling means gradients overflow however small the scale is, i.e. the values themselves are inf/nan.

The scale is read once per training batch (`get_scale()`, one scalar) and every change is kept, on the micro-batch
whose optimizer step caused it: that is the history shown in the report (its own section). Lightning and Accelerate
read it as each micro-batch ends, after the batch check; the plain loop as the next micro-batch starts (its `step()`
may come before or after `scaler.step()`), and the HF Trainer right after each optimizer step: those adapters say
when with the "settled" optimizer stage. The plain loop's moment is inside a forward pre-hook, where reading a GPU's
scale would make the host wait for the GPU: there the scale is copied on its device and compared with the last
reading, the comparison rides on the micro-batch's check (its one host read), and the copy is read only when the
scale changed; a scale below the floor then stops the run as that micro-batch ends rather than as it starts. The
scale is the same on every rank (`scaler.step` decides from gradients all ranks share after their all-reduce), so
every rank reaches the floor at the same batch and raises there without a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nanwatch.core.feature_api import EngineContext, Feature, OptimizerStage, Phase
from nanwatch.core.features.loss_scale.monitor import GradientOverflow, LossScaleMonitor
from nanwatch.core.frames import Direction, Frame
from nanwatch.core.readouts import (
    LOSS_SCALE_HISTORY,
    GradScalerLike,
    LossScaleHistory,
    Readout,
    ScaleReading,
    ScaleRecord,
    scaler_of,
)
from nanwatch.core.report import Report

__all__ = [
    "GradScalerLike",
    "GradientOverflow",
    "LossScaleFeature",
    "LossScaleHistory",
    "LossScaleMonitor",
    "ScaleReading",
    "ScaleRecord",
    "scaler_of",
]


class LossScaleFeature(Feature):
    """The GradScaler policy: which inf/nan gradients are expected, the scale's history, and its floor.

    Inert until the adapter hands over the run's scaler (`Watcher.watch_scaler`).
    """

    name = "loss_scale"

    def __init__(self, min_loss_scale: float | None) -> None:
        self.min_loss_scale = min_loss_scale
        self.monitor: LossScaleMonitor | None = None
        self.reading: ScaleReading = "at_batch_end"

    def readouts(self) -> Mapping[Readout[Any], Callable[[], Any]]:
        return {LOSS_SCALE_HISTORY: lambda: None if self.monitor is None else self.monitor.history()}

    def on_scaler(self, ctx: EngineContext, scaler: Any, read_scale: str) -> None:
        # `Watcher.watch_scaler` checked both (readouts.checked_scaler) before dispatching this event.
        self.monitor = LossScaleMonitor(scaler, self.min_loss_scale, ctx.logger)
        self.reading = "at_batch_end" if read_scale == "at_batch_end" else "when_settled"
        # The first reading: the baseline a first skipped step is seen against (before any scale(), the initial
        # scale, read without touching the device).
        self.monitor.observe(ctx.counters.batch_number, ctx.counters.optimizer_step)

    # ------------------------------------------------------------------------------------------------ checks

    def held(self, ctx: EngineContext) -> Report | None:
        return None if self.monitor is None else self.monitor.take_fatal()  # an overflow on a step not skipped

    def screen(
        self, ctx: EngineContext, pending: Sequence[Frame], maxima: Mapping[tuple[Any, Any], torch.Tensor]
    ) -> list[torch.Tensor]:
        return [] if self.monitor is None else self.monitor.deferred_flags()  # a scale copied in a hook: changed?

    def review(self, ctx: EngineContext, pending: Sequence[Frame]) -> Report | None:
        if self.monitor is not None:
            self.monitor.deferred_changed()  # read when the micro-batch ends
        return None

    def judge(self, ctx: EngineContext, report: Report, checked: Sequence[Frame]) -> Report | None:
        amp = self.monitor
        if amp is not None:
            amp.deferred_changed()  # a check that found inf/nan does not review the flags: read the copy
        if amp is None or not amp.enabled:
            return report
        # The report's frames end at the first frame holding inf/nan: inf/nan first in a forward frame (an
        # activation, a weight, the loss) is never the scaler's doing.
        if not report.frames or not report.frames[-1].is_backward:
            return amp.annotate(report)
        forward = [frame for frame in checked if frame.direction is Direction.FORWARD]
        if forward:
            fatal = ctx.report_for(forward)  # one more read, on the rare overflow path only
            if fatal is not None:  # a later forward holds inf/nan too: that is the report
                return amp.annotate(fatal)
        ctx.keep_as_context(checked)  # the overflow's frames stay as context for later reports
        return amp.gradient_overflow(report)

    # --------------------------------------------------------------------------------------------- the scale

    def on_optimizer_step(
        self, ctx: EngineContext, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None
    ) -> None:
        amp = self.monitor
        if amp is None:
            return
        if stage == "before" and amp.enabled:
            amp.step_applying(optimizer, ctx.counters.batch_number, ctx.counters.optimizer_step)
        elif stage == "after":
            amp.step_done()
        elif stage in ("settled", "settling"):
            amp.step_done()  # the step is over: gradients of the next micro-batch are not judged by it
            if stage == "settled" or not amp.defer(ctx.counters.batch_number - 1, ctx.counters.optimizer_step):
                self.follow(ctx, ctx.counters.batch_number - 1)

    def on_batch_end(self, ctx: EngineContext, phase: Phase, batch_number: int) -> None:
        if self.monitor is None or phase != "train":
            return
        self.monitor.step_done()
        self.monitor.resolve()  # a scale copied as this micro-batch began: read now if it changed
        self._check_floor(ctx)  # may raise LossScaleBelowFloor, on every rank alike
        if self.reading == "at_batch_end":
            self.follow(ctx, batch_number)  # may raise LossScaleBelowFloor, on every rank alike

    def follow(self, ctx: EngineContext, batch_number: int) -> None:
        """Read the scale (one scalar), put a change on training micro-batch `batch_number`, check the floor.

        Raises:
            LossScaleBelowFloor: the scale is below `min_loss_scale` (on every rank alike), named after `batch_number`.
        """
        amp = self.monitor
        if amp is None:
            return
        try:
            scale = amp.observe(batch_number, ctx.counters.optimizer_step)
        except Exception as failure:  # a scaler we cannot read must not kill a healthy run
            ctx.logger.warning(f"nanwatch could not read the GradScaler's scale (the run goes on): {failure!r}")
            return
        self._check_floor(ctx)  # a copy read first, for an earlier micro-batch
        if scale is not None:
            self._raise_below_floor(ctx, scale, batch_number)

    def _check_floor(self, ctx: EngineContext) -> None:
        """The floor, for a scale copied in a hook and read since (`LossScaleMonitor.resolve`)."""
        if self.monitor is not None and self.monitor.unchecked is not None:
            scale, batch_number = self.monitor.unchecked
            self.monitor.unchecked = None
            self._raise_below_floor(ctx, scale, batch_number)

    def _raise_below_floor(self, ctx: EngineContext, scale: float, batch_number: int) -> None:
        amp = self.monitor
        if amp is None or not amp.below_floor(scale):
            return
        report, error = amp.floor_detection(
            scale,
            batch_number=batch_number,
            rank=ctx.rank,
            world_size=ctx.world_size,
            optimizer_step=ctx.counters.optimizer_step,
            epoch=ctx.counters.epoch,
        )
        ctx.publish(report)
        # The scale is the same on every rank (the scaler decides from all-reduced gradients), so every rank stops
        # here, at the same batch, without a collective.
        raise error
