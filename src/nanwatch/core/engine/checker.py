"""The check: screen the pending frames with one host read, build a report when one holds inf/nan, keep the ring.

A check reads the device once (every abs max stacked per device and dtype, and every feature's flags, in one
transfer: core/stats/readback.py). Clean frames move into the ring, where they are the earlier frames of a later
report; a report ends at the first non-finite frame and goes back as far as `max_frames_to_save` allows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import filterfalse

from nanwatch.core.config import WatchConfig
from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.feature_set import FeatureSet
from nanwatch.core.engine.recording.deferred_frames import DeferredFrame
from nanwatch.core.engine.recording.recorder import Recorder
from nanwatch.core.feature_api import EngineContext, Feature
from nanwatch.core.frames import Frame, FrameRing, ResolvedFrame, resolve
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.stats.cache import StatsCache
from nanwatch.core.stats.readback import Folded, Screened, fold, read_flags, stack_maxima
from nanwatch.core.torch_glue.gcpause import resume_collection

__all__ = ["Checker"]

_is_deferred = DeferredFrame.__instancecheck__  # (no subclasses)


@dataclass(frozen=True, slots=True)
class Launched:
    """A check's first half: the frames it covers and what it looks at, folded on the device, not read yet.

    `taken`: the frames left the recorder at launch (the check concludes later, while new frames are recorded).
    `detecting`: how many of `folded`, first, hold only what detects inf/nan (the frames, detecting features)."""

    pending: list[Frame]
    folded: list[Folded[Feature | None]]
    taken: bool = False
    detecting: int = 0  # the first this many of `folded` hold what detects inf/nan (the rest: warnings only)


class Checker:
    """Checks what the recorder made, and keeps the last frames checked clean.

    Args:
        rank, world_size: what a report says of where it was made.
        disable: stops watching (the run goes on) after a failure in checking.
    """

    def __init__(
        self,
        config: WatchConfig,
        counters: Counters,
        recorder: Recorder,
        cache: StatsCache,
        features: FeatureSet,
        *,
        rank: int,
        world_size: int,
        disable: Callable[[str], None],
    ) -> None:
        self.ring = FrameRing(config.max_frames_to_save)
        self.batch_recorded = False  # a frame was recorded since the last training micro-batch ended
        self.frames_finite = True  # during a check's review: no frame of that check holds inf/nan
        self._config = config
        self._counters = counters
        self._recorder = recorder
        self._cache = cache
        self._features = features
        self._rank = rank
        self._world_size = world_size
        self._disable = disable
        # A detection found when a loop that never ends its batches let the pending frames pile up, checked early
        # (`check_early`): raised at the next check, where ranks can meet, rather than from inside a hook.
        self._found_early: Report | None = None
        self._context: list[Frame] | None = None  # while a check taken from the recorder concludes: its frames
        recorder.when_full = self.check_early  # a micro-batch too long to wait for its end

    @property
    def _ctx(self) -> EngineContext:
        return self._features.ctx

    def check_safely(self) -> Report | None:
        """The check, judged by the features; a failure in nanwatch itself disables watching instead of propagating."""
        found, self._found_early = self._found_early, None
        if found is not None:
            self._recorder.pending = []
            return found
        try:
            for feature in self._features:
                held = feature.held(self._ctx)
                if held is not None:
                    return held
            checked = self._recorder.pending
            report = self.check()
            for feature in self._features:
                if report is None:
                    break
                report = feature.judge(self._ctx, report, checked)
            return report
        except Exception as error:
            self._disable(f"checking the recorded frames failed: {error!r}")
            return None

    @property
    def found_early(self) -> bool:
        """A detection found by an early check waits for the next check."""
        return self._found_early is not None

    def conclude_safely(self, launched: Launched, values: Sequence[Sequence[float]] | None = None) -> Report | None:
        """`conclude`, judged by the features; a failure in nanwatch itself disables watching (`check_safely`)."""
        try:
            report = self.conclude(launched, values)
            for feature in self._features:
                if report is None:
                    break
                report = feature.judge(self._ctx, report, launched.pending)
            return report
        except Exception as error:
            self._disable(f"checking the recorded frames failed: {error!r}")
            return None

    def check(self) -> Report | None:
        """Look at the frames recorded since the last check (one host read per device); a report if any holds
        inf/nan. Clean frames move into the ring."""
        return self.conclude(self.launch())

    def launch(self, *, take: bool = False) -> Launched:
        """The first half of a check: everything it looks at, folded on the device (no host sync). `take`: the
        pending frames leave the recorder now (a check concluded later, once more work is queued)."""
        pending = self._recorder.pending
        self._recorder.judge_probes()
        if pending and not self.batch_recorded:
            self.batch_recorded = any(frame.module_name != "(loss)" for frame in pending)
        parts = self._parts(pending, features=True)
        # What detects (the frames, and features that report inf/nan) folded apart from what only warns (headroom,
        # spikes): a step decided on the device is skipped for the first, never for the second.
        # (Only for a check handed over: the host's check reads one fold.)
        if not take:
            return Launched(pending, fold(parts))
        detecting = fold([part for part in parts if part[1] is None or part[1].detects])
        warning = fold([part for part in parts if part[1] is not None and not part[1].detects])
        launched = Launched(pending, detecting + warning, taken=take, detecting=len(detecting))
        if take:
            self._recorder.pending = []
        return launched

    def conclude(self, launched: Launched, values: Sequence[Sequence[float]] | None = None) -> Report | None:
        """The second half: read the folded summaries (or take `values`, read already), review what tripped, commit
        the clean frames or report."""
        pending = launched.pending
        if values is None:
            values = [folded.summary.tolist() for folded in launched.folded]
        tripped = [
            owner for folded, read in zip(launched.folded, values, strict=True) for owner in folded.tripped(read)
        ]
        non_finite = None in tripped
        # Only a micro-batch whose forward was recorded can say its forward was finite (not one that
        # watch_every_n_batches or include_modules left unwatched, nor one whose hooks are gone).
        self.frames_finite = not non_finite and self.batch_recorded
        self._context = pending if launched.taken else None
        try:
            found = None
            for feature in dict.fromkeys(owner for owner in tripped if owner is not None):
                # A feature's own flag: it reads what it needs, warns, or reports (the guard).
                if non_finite and not feature.detects:
                    continue
                report = feature.review(self._ctx, pending)
                if report is not None:  # several findings: one report, every section
                    found = report if found is None else found.with_sections(report.sections)
            if not non_finite:
                self._commit(pending, taken=launched.taken)
                return found
            if not launched.taken:
                self._recorder.take_pending()
            self._cache.forget_activations()
            report = self.report_of(pending)
        finally:
            self._context = None
        if report is not None and found is not None:  # the frames lead; the features' findings come with them
            report = report.with_sections(found.sections)
        return report or found

    def check_early(self) -> None:
        """A micro-batch this long (a loop that never ends its batches): its frames go now, and so does the pause."""
        resume_collection()
        report = self.check()
        # Kept for the next check (raising here would skip the collective); the first detection is the one.
        if report is not None and self._found_early is None:
            self._found_early = report

    def screen(self, frames: Sequence[Frame], *, features: bool) -> tuple[bool, list[Feature]]:
        """Whether any float abs max in `frames` is inf/nan, and which features' flags tripped: one read per device."""
        tripped = read_flags(self._parts(frames, features=features))
        return None in tripped, [owner for owner in tripped if owner is not None]

    def _parts(self, frames: Sequence[Frame], *, features: bool) -> list[tuple[Screened, Feature | None]]:
        """What a check looks at: the frames' float abs maxima (owner None) and each feature's own parts."""
        settled = self._recorder.settled if frames is self._recorder.pending else None
        if settled is not None and settled.stacks:
            # The frames made from deferred calls are not read line by line: their outputs' stacks whole, their
            # parameters and inputs once (core/engine/recording/deferral.py).
            measurements = [
                entry.measurement
                for frame in filterfalse(_is_deferred, frames)  # the frames recorded as they returned (few), found in C
                for entry in frame.entries
                if entry.measurement
            ]
            whole, deferred = settled.reads()
            maxima = stack_maxima(measurements + deferred, whole)
        else:
            maxima = stack_maxima(entry.measurement for frame in frames for entry in frame.entries if entry.measurement)
        parts: list[tuple[Screened, Feature | None]] = [(stacked, None) for stacked in maxima.values()]
        for feature in self._features if features else ():
            parts += [(part, feature) for part in feature.screen(self._ctx, frames, maxima)]
        return parts

    def report_of(self, frames: Sequence[Frame]) -> Report | None:
        """The report of `frames` (read back), ending at the first non-finite frame, earlier frames from the ring."""
        resolved = resolve(frames)
        first = next((index for index, frame in enumerate(resolved) if frame.non_finite), None)
        if first is None:
            return None
        size = self._config.max_frames_to_save
        earlier = resolve(self.ring.last(size - (first + 1)))
        first_frame = frames[first]
        report = self._report(
            first_frame.batch_number,
            first_frame.phase,
            first_frame.module_name,
            earlier + resolved[max(0, first + 1 - size) : first + 1],
        )
        for feature in self._features:
            report = feature.annotate(self._ctx, report, resolved, first)
        return report

    def detection_report(self, section: ReportSection, module_name: str | None) -> Report:
        """A detection a feature made from its own flags: the latest frames for context, and the feature's section."""
        # A check concluded a step late: its own frames, not those recorded since.
        latest = self._recorder.pending if self._context is None else self._context
        frames = (self.ring.frames() + latest)[-self._config.max_frames_to_save :]
        counters = self._counters
        return self._report(counters.last_batch, counters.phase, module_name, resolve(frames), (section,))

    def _report(
        self,
        batch_number: int,
        phase: str,
        module_name: str | None,
        frames: Sequence[ResolvedFrame],
        sections: tuple[ReportSection, ...] = (),
    ) -> Report:
        return Report(
            batch_number=batch_number,
            phase=phase,
            rank=self._rank,
            world_size=self._world_size,
            module_name=module_name,
            frames=frames,
            optimizer_step=self._counters.optimizer_step,
            epoch=self._counters.epoch,
            sections=sections,
        )

    def _commit(self, frames: list[Frame], *, taken: bool = False) -> None:
        self.ring.extend(frames)
        self._features.dispatch("on_commit", frames)  # references only
        if not taken:
            self._recorder.pending = []
            self._cache.forget_activations()
