"""The engine's facade: wires the parts of core/engine/ together and implements the adapter contract.

Adapters (the plain loop, Lightning, Accelerate, the HF Trainer) call the members declared in core/contract.py: they
say when a micro-batch starts and ends, where the optimizer step is, and hand over the loss and the loss scaler.
Where each thing happens:

- core/engine/recorder.py: the hooks, the frames they make (eager and compiled), the pending frames;
- core/engine/counters.py: the phase and the counters (batch numbers, optimizer step, epoch);
- core/engine/checker.py: the check (one host read), the reports, the ring of earlier frames;
- core/engine/arbiter.py: a detection from found to held to agreed across ranks to raised;
- core/engine/publisher.py: the report into the log and onto disk;
- core/engine/plugins.py: the features (core/features/), which plug into the events of core/events.py.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from nanwatch.core.compiler import (
    compiled_anything,
    forget_compiled_code,
    run_outside_dynamo,
    with_compiled_code,
    without_compile_wrappers,
)
from nanwatch.core.config import WatchConfig
from nanwatch.core.contract import AdapterContract
from nanwatch.core.engine.arbiter import Arbiter
from nanwatch.core.engine.checker import Checker
from nanwatch.core.engine.counters import PHASES, Counters
from nanwatch.core.engine.plugins import FeatureSet
from nanwatch.core.engine.publisher import Publisher
from nanwatch.core.engine.recorder import Recorder, hook_code, own_code
from nanwatch.core.events import KEEP, Feature, Kept, OptimizerStage, Phase
from nanwatch.core.features import features_for
from nanwatch.core.formats.files import prepare_report_dir
from nanwatch.core.frames import Entry, Frame, Role
from nanwatch.core.gcpause import pause_collection, resume_collection
from nanwatch.core.hooks import HookSet, module_class_name, named_unique_modules, reshards_after_forward
from nanwatch.core.log import get_logger, warn
from nanwatch.core.ranks import Detection, DetectionBoard, world_size_and_rank
from nanwatch.core.readouts import SUMMARY, GradScalerLike, Readout, Summary
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.scope import BatchSchedule, select_modules
from nanwatch.core.stats.measure import Measurement, StatsCache, extra_kernels
from nanwatch.errors import BatchLimitReached

__all__ = ["KEEP", "PHASES", "Watcher"]

_F = TypeVar("_F", bound=Feature)
_T = TypeVar("_T")


class Watcher:
    """Records what every module of `model` sees and finds the first inf/nan.

    Args:
        model: the module whose submodules are watched (every one, the root included).
        config: what to watch and report.
        rank: this process's rank; found from torch.distributed when None.
        world_size: the number of processes; found from torch.distributed when None.
        entry: the module the user calls, when it wraps `model` (DDP, torch.compile); `model` when None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: WatchConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        entry: torch.nn.Module | None = None,
    ) -> None:
        found_world_size, found_rank = world_size_and_rank()
        # Held while watching, and only weakly once closed (`close()`): a closed watcher keeps no tensor of the model
        # alive (a notebook that deletes the model gets its memory back while the handle lives on).
        self._model: torch.nn.Module | None = model
        self._model_ref = weakref.ref(model)
        self._entry: torch.nn.Module | None = None
        self._entry_ref = self._model_ref
        self.entry = model if entry is None else entry
        self.config = config
        self.rank = found_rank if rank is None else rank
        self.world_size = found_world_size if world_size is None else world_size
        self.logger: logging.Logger = get_logger()
        # Where a due summary goes: the logger by default; adapters send it to their framework (or nowhere: None).
        self.summary_sink: Callable[[Summary], None] | None = self._log_summary
        self._disabled_reason: str | None = None
        self._told_nothing_recorded = False
        self._hooked = False  # module hooks were attached once (full mode), whether or not they are still there
        self._guarded = False  # an adapter checks before each optimizer step
        self._guarded_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._last_loss: weakref.ref[torch.Tensor] | None = None
        self._replaying = False  # a watch of its own over a replay (`_rerun`)
        self._hooks = HookSet()
        self._schedule = BatchSchedule(config)
        self._cache = StatsCache(extra_kernels(config))
        self._counters = Counters(self.logger)
        self._features = FeatureSet(features_for(config), self._disable)
        self._recorder = Recorder(
            self._counters,
            self._cache,
            show_recomputes=config.watch_gradients,
            trace=lambda frame, module, args, output: self._features.dispatch("on_frame", frame, module, args, output),
            overflow=lambda: self._checker.check_early(),
            disable=self._disable,
        )
        self._checker = Checker(
            config,
            self._counters,
            self._recorder,
            self._cache,
            self._features,
            rank=self.rank,
            world_size=self.world_size,
            disable=self._disable,
        )
        self._publisher = Publisher(config, self.logger, self._schedule, self._features, self._disable)
        board = DetectionBoard.for_this_run(self.rank, self.world_size, config.rank_wait_s)
        self._arbiter = Arbiter(
            board,
            self._publisher,
            self._counters,
            self.logger,
            rank=self.rank,
            world_size=self.world_size,
            on_raise=self._micro_batch_raised,
        )
        self._features.ctx = _Context(self)
        self._update_recording()

    # ------------------------------------------------------------------------------------ the adapter contract

    def attach(self, modules: Iterable[tuple[str, torch.nn.Module]] | None = None) -> None:
        """Put a forward hook on every module (or on the given `(name, module)` pairs) that the config's scope keeps.

        Raises:
            ConfigError: an `include_modules`/`exclude_modules` pattern matches none of the modules, or together
                they leave none; no hook is added then.
        """
        if len(self._hooks):
            raise RuntimeError("nanwatch: hooks are already attached; call close() first")
        self._model, self._entry = self.model, self.entry  # held again, if this watcher was closed before
        if self.config.report_dir is not None:
            prepare_report_dir(self.config.report_dir)  # a bad one is an error now, not a lost report later
        candidates = modules if modules is not None else named_unique_modules(self.model)
        # Scope is decided here, once: a module left out gets no hook and costs nothing. A torch.compile wrapper inside
        # the model adds no frame, and `_orig_mod` no part to the names.
        selected = select_modules(
            without_compile_wrappers(candidates), self.config.include_modules, self.config.exclude_modules
        )
        if self.config.mode == "full":  # sentinel mode: no per-module hook (core/features/sentinel.py)
            self._hook_modules(selected)
        for feature in self._features:  # after the frame hooks: their hooks run once a frame is recorded
            feature.attach(self._features.ctx, selected)  # type: ignore[arg-type]

    def _hook_modules(self, selected: list[tuple[str, torch.nn.Module]]) -> None:
        recorder = self._recorder
        for name, module in selected:
            # On a module FSDP2 manages, before FSDP's own forward hook frees the gathered parameters; keyword inputs
            # are inputs too (`model(**batch)`).
            hook = recorder.make_hook(name, module_class_name(module))
            handle = module.register_forward_hook(hook, with_kwargs=True, prepend=reshards_after_forward(module))
            self._hooks.add_handle(handle)
            recorder.modules.setdefault(name, module)
        # Measured together once per batch, rather than one launch per parameter (StatsCache).
        self._cache.track_parameters(p for _, m in selected for p in m._parameters.values() if p is not None)
        if not self._replaying:  # a replay runs the model eagerly: its compiled code is not in the way
            recorder.forget_stale_compiled_code([module for _, module in selected], self.logger.info, warn)
        self._hooked = bool(selected)

    def close(self, *, check: bool = True, raise_detection: bool = False) -> Report | None:
        """Stop watching: check what is still pending (no collective), remove every hook, let features sum up.

        Args:
            check: check the pending frames first, and publish a report if they hold inf/nan.
            raise_detection: then raise `NonFiniteError` for that report (on this rank).

        Returns:
            The report published at close, or None.
        """
        report = None
        try:
            if check and self._disabled_reason is None:
                report = self._checker.check_safely()
                if report is not None:
                    self._publisher.publish(report)
        finally:
            resume_collection()
            self._hooks.remove_all()
            # The root's hooks run in frames dynamo compiles on their own, which hold this watcher: let them go.
            forget_compiled_code(with_compiled_code(own_code()))
            self._cache.clear()
            ctx = self._features.ctx
            for feature in self._features:
                self._features.safely(f"closing {feature.name}", feature.detach, ctx)
                self._features.safely(f"closing {feature.name}", feature.close, ctx)
        try:
            held = self._arbiter.release()  # held for a step that never came
            report = report if report is not None else held
            if report is not None and raise_detection:
                self._arbiter.raise_error(report, _detection_of(report, self.rank))
        finally:
            self._let_go()
        return report

    def _let_go(self) -> None:
        """Closed: hold nothing of the model any more (the modules, the compiled path's adapter hooks, the cache's
        tracked parameters and staging buffers; each feature dropped its own in `close`), only what a user may still
        read (the counters, the ring's frames, the reports, the summary's numbers)."""
        self._model = self._entry = None
        self._recorder.close()
        self._cache.clear()

    @property
    def model(self) -> torch.nn.Module:
        """The watched model. Once closed, held weakly: `ReferenceError` when nothing else keeps it alive."""
        return _held(self._model, self._model_ref, "model")

    @property
    def entry(self) -> torch.nn.Module:
        """The module the user calls, when it wraps `model` (DDP, torch.compile): sentinel mode hooks it there,
        outside the wrapper's own machinery (a compiled graph), and runs `model` itself to replay. Once closed, held
        weakly (as `model`)."""
        return _held(self._entry, self._entry_ref, "entry module")

    @entry.setter
    def entry(self, module: torch.nn.Module) -> None:
        self._entry, self._entry_ref = module, weakref.ref(module)

    def set_phase(self, phase: Phase) -> None:
        """The forwards that follow belong to `phase` ("train": counted as `batch_number`; "eval": counted apart,
        watched only with `watch_eval`), in the micro-batch already open (evaluation in the middle of a training
        micro-batch, and back)."""
        if phase not in PHASES:
            raise ValueError(f"phase can be one of {PHASES}, got {phase!r}")
        counters = self._counters
        if phase != counters.phase:
            # Weights are often swapped through `.data` around evaluation (EMA), which no version counter shows.
            self._cache.forget_parameters()
            counters.phase = phase
            self._update_recording()

    def start_batch(self, phase: Phase, *, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """A micro-batch of `phase` starts (or goes on: idempotent within a micro-batch); the forwards that follow
        belong to it. Raises when another rank stopped: this rank stops too, before its next forward."""
        self.set_phase(phase)
        self._counters.set(optimizer_step, epoch)
        if self._recorder.recording and self.config.pause_gc and self.config.mode == "full":
            pause_collection()  # until this micro-batch is checked (core/gcpause.py)
        if phase == "train":
            self._counters.batch_started = True
            if self._arbiter.posted_elsewhere():
                # With its own evidence first: an adapter may start the batch again after its forward (frames not
                # checked yet), or a detection may be held for the optimizer step; settling with nothing would post
                # nothing, and the verdict would name whichever rank posted first (under DDP, a rank whose only
                # evidence is the shared gradients).
                self._settle(hold=False)

    def end_batch(self, *, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """The current micro-batch is over: check it, then advance its phase's counter.

        A training detection raises at once in a single process; distributed, it is published now and raised at the
        next optimizer step, where every rank meets (with no guarded optimizer: now). An evaluation detection
        raises now (evaluation may run on some ranks only; the others stop at their next check).

        Raises:
            NonFiniteError: this rank, or another, saw inf/nan.
            BatchLimitReached: `abort_after_batch_num` was the batch that just ended.
        """
        self._counters.set(optimizer_step, epoch)
        try:
            self._end_batch()
        finally:
            resume_collection()

    def _end_batch(self) -> None:
        counters = self._counters
        if counters.phase == "eval":
            self._settle(hold=False, wait=False)
            self._features.dispatch("on_batch_end", "eval", counters.eval_batch_number)
            counters.advance()
            return
        self._settle(hold=True)
        self._say_if_nothing_recorded()
        run_outside_dynamo(hook_code())  # again: a torch._dynamo.reset() forgets it
        self._features.dispatch("on_batch_end", "train", counters.batch_number)  # the scale, a due summary
        counters.advance()
        # The optimizer may have written the weights in a way `_version` does not show (fused kernels, `p.data`).
        self._cache.forget_parameters()
        self._update_recording()
        limit = self.config.abort_after_batch_num
        if limit is not None and counters.batch_number > limit:
            raise BatchLimitReached(
                f"nanwatch: stopping after batch_number={counters.batch_number - 1} as asked by "
                f"abort_after_batch_num={limit}",
                batch_number=counters.batch_number - 1,
            )

    def _say_if_nothing_recorded(self) -> None:
        """A watched training batch that recorded no frame at all: say so, once, and why as far as it is known: the
        hooks were removed (nanwatch raised, or the watcher was closed), code compiled by torch.compile before watching
        began ran the model (a compiled training step runs no hook added later), or no training forward of the model
        ran (none at all, or only in eval mode)."""
        recorded, self._checker.batch_recorded = self._checker.batch_recorded, False
        if recorded or self._told_nothing_recorded or not self._recorder.recording or self.config.mode != "full":
            return
        if not self.attached:
            if self._hooked:  # the hooks are gone: close(), or the adapter's own cleanup when nanwatch raised
                self._told_nothing_recorded = True
                warn(
                    "nanwatch: the batches since nanwatch raised (or was closed) are not watched: its hooks went with "
                    "the error. Watch the model again (nanwatch.watch) to go on watching. (Said once.)"
                )
            return
        if not self._recorder.modules:
            return
        self._told_nothing_recorded = True
        batch = f"batch_number={self._counters.batch_number}"
        if compiled_anything():
            warn(
                f"nanwatch: no watched module recorded anything during {batch}. If the model runs inside code "
                "compiled by torch.compile before watching began, that code runs no hook added later: start watching "
                "before the first compiled call, or call torch._dynamo.reset() after starting to watch. (Said once.)"
            )
        else:
            warn(
                f"nanwatch: no watched module recorded anything during {batch}: no forward of the watched model ran "
                "in training mode since the previous batch ended (a forward in eval mode is not watched unless "
                "watch_eval=True). (Said once.)"
            )

    def agreement_point(self, *, hold: bool = True) -> None:
        """Check now (before backward, say) rather than at the end of the micro-batch; a detection raises as in
        `end_batch()` (`hold=False`: at once, on every rank that meets this check)."""
        self._settle(hold=hold)

    def on_optimizer_step(
        self, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None = None, *, optimizer_step: Kept = KEEP
    ) -> None:
        """An optimizer step is at `stage`: "guarded" (the adapter will report "before" for each of its steps),
        "before" it applies the gradients (the recorded frames and the gradients are checked, and every rank agrees:
        a step that would apply inf/nan never runs), "after" it ran (counted), or "settled" (the loss scaler decided
        the last micro-batch's step). `optimizer_step`: the framework's own count of completed steps, if it keeps one.
        """
        self._counters.set(optimizer_step)
        if stage == "guarded":
            self._guarded = True
            if optimizer is not None:
                self._guarded_optimizers.add(optimizer)
            return
        self._features.dispatch("on_optimizer_step", stage, optimizer)
        if stage == "before":
            self._settle(hold=False)
        elif stage == "after" and optimizer_step is KEEP:
            self._counters.count_optimizer_step()

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Record a loss computed outside the watched modules as a frame of its own (module `(loss)`)."""
        if not self._recorder.recording or not isinstance(loss, torch.Tensor):
            return
        if self._last_loss is not None and self._last_loss() is loss:  # told twice (the user and the adapter)
            return
        try:
            self._last_loss = weakref.ref(loss)
            with torch.no_grad():
                entry = Entry("loss", Role.LOSS, self._cache.measure(loss))
            self._recorder.append(self._recorder.frame("(loss)", type(loss).__name__, [entry]), None)
        except Exception as error:  # our bookkeeping must never kill a healthy run
            self._disable(f"recording the loss failed: {error!r}")

    def watch_scaler(
        self, scaler: GradScalerLike, *, read_scale: Literal["at_batch_end", "when_settled"] = "at_batch_end"
    ) -> None:
        """Follow a `torch.amp.GradScaler`: inf/nan gradients on steps it skips are expected (core/features/
        loss_scale.py). `read_scale`: when its scale is read, as each micro-batch ends or at the "settled" stage.

        Raises:
            TypeError: `scaler` is not a GradScaler.
            ValueError: `read_scale` is neither of the two.
        """
        if not isinstance(scaler, GradScalerLike):
            raise TypeError(
                "scaler must be a torch.amp.GradScaler (an object with get_scale() and is_enabled()), "
                f"got {type(scaler).__name__}"
            )
        if read_scale not in ("at_batch_end", "when_settled"):
            raise ValueError(f"read_scale can be 'at_batch_end' or 'when_settled', got {read_scale!r}")
        self._features.dispatch("on_scaler", scaler, read_scale)

    def state_dict(self) -> dict[str, Any]:
        return self._counters.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._counters.load_state_dict(state)
        self._update_recording()

    def set_counters(self, *, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """The framework's counters as they are now (numpy integers and 0-d tensors are taken as ints)."""
        self._counters.set(optimizer_step, epoch)

    def outside_graph(
        self, module: torch.nn.Module, hook: Callable[..., Any], *placeholders: Any
    ) -> Callable[..., Any]:
        """An adapter's `hook` on `module`, as a hook a compiled graph does not trace (core/engine/recorder.py)."""
        return self._recorder.outside_graph(module, hook, *placeholders)

    # ------------------------------------------------------------------------------------------ what to read

    @property
    def phase(self) -> Phase:
        return self._counters.phase

    @property
    def batch_number(self) -> int:
        """The current (or next) training micro-batch."""
        return self._counters.batch_number

    @property
    def eval_batch_number(self) -> int:
        return self._counters.eval_batch_number

    @property
    def optimizer_step(self) -> int | None:
        return self._counters.optimizer_step

    @property
    def epoch(self) -> int | None:
        return self._counters.epoch

    @property
    def current_batch(self) -> int:
        return self._counters.current_batch

    @property
    def recording(self) -> bool:
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
    def disabled_reason(self) -> str | None:
        """Why watching stopped after an internal failure, or None while it works."""
        return self._disabled_reason

    def read(self, readout: Readout[Callable[[], _T]]) -> _T | None:
        """What a feature offers (core/readouts.py: `SUMMARY`, `LOSS_SCALE_HISTORY`), or None where none does."""
        return self._features.read(readout)

    def summary(self) -> Summary | None:
        """Abs max per watched module in the last training batch checked clean (reads its numbers back), or None."""
        return self.read(SUMMARY)

    def feature(self, kind: type[_F]) -> _F | None:
        """The feature of class `kind` this watcher runs, or None where the config leaves it out."""
        return self._features.find(kind)

    def recent_frames(self) -> list[Frame]:
        """The ring's frames followed by those not yet checked (for tests and tools)."""
        return self._checker.ring.frames() + list(self._recorder.pending)

    def check(self) -> Report | None:
        """Check the pending frames on this rank alone (one host read); a report if they hold inf/nan."""
        return self._checker.check_safely()

    # ------------------------------------------------------------------------------------------ bookkeeping

    def _settle(self, *, hold: bool, wait: bool = True) -> None:
        """Check; raise on every rank if this rank or another saw inf/nan (core/engine/arbiter.py). A detection is
        held for the optimizer step only where an adapter checks before each step."""
        self._arbiter.detect(self._checker.check_safely())
        self._arbiter.settle(hold=hold and self._guarded, wait=wait)

    def _micro_batch_raised(self) -> None:
        resume_collection()  # the micro-batch ends here
        self._checker.batch_recorded = False  # a loop that catches this and goes on records nothing more

    def _update_recording(self) -> None:
        """Whether the hooks record, and trace, from here on: decided at batch boundaries and phase changes only (the
        hooks test one bool, so an unwatched batch costs nothing)."""
        counters, recorder = self._counters, self._recorder
        try:
            recorder.tracing = (
                counters.phase == "train"
                and counters.batch_number in self.config.trace_batch_nums
                and _rank_in(self.rank, self.config.trace_ranks)
            )
            if counters.phase == "train":
                watched = self._schedule.watched(counters.batch_number)
            else:
                watched = self.config.watch_eval
        except Exception as error:  # a bug in deciding what to watch must not end the run
            self._disable(f"deciding whether to watch batch_number={counters.batch_number} failed: {error!r}")
            return
        recorder.recording = self._disabled_reason is None and watched

    def _disable(self, reason: str) -> None:
        if self._disabled_reason is not None:
            return
        self._disabled_reason = reason
        self._recorder.recording = self._recorder.tracing = False
        resume_collection()
        self._recorder.pending.clear()
        warn(f"nanwatch stopped watching (the run goes on): {reason}")

    def _rerun(self, run: Callable[[], Any], *, batch_number: int, phase: Phase, gradients: bool) -> Report | None:
        """Run `run()` (a forward, maybe a backward, of this model) under a full watch of its own, with this
        engine's hooks out of the way; the report of what it saw, or None when it stayed finite."""
        inner = Watcher(self.model, self.config.for_rerun(gradients=gradients), rank=self.rank, world_size=1)
        inner._replaying = True  # world_size 1 above: nothing to agree on
        inner.load_state_dict({"batch_number": batch_number, "eval_batch_number": batch_number})
        inner.start_batch(phase)
        with self._hooks.suspended():
            inner.attach()
            try:
                run()
                return inner.check()
            finally:
                inner.close(check=False)

    def _log_summary(self, summary: Summary) -> None:
        self.logger.info(summary.to_text())


def _rank_in(rank: int, ranks: Literal["zero", "all"] | list[int]) -> bool:
    return ranks == "all" or (rank == 0 if ranks == "zero" else rank in ranks)


def _detection_of(report: Report, rank: int) -> Detection:
    return Detection(report.batch_number, rank, report.phase)


def _held(module: torch.nn.Module | None, ref: weakref.ref[torch.nn.Module], what: str) -> torch.nn.Module:
    found = module if module is not None else ref()
    if found is None:
        raise ReferenceError(f"nanwatch: the watched {what} no longer exists (this watcher was closed, and let it go)")
    return found


class _Read:
    """A read-only view of one attribute of the engine (or of one of its parts), for the context below."""

    def __init__(self, *path: str) -> None:
        self.path = path

    def __get__(self, context: _Context, owner: type | None = None) -> Any:
        found: Any = context._engine
        for name in self.path:
            found = getattr(found, name)
        return found


class _Context:
    """The `EngineContext` features get: a narrow view of one engine (core/events.py)."""

    model, entry, config = _Read("model"), _Read("entry"), _Read("config")
    rank, world_size, logger, hooks = _Read("rank"), _Read("world_size"), _Read("logger"), _Read("hooks")
    phase, batch_number, current_batch = _Read("phase"), _Read("batch_number"), _Read("current_batch")
    optimizer_step, epoch, recording = _Read("optimizer_step"), _Read("epoch"), _Read("recording")
    tracing, disabled_reason = _Read("tracing"), _Read("disabled_reason")
    guarded, frames_finite = _Read("_guarded"), _Read("_checker", "frames_finite")
    summary_sink = _Read("summary_sink")

    def __init__(self, engine: Watcher) -> None:
        self._engine = engine

    def rank_logs(self, ranks: Literal["zero", "all"] | list[int]) -> bool:
        return _rank_in(self._engine.rank, ranks)

    def watches_batch(self, batch_number: int) -> bool:
        return self._engine._schedule.watched(batch_number)

    def measure(self, tensor: torch.Tensor) -> Measurement:
        return self._engine._cache.measure(tensor)

    def add_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        self._engine._recorder.append(frame, module)

    def trace_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        if self._engine._recorder.tracing:
            self._engine._features.dispatch("on_frame", frame, module, (), None)

    def is_last_pending(self, frame: Frame) -> bool:
        pending = self._engine._recorder.pending
        return bool(pending) and pending[-1] is frame

    def detection_report(self, section: ReportSection, module_name: str | None) -> Report:
        return self._engine._checker.detection_report(section, module_name)

    def rerun(self, run: Callable[[], Any], *, batch_number: int, phase: Phase, gradients: bool) -> Report | None:
        return self._engine._rerun(run, batch_number=batch_number, phase=phase, gradients=gradients)

    def report_for(self, frames: Sequence[Frame]) -> Report | None:
        checker = self._engine._checker
        return checker.report_of(frames) if checker.screen(frames, features=False)[0] else None

    def keep_as_context(self, frames: Iterable[Frame]) -> None:
        self._engine._checker.ring.extend(frames)

    def publish(self, report: Report) -> None:
        self._engine._publisher.publish(report)

    def disable(self, reason: str) -> None:
        self._engine._disable(reason)


if TYPE_CHECKING:

    def _implements_the_adapter_contract(watcher: Watcher) -> AdapterContract:
        return watcher  # mypy checks that the engine offers every member core/contract.py declares
