"""What an engine offers to read: its counters, its state, what its features offer, its recent frames.

`Readings` is the reading half of the facade (core/watcher.py), kept apart from the half that acts; most of it is
one of the parts' attributes, handed out as it is (`PartAttribute`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

import torch

from nanwatch.core.engine.checker import Checker
from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.feature_set import FeatureSet
from nanwatch.core.engine.recording.recorder import Recorder
from nanwatch.core.feature_api import Feature, Phase
from nanwatch.core.frames import Frame
from nanwatch.core.readouts import LOSS_SCALE_HISTORY, SUMMARY, LossScaleHistory, Readout, Summary
from nanwatch.core.report import Report
from nanwatch.core.torch_glue.hooks import HookSet

__all__ = ["PartAttribute", "Readings"]

_F = TypeVar("_F", bound=Feature)
_T = TypeVar("_T")


class PartAttribute(Generic[_T]):
    """A read-only attribute of the facade that one of its parts holds (`watcher.phase` is the counters' `phase`)."""

    def __init__(self, part: str, doc: str | None = None) -> None:
        self.part, self.__doc__ = part, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, facade: None, owner: type) -> PartAttribute[_T]: ...
    @overload
    def __get__(self, facade: object, owner: type) -> _T: ...
    def __get__(self, facade: object, owner: type) -> Any:
        return self if facade is None else getattr(getattr(facade, self.part), self.name)


class Readings:
    """The facade's read-only members (core/contract.py declares which of them adapters may use)."""

    _counters: Counters
    _recorder: Recorder
    _checker: Checker
    _features: FeatureSet
    _hooks: HookSet
    _guarded: bool
    _guarded_optimizers: weakref.WeakSet[torch.optim.Optimizer]
    _disabled_reason: str | None

    phase = PartAttribute[Phase]("_counters")
    batch_number = PartAttribute[int]("_counters", "The current (or next) training micro-batch.")
    eval_batch_number = PartAttribute[int]("_counters")
    optimizer_step = PartAttribute["int | None"]("_counters")
    epoch = PartAttribute["int | None"]("_counters")
    current_batch = PartAttribute[int]("_counters", "The current micro-batch of the current phase.")
    recording = PartAttribute[bool]("_recorder", "Whether the current micro-batch is recorded.")
    tracing = PartAttribute[bool](
        "_recorder", "Whether the current batch is traced (`trace_batch_nums`, `trace_ranks`)."
    )

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
