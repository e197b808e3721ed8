"""The one place tests reach inside a `Watcher`: what no public member offers, named for what a test needs.

Each helper says which part of the engine (core/engine/) it reaches into, so a change there has one place to
follow here, not a dozen tests.
"""

from __future__ import annotations

from typing import Any

from nanwatch.core.distributed.board import DetectionBoard
from nanwatch.core.engine.recording.deferred_frames import DeferredFrame
from nanwatch.core.features.headroom import HeadroomMonitor
from nanwatch.core.features.loss_scale import LossScaleFeature, LossScaleMonitor
from nanwatch.core.features.summary import SummaryFeature
from nanwatch.core.report import Report
from nanwatch.core.stats.compiled import frame_key, record_call
from nanwatch.core.watcher import Watcher

__all__ = [
    "deferred_calls",
    "fail_internally",
    "headroom",
    "held_frame_counts",
    "loss_scale",
    "publish",
    "record_as_compiled",
    "use_board",
]


def loss_scale(watcher: Watcher) -> LossScaleMonitor | None:
    """The GradScaler follower (its `history()`, `overflows`), or None before a scaler was handed over."""
    feature = watcher.feature(LossScaleFeature)
    return None if feature is None else feature.monitor


def headroom(watcher: Watcher) -> HeadroomMonitor | None:
    """The headroom feature where it is on (its findings, `warned`, `summary()`), else None."""
    found = watcher.feature(HeadroomMonitor)
    return found if found is not None and found.active else None


def held_frame_counts(watcher: Watcher) -> tuple[int, int, int]:
    """How many frames the watcher holds: pending (recorder), in the ring (checker), kept for a summary."""
    summary = watcher.feature(SummaryFeature)
    assert summary is not None
    return len(watcher._recorder.pending), len(watcher._checker.ring), len(summary._frames)


def deferred_calls(watcher: Watcher) -> int:
    """How many calls of the micro-batch in progress were deferred (engine/recording/deferral.py), read before anything
    reads the pending frames (which makes their frames)."""
    deferral = watcher._recorder._deferral
    return sum(
        1
        for frame in watcher._recorder.unsettled
        if type(frame) is DeferredFrame and frame.outputs is deferral._outputs  # this round's, not yet measured
    )


def use_board(watcher: Watcher, board: DetectionBoard) -> None:
    """Have the arbiter settle through `board` (a real store in tests that run ranks as threads)."""
    watcher._arbiter._board = board


def publish(watcher: Watcher, report: Report) -> None:
    """Publish `report` as a detection would (log, report_dir, the features' `on_publish`)."""
    watcher._publisher.publish(report)


def fail_internally(watcher: Watcher, reason: str) -> None:
    """What the engine does when its own bookkeeping fails: stop watching, warn, and let the run go on."""
    watcher.disable(reason)


def record_as_compiled(
    watcher: Watcher, name: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    """Record one call of watched module `name` as a hook traced by torch.compile records it (core/stats/compiled.py's
    `record_call`, run eagerly: its operator hands the numbers to the recorder as a compiled graph's call would)."""
    recorder = watcher._recorder
    prefix = frame_key(recorder.sink.token, name, type(module).__name__)
    record_call(prefix, module, args, kwargs, output, ())
