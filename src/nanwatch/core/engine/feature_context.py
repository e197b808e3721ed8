"""The `EngineContext` features get (core/feature_api.py): a narrow view of one engine, read through its parts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.engine.checker import Checker
from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.feature_set import FeatureSet
from nanwatch.core.engine.publisher import Publisher
from nanwatch.core.engine.recording.recorder import Recorder
from nanwatch.core.feature_api import Phase
from nanwatch.core.frames import Frame, ResolvedFrame
from nanwatch.core.readouts import Readout, Summary
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.scope import BatchSchedule, rank_in
from nanwatch.core.stats.cache import StatsCache
from nanwatch.core.stats.measure import Measurement
from nanwatch.core.torch_glue.hooks import HookSet

__all__ = ["EngineView", "Facade", "Fixed"]


class Fixed(NamedTuple):
    """What stays the same for the whole run."""

    config: WatchConfig
    rank: int
    world_size: int
    logger: logging.Logger
    hooks: HookSet


class Facade(Protocol):
    """What the view reads of the facade itself (core/watcher.py) rather than of a part: what changes as it runs."""

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def entry(self) -> torch.nn.Module: ...
    @property
    def guarded(self) -> bool: ...
    @property
    def decided_on_device(self) -> bool: ...
    @property
    def disabled_reason(self) -> str | None: ...
    @property
    def summary_sink(self) -> Callable[[Summary], None] | None: ...
    def rerun(
        self,
        run: Callable[[], Any],
        *,
        batch_number: int,
        phase: Phase,
        gradients: bool,
        frames: list[ResolvedFrame] | None = None,
    ) -> Report | None: ...
    def disable(self, reason: str) -> None: ...


class EngineView:
    """Implements `EngineContext` over the facade and the parts it wires."""

    def __init__(
        self,
        facade: Facade,
        fixed: Fixed,
        counters: Counters,
        recorder: Recorder,
        checker: Checker,
        publisher: Publisher,
        features: FeatureSet,
        cache: StatsCache,
        schedule: BatchSchedule,
    ) -> None:
        self._facade = facade
        self.config, self.rank, self.world_size = fixed.config, fixed.rank, fixed.world_size
        self.logger, self.hooks = fixed.logger, fixed.hooks
        self._counters = counters
        self._recorder = recorder
        self._checker = checker
        self._publisher = publisher
        self._features = features
        self._cache = cache
        self._schedule = schedule

    # What the facade holds.
    model = property(lambda self: self._facade.model)
    entry = property(lambda self: self._facade.entry)
    guarded = property(lambda self: self._facade.guarded)
    decided_on_device = property(lambda self: self._facade.decided_on_device)
    disabled_reason = property(lambda self: self._facade.disabled_reason)
    summary_sink = property(lambda self: self._facade.summary_sink)
    # What the parts hold.
    counters = property(lambda self: self._counters)
    recording = property(lambda self: self._recorder.recording)
    tracing = property(lambda self: self._recorder.tracing)
    frames_finite = property(lambda self: self._checker.frames_finite)

    def rank_logs(self, ranks: Literal["zero", "all"] | list[int]) -> bool:
        return rank_in(self.rank, ranks)

    def read(self, readout: Readout[Callable[[], Any]]) -> Any:
        return self._features.read(readout)

    def watches_batch(self, batch_number: int) -> bool:
        return self._schedule.watched(batch_number)

    def weights_changed(self) -> bool:
        measured = self._cache.measured_batch
        return measured is not None and not self._cache.unchanged(measured)

    def measure(self, tensor: torch.Tensor) -> Measurement:
        return self._cache.measure(tensor)

    def add_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        self._recorder.append(frame, module)

    def trace_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        if self._recorder.tracing:
            self._features.dispatch("on_frame", frame, module, (), None)

    def is_last_pending(self, frame: Frame) -> bool:
        return self._recorder.is_last(frame)

    def detection_report(self, section: ReportSection, module_name: str | None) -> Report:
        return self._checker.detection_report(section, module_name)

    def rerun(
        self,
        run: Callable[[], Any],
        *,
        batch_number: int,
        phase: Phase,
        gradients: bool,
        frames: list[ResolvedFrame] | None = None,
    ) -> Report | None:
        return self._facade.rerun(run, batch_number=batch_number, phase=phase, gradients=gradients, frames=frames)

    def report_for(self, frames: Sequence[Frame]) -> Report | None:
        checker = self._checker
        return checker.report_of(frames) if checker.screen(frames, features=False)[0] else None

    def keep_as_context(self, frames: Iterable[Frame]) -> None:
        self._checker.ring.extend(frames)

    def publish(self, report: Report) -> None:
        self._publisher.publish(report)

    def disable(self, reason: str) -> None:
        self._facade.disable(reason)
