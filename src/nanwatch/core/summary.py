"""Summary mode: the abs max of every watched module in the last watched training batch, for a framework's logger.

The watcher hands every batch of frames it checked clean to a `SummaryCollector`, which keeps references to those
of the latest training batch (no copy, no device work). Only when a summary is asked for are their numbers read back,
in one transfer per device and dtype, so summary mode costs nothing per batch. Adapters only forward
`Summary.metrics()` to their framework (Lightning loggers, Accelerate trackers, the HF Trainer's logs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from nanwatch.core.frames import Frame, resolve
from nanwatch.core.gradients import GRAD_PREFIX
from nanwatch.core.scope import ROOT_NAME

__all__ = ["Summary", "SummaryCollector", "METRIC_PREFIX", "ABSMAX_PREFIX", "GLOBAL_KEY", "BATCH_KEY"]

METRIC_PREFIX = "nanwatch"
ABSMAX_PREFIX = f"{METRIC_PREFIX}/absmax/"
GLOBAL_KEY = f"{METRIC_PREFIX}/absmax_global"
BATCH_KEY = f"{METRIC_PREFIX}/batch_number"
# The text form lists this many modules, the largest first; the metrics hold all of them.
_TEXT_TOP = 10


@dataclass(frozen=True)
class Summary:
    """Per-module abs max over the float forward tensors (parameters, inputs, outputs) of one training batch.

    Attributes:
        batch_number: the watched training batch the numbers come from.
        absmax: module name -> the largest abs max among its float tensors in that batch (over all its calls), in
            the order the modules were first called. Modules that saw no float tensor are left out.
        class_names: module name -> its class name.
    """

    batch_number: int
    absmax: dict[str, float]
    class_names: dict[str, str] = field(default_factory=dict)

    @property
    def max_module(self) -> str | None:
        """The module holding the largest abs max (the first one on a tie), or None when the summary is empty."""
        if not self.absmax:
            return None
        return max(self.absmax, key=lambda name: _order_key(self.absmax[name]))

    @property
    def max_value(self) -> float | None:
        module = self.max_module
        return None if module is None else self.absmax[module]

    def metrics(self) -> dict[str, float]:
        """Flat numeric metrics for a framework logger: `nanwatch/absmax/<module>` for every module, then
        `nanwatch/absmax_global` (the largest of them) and `nanwatch/batch_number`. The root module is `(root)`."""
        values = {ABSMAX_PREFIX + (name or ROOT_NAME): value for name, value in self.absmax.items()}
        if self.max_value is not None:
            values[GLOBAL_KEY] = self.max_value
        values[BATCH_KEY] = float(self.batch_number)
        return values

    def to_text(self, top: int = _TEXT_TOP) -> str:
        """A few lines for a log: the largest abs max and where, then the `top` largest modules."""
        module = self.max_module
        if module is None:
            return f"nanwatch summary of batch_number={self.batch_number}: no float tensor was recorded"
        ranked = sorted(self.absmax, key=lambda name: _order_key(self.absmax[name]), reverse=True)[:top]
        lines = [
            f"nanwatch summary of batch_number={self.batch_number}: largest abs max {self.absmax[module]:.2e} in "
            f"{module or ROOT_NAME} ({self.class_names.get(module, '?')}); {len(self.absmax)} modules, largest first:"
        ]
        lines += [
            f"{self.absmax[name]:8.2e} {name or ROOT_NAME} {self.class_names.get(name, '')}".rstrip() for name in ranked
        ]
        return "\n".join(lines)


def _order_key(value: float) -> float:
    # nan sorts above everything, so a summary never hides it behind a finite maximum.
    return math.inf if math.isnan(value) else value


class SummaryCollector:
    """Keeps the frames of the latest training batch that was checked clean, and summarises them on request."""

    def __init__(self, every: int | None) -> None:
        self.every = every
        self._frames: list[Frame] = []
        self._batch = -1
        self._sent_batch: int | None = None

    def collect(self, frames: Sequence[Frame]) -> None:
        """Remember `frames` (just checked clean) if they belong to the latest training batch; references only."""
        if not frames:
            return
        first, last = frames[0], frames[-1]
        if first.phase == last.phase == "train" and first.batch_number == last.batch_number:
            self._take(first.batch_number, frames)  # the usual case: one batch, one chunk
            return
        for frame in frames:
            if frame.phase == "train":
                self._take(frame.batch_number, (frame,))

    def _take(self, batch_number: int, frames: Sequence[Frame]) -> None:
        if batch_number > self._batch:
            self._frames = []
            self._batch = batch_number
        if batch_number == self._batch:
            self._frames.extend(frames)

    @property
    def batch_number(self) -> int | None:
        """The training batch whose frames are held, or None before any."""
        return self._batch if self._frames else None

    def summary(self) -> Summary | None:
        """The summary of the latest training batch checked clean (reads its numbers back), or None before any."""
        if not self._frames:
            return None
        absmax: dict[str, float] = {}
        class_names: dict[str, str] = {}
        for frame in resolve(self._frames):
            for entry in frame.entries:
                # Floats only: token ids and masks are integers whose magnitudes say nothing about overflow. Forward
                # tensors only: gradient lines (watch_gradients) of a batch are checked at different points in each
                # adapter, and their scale is not the activations'.
                if not isinstance(entry.abs_max, float) or entry.label.startswith(GRAD_PREFIX):
                    continue
                seen = absmax.get(frame.module_name)
                if seen is None or _order_key(entry.abs_max) > _order_key(seen):
                    absmax[frame.module_name] = entry.abs_max
                    class_names[frame.module_name] = frame.class_name
        return Summary(self._batch, absmax, class_names)

    def due(self, batches_done: int) -> Summary | None:
        """The summary to send now that `batches_done` training batches have ended, or None.

        One is due every `every` batches, and only if a training batch was checked since the last one sent (an
        unwatched stretch sends nothing rather than the same numbers again).
        """
        if self.every is None or batches_done % self.every or self.batch_number is None:
            return None
        if self._sent_batch == self._batch:
            return None
        summary = self.summary()
        self._sent_batch = self._batch
        return summary
