"""The loss scale's monitor: the scale read and kept as it changes, the gradient overflows a scaler skips, the floor.

`LossScaleMonitor` is what the loss-scale feature (core/features/loss_scale/__init__.py, where the policy is told in
full) holds once an adapter hands over the run's `GradScaler`: it reads the scale (once per training batch; from a
forward pre-hook as a copy on its device, compared with the last reading in the check's one host read), keeps its
history on the micro-batch whose optimizer step changed it, remembers the gradient overflows that the scaler should
skip, and says when one turned out fatal (the step ran anyway) or the scale fell below `min_loss_scale`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace

import torch

from nanwatch.core.optimizers import skips_this_step
from nanwatch.core.readouts import (
    GradScalerLike,
    LossScaleHistory,
    ScaleRecord,
    checked_scaler,
    scale_text,
)
from nanwatch.core.report import Report, ReportSection
from nanwatch.errors import LossScaleBelowFloor

__all__ = ["READ_AT_ONCE_ON", "GradientOverflow", "LossScaleMonitor"]

# Devices where a scale copied in a hook is read at once instead: reading it there waits for nothing.
READ_AT_ONCE_ON = frozenset({"cpu"})

# Changes of the scale kept for the report: the first reading and the most recent ones.
_MAX_RECORDS = 64
# Gradient overflows remembered (the latest); the count of all of them is kept apart.
_MAX_OVERFLOWS = 16


@dataclass(slots=True)
class GradientOverflow:
    """A check that found inf/nan first in gradients, under a scaler, and let the run go on.

    Attributes:
        report: the report the check built (not published: it is published if the overflow turns out fatal).
        scale: the loss scale the gradients were computed with.
        skipped: True once the scale was seen to go down (the scaler skipped the step), False while unconfirmed.
    """

    report: Report
    scale: float
    skipped: bool


@dataclass(slots=True)
class _DeferredScale:
    """The scale as a micro-batch's forward began, copied on its device (`LossScaleMonitor.defer`).

    Attributes:
        value: the copy (0-d).
        unchanged: 0-d bool on the device, True when the copy equals the last scale read.
        batch_number: the micro-batch whose optimizer step left this scale.
        optimizer_step: the optimizer steps done then.
        screened: `unchanged` went into a check's host read.
        changed: that read found it False (or the check did not say).
    """

    value: torch.Tensor
    unchanged: torch.Tensor
    batch_number: int
    optimizer_step: int | None
    screened: bool = False
    changed: bool = False


class LossScaleMonitor:
    """Follows one `GradScaler` for a `Watcher`: the scale's history, its floor, and the fate of gradient overflows.

    Args:
        scaler: the run's `torch.amp.GradScaler` (anything with `get_scale()` and `is_enabled()`).
        min_loss_scale: stop when the scale falls strictly below this; None for no floor.
        logger: where overflows are logged.

    Raises:
        TypeError: `scaler` is not a GradScaler.
    """

    def __init__(self, scaler: GradScalerLike, min_loss_scale: float | None, logger: logging.Logger) -> None:
        self.scaler = checked_scaler(scaler, "at_batch_end")
        self.min_loss_scale = min_loss_scale
        self.logger = logger
        self._first: ScaleRecord | None = None
        self._records: deque[ScaleRecord] = deque(maxlen=_MAX_RECORDS - 1)
        self._changes = 0
        self._last_scale: float | None = None
        self.skipped_steps = 0
        self.gradient_overflow_count = 0
        self.overflows: deque[GradientOverflow] = deque(maxlen=_MAX_OVERFLOWS)
        self._applying = False
        self._skipping = False  # an optimizer step with found_inf set is under way: it skips itself
        self._fatal: Report | None = None
        self._deferred: _DeferredScale | None = None
        self.unchecked: tuple[float, int] | None = None  # a copied scale read, not yet checked against the floor

    @property
    def enabled(self) -> bool:
        """False for `GradScaler(enabled=False)`: it never skips a step, so there is nothing to follow."""
        return bool(self.scaler.is_enabled())

    # ---------------------------------------------------------------------------------------------- the scale

    def observe(self, batch_number: int, optimizer_step: int | None) -> float | None:
        """Read the scale (one scalar), record it if it changed, and confirm pending overflows if it went down."""
        reading = self._read(batch_number, optimizer_step)
        return None if reading is None else reading[0]

    def _read(self, batch_number: int, optimizer_step: int | None) -> tuple[float, bool] | None:
        if not self.enabled:
            return None
        self.resolve()  # a copy taken earlier comes first: its change belongs to an earlier micro-batch
        return self._record(float(self.scaler.get_scale()), batch_number, optimizer_step)

    # A copy of the scale taken inside a hook, read with the next check (see `defer`).
    def defer(self, batch_number: int, optimizer_step: int | None) -> bool:
        """Copy the scale on its device, to be read at the next check rather than now; False when it cannot be.

        Called from a forward pre-hook: `get_scale()` on a GPU waits for the GPU there, stalling the step it starts.
        The copy and its comparison with the last reading are queued on the device; the check's one host read
        brings the comparison back, and the copy is read only when the scale changed (after a skipped step, or when
        it grows): `resolve`.
        """
        scale = getattr(self.scaler, "_scale", None)  # torch's GradScaler, once its first scale() made it
        if not self.enabled or not isinstance(scale, torch.Tensor) or self._last_scale is None:
            return False
        if scale.device.type in READ_AT_ONCE_ON:  # nothing to wait for: read now, and stop at once if below the floor
            return False
        self.resolve()
        copy = scale.detach().clone().reshape(())
        self._deferred = _DeferredScale(copy, copy.eq(self._last_scale), batch_number, optimizer_step)
        return True

    def deferred_flags(self) -> list[torch.Tensor]:
        """The copied scale's "unchanged" flag, for the check's one host read (once)."""
        deferred = self._deferred
        if deferred is None or deferred.screened:
            return []
        deferred.screened = True
        return [deferred.unchanged]

    def deferred_changed(self) -> None:
        """The flag tripped, or the check found inf/nan and did not say: the copy is read when resolved."""
        if self._deferred is not None:
            self._deferred.changed = True

    def resolve(self) -> None:
        """Take the copied scale into the history, reading it only if it changed or was never screened; the reading
        waits in `unchecked` for the floor check."""
        deferred, self._deferred = self._deferred, None
        if deferred is None or (deferred.screened and not deferred.changed):
            return
        scale = float(deferred.value)
        self._record(scale, deferred.batch_number, deferred.optimizer_step)
        self.unchecked = (scale, deferred.batch_number)

    def _record(self, scale: float, batch_number: int, optimizer_step: int | None) -> tuple[float, bool]:
        last = self._last_scale
        self._last_scale = scale
        if last is not None and scale == last:
            return scale, False
        record = ScaleRecord(batch_number, optimizer_step, scale)
        if self._first is None:
            self._first = record
        else:
            self._records.append(record)
            self._changes += 1
        went_down = last is not None and scale < last
        if went_down:
            self.skipped_steps += 1
            for overflow in self.overflows:
                overflow.skipped = True
        return scale, went_down

    def below_floor(self, scale: float | None) -> bool:
        return scale is not None and self.min_loss_scale is not None and scale < self.min_loss_scale

    def history(self) -> LossScaleHistory:
        self.resolve()
        records = (() if self._first is None else (self._first,)) + tuple(self._records)
        return LossScaleHistory(
            records=records,
            skipped_steps=self.skipped_steps,
            gradient_overflows=self.gradient_overflow_count,
            min_loss_scale=self.min_loss_scale,
            dropped=self._changes - len(self._records),
        )

    def annotate(self, report: Report) -> Report:
        """`report` with the scale history attached (a text line and a JSON object)."""
        history = self.history()
        return report.with_section(ReportSection("loss_scale", 20, (history.to_text(),), history.to_dict(), history))

    # ------------------------------------------------------------------------------------- gradient overflows

    def gradient_overflow(self, report: Report) -> Report | None:
        """A check found inf/nan first in gradients and nowhere in the forward: go on, or return the fatal report.

        Fatal only while an optimizer step is being applied (see `step_applying`): the scaler did not skip it.
        """
        before = self._last_scale
        reading = self._read(report.batch_number, report.optimizer_step)
        if reading is None:  # a disabled scaler skips nothing: the gradients would be applied
            return report
        scale, went_down = reading
        if self._applying:
            return self.annotate(report)
        # The scale already went down since the previous reading: the step these gradients belong to was skipped,
        # and they were computed at the scale before that backoff.
        computed_at = before if went_down and before is not None else scale
        overflow = GradientOverflow(report, computed_at, skipped=went_down or self._skipping)
        self.overflows.append(overflow)
        self.gradient_overflow_count += 1
        where = f", first in module {report.module_name!r} (backward)" if report.module_name is not None else ""
        if went_down:
            verdict = f"the GradScaler skipped its step (scale now {scale_text(scale)})"
        elif self._skipping:
            verdict = "the optimizer skips its step (found_inf)"
        else:
            verdict = "expected if the GradScaler skips its step"
        self.logger.info(
            f"nanwatch: inf/nan gradients during batch_number={report.batch_number}{where} at loss scale "
            f"{scale_text(computed_at)}: {verdict}; going on"
        )
        return None

    def step_applying(
        self, optimizer: torch.optim.Optimizer | None, batch_number: int, optimizer_step: int | None
    ) -> None:
        """An optimizer step is about to apply the gradients (its step pre-hook runs).

        A plain optimizer's pre-hook runs only for steps the scaler lets through. An optimizer that unscales in its
        own step (fused Adam: `_step_supports_amp_scaling`) is called on every step with `found_inf` set; a non-zero
        `found_inf` means it will skip the update itself. Overflows still unconfirmed now were not skipped: the
        first of them becomes the detection raised at the next check.
        """
        if skips_this_step(optimizer):
            for overflow in self.overflows:
                overflow.skipped = True
            self._applying = False
            self._skipping = True  # and so are those the check in this same pre-hook finds
            return
        self._applying = True
        unconfirmed = [overflow for overflow in self.overflows if not overflow.skipped]
        if unconfirmed:
            # A skip since the last reading (an earlier step of this loop) confirms them: one scalar, rarely read.
            self._read(batch_number, optimizer_step)
            unconfirmed = [overflow for overflow in self.overflows if not overflow.skipped]
        if unconfirmed and self._fatal is None:
            self._fatal = self.annotate(unconfirmed[0].report)

    def step_done(self) -> None:
        self._applying = False
        self._skipping = False

    def floor_detection(
        self,
        scale: float,
        *,
        batch_number: int,
        rank: int,
        world_size: int,
        optimizer_step: int | None,
        epoch: int | None,
    ) -> tuple[Report, LossScaleBelowFloor]:
        """The report (the latest overflow's frames and the history) and the error, for a scale below the floor."""
        assert self.min_loss_scale is not None  # below_floor() is False without a floor
        last = self.overflows[-1].report if self.overflows else None
        history = self.history()
        report = self.annotate(
            replace(  # the latest overflow's frames, and whatever was said of them, at this batch
                last if last is not None else Report(batch_number, "train", rank, world_size, None, []),
                batch_number=batch_number,
                phase="train",
                optimizer_step=optimizer_step,
                epoch=epoch,
            )
        )
        where = f"; the last overflow was first in module {last.module_name!r} (backward)" if last is not None else ""
        error = LossScaleBelowFloor(
            f"nanwatch: the GradScaler's loss scale fell to {scale_text(scale)} at batch_number={batch_number}, below "
            f"min_loss_scale={scale_text(self.min_loss_scale)}: gradients overflow however small the scale{where}. "
            f"{history.to_text()}",
            loss_scale=scale,
            min_loss_scale=self.min_loss_scale,
            scale_history=[(r.batch_number, r.optimizer_step, r.scale) for r in history.records],
            batch_number=batch_number,
            rank=rank,
            module_name=report.module_name,
            report=report.to_text(),
            optimizer_step=optimizer_step,
            epoch=epoch,
            phase="train",
        )
        return report, error

    def take_fatal(self) -> Report | None:
        """The overflow found fatal by `step_applying`, once."""
        fatal, self._fatal = self._fatal, None
        return fatal
