"""Summary mode: the abs max of every watched module in the last watched training batch, for a framework's logger.

The engine hands every batch of frames it checked clean to this feature (`on_commit`), which keeps references to
those of the latest training batch (no copy, no device work). Only when a summary is asked for are their numbers
read back, in one transfer per device and dtype, so summary mode costs nothing per batch. Adapters only forward
`Summary.metrics()` to their framework (Lightning loggers, Accelerate trackers, the HF Trainer's logs).

What a module's summary holds comes from the statistics registry: each statistic with a `summary_metric` gives the
largest of its `summary_value` over the module's forward lines (abs max: `nanwatch/absmax/<module>`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nanwatch.core.feature_api import EngineContext, Feature, Phase
from nanwatch.core.frames import Direction, Frame, resolve
from nanwatch.core.readouts import (
    ABSMAX_PREFIX,
    BATCH_KEY,
    GLOBAL_KEY,
    METRIC_PREFIX,
    SUMMARY,
    Readout,
    Summary,
    order_key,
)
from nanwatch.core.stats import registry

__all__ = ["Summary", "SummaryFeature", "METRIC_PREFIX", "ABSMAX_PREFIX", "GLOBAL_KEY", "BATCH_KEY"]

# Frames of one batch held for its summary before they are folded into numbers (a few MB of references).
_MAX_HELD = 8192


def _merge(first: Summary | None, second: Summary) -> Summary:
    """The summary of both: per module, the larger value (nan first), and the first class name seen."""
    if first is None:
        return second

    def larger(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        merged = dict(a)
        for name, value in b.items():
            merged[name] = max(merged.get(name, value), value, key=order_key)
        return merged

    others = {metric: larger(first.others.get(metric, {}), values) for metric, values in second.others.items()}
    return Summary(
        second.batch_number,
        larger(first.absmax, second.absmax),
        {**second.class_names, **first.class_names},
        {**first.others, **others},
    )


class SummaryFeature(Feature):
    """Keeps the frames of the latest training batch that was checked clean, and summarises them on request.

    Args:
        every: send a summary every this many training batches (`summary_every_n_batches`); None: only on request.
    """

    name = "summary"

    def __init__(self, every: int | None) -> None:
        self.every = every
        self._frames: list[Frame] = []
        # Past `_MAX_HELD` frames of one batch (a loop that never ends its batches), the held frames are read back
        # and folded into these numbers, so memory stays bounded whatever the loop does.
        self._folded: Summary | None = None
        self._batch = -1
        self._sent_batch: int | None = None

    def readouts(self) -> Mapping[Readout[Any], Callable[[], Any]]:
        return {SUMMARY: self.summary}

    def on_commit(self, ctx: EngineContext, frames: Sequence[Frame]) -> None:
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
            self._frames, self._folded = [], None
            self._batch = batch_number
        if batch_number == self._batch:
            self._frames.extend(frames)
            if len(self._frames) > _MAX_HELD:
                self._folded = _merge(self._folded, self._summarise(self._frames))
                self._frames = []

    @property
    def batch_number(self) -> int | None:
        """The training batch whose frames are held, or None before any."""
        return self._batch if self._frames or self._folded is not None else None

    def summary(self) -> Summary | None:
        """The summary of the latest training batch checked clean (reads its numbers back), or None before any."""
        if self.batch_number is None:
            return None
        return _merge(self._folded, self._summarise(self._frames))

    def _summarise(self, frames: Sequence[Frame]) -> Summary:
        lead = registry.lead()
        others = [s for s in registry.extras() if s.summary_metric is not None]
        absmax: dict[str, float] = {}
        class_names: dict[str, str] = {}
        other_values: dict[str, dict[str, float]] = {}
        for frame in resolve(frames):
            # Forward lines only: gradient lines (watch_gradients) of a batch are checked at different points in each
            # adapter, and their scale is not the activations'.
            if frame.direction is not Direction.FORWARD:
                continue
            for entry in frame.entries:
                value = lead.summary_value(entry.range)
                if value is not None:
                    seen = absmax.get(frame.module_name)
                    if seen is None or order_key(value) > order_key(seen):
                        absmax[frame.module_name] = value
                        class_names[frame.module_name] = frame.class_name
                for statistic in others:
                    extra = statistic.summary_value(entry.stats.get(statistic.name))
                    if extra is not None:
                        modules = other_values.setdefault(str(statistic.summary_metric), {})
                        modules[frame.module_name] = max(modules.get(frame.module_name, extra), extra, key=order_key)
        return Summary(self._batch, absmax, class_names, other_values)

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

    def on_batch_end(self, ctx: EngineContext, phase: Phase, batch_number: int) -> None:
        sink = ctx.summary_sink  # the logger by default; adapters send it to their framework (or nowhere)
        if phase != "train" or sink is None or self.every is None:
            return
        try:
            summary = self.due(batch_number + 1)
            if summary is not None:
                sink(summary)
        except Exception as error:  # a logger that fails must not kill a healthy run
            ctx.logger.warning(f"nanwatch could not send its summary (the run goes on): {error!r}")
