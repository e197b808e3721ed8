"""What a watcher offers to read: its counters, its state, what its features offer, its recent frames.

`WatcherReads` is the reading half of the facade (core/watcher.py), kept apart from the half that acts: each member
reads one of the parts (the counters are handed out whole, typed read-only as `RunCounters`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from nanwatch.core.engine.checker import Checker
from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.feature_set import FeatureSet
from nanwatch.core.engine.recording.recorder import Recorder
from nanwatch.core.feature_api import Feature, RunCounters
from nanwatch.core.frames import Frame
from nanwatch.core.readouts import LOSS_SCALE_HISTORY, SUMMARY, LossScaleHistory, Readout, Summary
from nanwatch.core.report import Report
from nanwatch.core.torch_glue.hooks import HookSet

__all__ = ["WatcherReads"]

_F = TypeVar("_F", bound=Feature)
_T = TypeVar("_T")


class WatcherReads:
    """The facade's read-only members (core/contract.py declares which of them adapters may use)."""

    _counters: Counters
    _recorder: Recorder
    _checker: Checker
    _features: FeatureSet
    _hooks: HookSet
    _guarded: bool
    _guarded_optimizers: weakref.WeakSet[torch.optim.Optimizer]
    _disabled_reason: str | None

    @property
    def counters(self) -> RunCounters:
        """Where the run is: the phase and the micro-batch, optimizer-step and epoch counters (read-only)."""
        return self._counters

    @property
    def recording(self) -> bool:
        """Whether the current micro-batch is recorded."""
        return self._recorder.recording

    @property
    def tracing(self) -> bool:
        """Whether the current batch is traced (`trace_batch_nums`, `trace_ranks`)."""
        return self._recorder.tracing

    @property
    def attached(self) -> bool:
        return len(self._hooks) > 0

    @property
    def hooks(self) -> HookSet:
        """The handles of every hook this watcher owns; adapters add theirs here so `close()` removes them too."""
        return self._hooks

    def guards(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether an adapter checks before each step of `optimizer` (reported at the "guarded" stage)."""
        return optimizer in self._guarded_optimizers

    @property
    def guarded(self) -> bool:
        """Whether an adapter checks before each optimizer step (a detection may be held until then)."""
        return self._guarded

    @property
    def disabled_reason(self) -> str | None:
        """Why watching stopped after an internal failure, or None while it works."""
        return self._disabled_reason

    def read(self, readout: Readout[Callable[[], _T]]) -> _T | None:
        """What a feature offers (core/readouts.py: `SUMMARY`, `LOSS_SCALE_HISTORY`), or None where none does."""
        return self._features.read(readout)

    def summary(self) -> Summary | None:
        """Abs max per watched module in the last training batch checked clean (reads its numbers back), or None."""
        return self.read(SUMMARY)

    def loss_scale_history(self) -> LossScaleHistory | None:
        """The loss scale's history under a GradScaler (`watch_scaler`), or None without one."""
        return self.read(LOSS_SCALE_HISTORY)

    def feature(self, kind: type[_F]) -> _F | None:
        """The feature of class `kind` this watcher runs, or None where the config leaves it out."""
        return self._features.find(kind)

    def recent_frames(self) -> list[Frame]:
        """The ring's frames followed by those not yet checked (for tests and tools)."""
        return self._checker.ring.frames() + list(self._recorder.pending)

    def check(self) -> Report | None:
        """Check the pending frames on this rank alone (one host read); a report if they hold inf/nan."""
        return self._checker.check_safely()
