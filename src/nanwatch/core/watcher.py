"""The engine's facade: wires the parts of core/engine/ together and implements the adapter contract.

Adapters (the plain loop, Lightning, Accelerate, the HF Trainer) call the members declared in core/contract.py: they
say when a micro-batch starts and ends, where the optimizer step is, and hand over the loss and the loss scaler.
Where each thing happens:

- core/engine/recording/recorder.py: the hooks, the frames they make (eager and compiled), the pending frames;
- core/engine/counters.py: the phase and the counters (batch numbers, optimizer step, epoch);
- core/engine/checker.py: the check (one host read), the reports, the ring of earlier frames;
- core/engine/arbiter.py: a detection from found to held to agreed across ranks to raised;
- core/engine/publisher.py: the report into the log and onto disk;
- core/engine/feature_set.py: the features (core/features/), which plug into the events of core/feature_api.py;
- core/engine/watcher_reads.py: what the facade offers to read (counters, readouts, recent frames).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.contract import AdapterContract
from nanwatch.core.distributed.ranks import Detection, world_size_and_rank
from nanwatch.core.engine.assembly import assemble
from nanwatch.core.engine.counters import PHASES
from nanwatch.core.engine.decided_on_device import DecidedOnDevice, skip_flag
from nanwatch.core.engine.feature_context import Fixed
from nanwatch.core.engine.held_model import Held
from nanwatch.core.engine.nothing_recorded import nothing_recorded
from nanwatch.core.engine.recording.recorder import hook_code, own_code
from nanwatch.core.engine.watcher_reads import WatcherReads
from nanwatch.core.feature_api import KEEP, Feature, Kept, OptimizerStage, Phase, WriteAside
from nanwatch.core.features import features_for
from nanwatch.core.formats.files import prepare_report_dir
from nanwatch.core.frames import ResolvedFrame, resolve
from nanwatch.core.log import get_logger, warn
from nanwatch.core.optimizers import hand_flag, take_back_flag, takes_device_flag
from nanwatch.core.readouts import GradScalerLike, Summary, checked_scaler
from nanwatch.core.report import Report
from nanwatch.core.rewinds import Restorer, Rewind, RewindPoint
from nanwatch.core.scope import select_modules
from nanwatch.core.torch_glue.compiler import (
    compiled_anything,
    forget_compiled_code,
    run_outside_dynamo,
    with_compiled_code,
    without_compile_wrappers,
)
from nanwatch.core.torch_glue.gcpause import pause_collection, resume_collection
from nanwatch.core.torch_glue.hooks import HookSet, named_unique_modules
from nanwatch.errors import BatchLimitReached, NonFiniteError

__all__ = ["KEEP", "PHASES", "Watcher"]

_F = TypeVar("_F", bound=Feature)
_T = TypeVar("_T")


class Watcher(WatcherReads):
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
        self._model, self._entry = Held(model, "model"), Held(model if entry is None else entry, "entry module")
        self.config = config
        self.rank = found_rank if rank is None else rank
        self.world_size = found_world_size if world_size is None else world_size
        self.logger: logging.Logger = get_logger()
        # Where a due summary goes: the logger by default; adapters send it to their framework (or nowhere: None).
        self.summary_sink: Callable[[Summary], None] | None = self._log_summary
        self._disabled_reason: str | None = None
        self._told_nothing_recorded = False
        self._guarded = False  # an adapter checks before each optimizer step
        self._guarded_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._last_loss: weakref.ref[torch.Tensor] | None = None
        self._replaying = False  # a watch of its own over a replay (`_rerun`)
        self._hooks = HookSet()
        fixed = Fixed(config, self.rank, self.world_size, self.logger, self._hooks)
        parts = assemble(self, fixed, features_for(config), on_raise=self._micro_batch_raised)
        self._schedule, self._cache, self._counters = parts.schedule, parts.cache, parts.counters
        self._features, self._recorder, self._checker = parts.features, parts.recorder, parts.checker
        self._publisher, self._arbiter, self._rewinder = parts.publisher, parts.arbiter, parts.rewinder
        self._on_device: DecidedOnDevice | None = None  # a step's check its optimizer decided, read at the next
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
        self._model.hold()  # again, if this watcher was closed before
        self._entry.hold()
        if self.config.report_dir is not None:
            prepare_report_dir(self.config.report_dir)  # a bad one is an error now, not a lost report later
        candidates = modules if modules is not None else named_unique_modules(self.model)
        # Scope is decided here, once: a module left out gets no hook and costs nothing. A torch.compile wrapper inside
        # the model adds no frame, and `_orig_mod` no part to the names.
        selected = select_modules(
            without_compile_wrappers(candidates), self.config.include_modules, self.config.exclude_modules
        )
        if self.config.mode == "full":  # sentinel mode: no per-module hook (core/features/sentinel/)
            # A replay runs the model eagerly: compiled code is not in its way.
            self._recorder.hook(selected, self._hooks, forget_stale=not self._replaying, info=self.logger.info)
        for feature in self._features:  # after the frame hooks: their hooks run once a frame is recorded
            feature.attach(self._features.ctx, selected)

    def close(self, *, check: bool = True, raise_detection: bool = False) -> Report | None:
        """`AdapterContract.close` (core/contract.py)."""
        report = None
        refused: NonFiniteError | None = None  # the last step's detection, decided on the device, as of that step
        try:
            if self._on_device is not None:
                report, refused = self._conclude_at_close()
            if check and self._disabled_reason is None and report is None:
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
            self._arbiter.close()
            held = self._arbiter.release()  # held for a step that never came
            report = report if report is not None else held
            # The last step's detection: raised as any other would have been at its step (never over the user's own
            # exception in flight: a framework closing after an error, a `with` block that raised).
            if refused is not None and (raise_detection or sys.exc_info()[1] is None):
                raise refused
            if report is not None and raise_detection:
                self._arbiter.raise_error(report, _detection_of(report, self.rank))
        finally:
            self._let_go()
        return report

    def _conclude_at_close(self) -> tuple[Report | None, NonFiniteError | None]:
        """The last step's check, decided on the device, concluded now as of that step: its report and the error it
        raises (for `close` to raise once everything is let go), or, under skip, nothing: the step is listed as
        skipped."""
        decided, self._on_device = self._on_device, None
        assert decided is not None
        report, error = self._conclude(decided)
        return (report, error) if error is not None else (None, None)

    def _let_go(self) -> None:
        """Closed: hold nothing of the model any more (the modules, the compiled path's adapter hooks, the cache's
        tracked parameters and staging buffers; each feature dropped its own in `close`), only what a user may still
        read (the counters, the ring's frames, the reports, the summary's numbers)."""
        self._model.let_go()
        self._entry.let_go()
        self._recorder.close()
        self._cache.clear()

    @property
    def model(self) -> torch.nn.Module:
        """The watched model. Once closed, held weakly: `ReferenceError` when nothing else keeps it alive."""
        return self._model.get()

    @property
    def entry(self) -> torch.nn.Module:
        """The module the user calls, when it wraps `model` (DDP, torch.compile): sentinel mode hooks it there,
        outside the wrapper's own machinery (a compiled graph), and runs `model` itself to replay. Once closed, held
        weakly (as `model`)."""
        return self._entry.get()

    def set_phase(self, phase: Phase) -> None:
        """`AdapterContract.set_phase` (core/contract.py)."""
        if phase not in PHASES:
            raise ValueError(f"phase can be one of {PHASES}, got {phase!r}")
        counters = self._counters
        if phase != counters.phase:
            # Weights are often swapped through `.data` around evaluation (EMA), which no version counter shows.
            self._cache.forget_parameters()
            counters.phase = phase
            self._update_recording()

    def start_batch(self, phase: Phase, *, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """`AdapterContract.start_batch` (core/contract.py)."""
        self.set_phase(phase)
        self._counters.set(optimizer_step, epoch)
        if self._recorder.recording and self.config.pause_gc and self.config.mode == "full":
            pause_collection()  # until this micro-batch is checked (core/torch_glue/gcpause.py)
        if phase == "train":
            self._counters.batch_started = True
            # Under on_detect="skip" a verdict is acted on at the optimizer step (where it skips), never here.
            if not self._arbiter.skips and self._arbiter.posted_elsewhere():
                # With its own evidence first: an adapter may start the batch again after its forward (frames not
                # checked yet), or a detection may be held for the optimizer step; settling with nothing would post
                # nothing, and the verdict would name whichever rank posted first (under DDP, a rank whose only
                # evidence is the shared gradients).
                self._settle(hold=False)

    def end_batch(self, *, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """`AdapterContract.end_batch` (core/contract.py)."""
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
        if not self._step_decides_on_device():
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
        """A watched training batch that recorded no frame at all: say so, once (core/engine/nothing_recorded.py)."""
        recorded, self._checker.batch_recorded = self._checker.batch_recorded, False
        if recorded or self._told_nothing_recorded or not self._recorder.recording or self.config.mode != "full":
            return
        notice = nothing_recorded(
            self._counters.batch_number,
            attached=self.attached,
            hooked=self._recorder.hooked,
            modules=bool(self._recorder.modules),
            compiled=compiled_anything(),
        )
        if notice is not None:
            self._told_nothing_recorded = True
            warn(notice)

    def agreement_point(self, *, hold: bool = True) -> None:
        """`AdapterContract.agreement_point` (core/contract.py)."""
        self._settle(hold=hold)

    def on_optimizer_step(
        self, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None = None, *, optimizer_step: Kept = KEEP
    ) -> None:
        """`AdapterContract.on_optimizer_step` (core/contract.py)."""
        self._counters.set(optimizer_step)
        if stage == "guarded":
            self._guarded = True
            if optimizer is not None:
                self._guarded_optimizers.add(optimizer)
            return
        if stage == "before":
            self._conclude_on_host()  # the last step's check, decided on the device: read now that this one is queued
        self._features.dispatch("on_optimizer_step", stage, optimizer)
        if stage == "before":
            if optimizer is None or not self._decide_on_device(optimizer):
                self._settle(hold=False, before_step=optimizer)
        elif stage == "after":
            if optimizer is not None and self._on_device is not None and self._on_device.optimizer is optimizer:
                take_back_flag(optimizer, self._on_device.flag)
            if optimizer_step is KEEP:
                self._counters.count_optimizer_step()

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Record a loss computed outside the watched modules as a frame of its own (module `(loss)`)."""
        if not self._recorder.recording or not isinstance(loss, torch.Tensor):
            return
        if self._last_loss is not None and self._last_loss() is loss:  # told twice (the user and the adapter)
            return
        try:
            self._last_loss = weakref.ref(loss)
            self._recorder.record_loss(loss)
        except Exception as error:  # our bookkeeping must never kill a healthy run
            self.disable(f"recording the loss failed: {error!r}")
            return
        self._features.dispatch("on_loss", loss)

    def watch_scaler(
        self, scaler: GradScalerLike, *, read_scale: Literal["at_batch_end", "when_settled"] = "at_batch_end"
    ) -> None:
        """`AdapterContract.watch_scaler` (core/contract.py)."""
        self._features.dispatch("on_scaler", checked_scaler(scaler, read_scale), read_scale)

    def verify_checkpoint(
        self,
        state: Any,
        path: str,
        *,
        step: int | None = None,
        write_aside: WriteAside | None = None,
    ) -> None:
        """`AdapterContract.verify_checkpoint` (core/contract.py)."""
        step = self._counters.optimizer_step if step is None else step
        self._features.dispatch("on_checkpoint", state, str(path), step, write_aside)

    @property
    def skipped(self) -> list[dict[str, object]]:
        """`AdapterContract.skipped` (core/contract.py)."""
        return list(self._arbiter.skipped)

    def restore_with(self, restorer: Restorer) -> None:
        """`AdapterContract.restore_with` (core/contract.py)."""
        if self._rewinder is not None:
            self._rewinder.restore_with(restorer)

    def note_rewind_point(self, point: RewindPoint) -> None:
        """`AdapterContract.note_rewind_point` (core/contract.py)."""
        if self._rewinder is not None:
            self._rewinder.certified(point)

    @property
    def rewinds(self) -> list[Rewind]:
        """`AdapterContract.rewinds` (core/contract.py)."""
        return [] if self._rewinder is None else list(self._rewinder.rewinds)

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
        """An adapter's `hook` on `module`, as a hook a compiled graph does not trace
        (core/engine/recording/recorder.py)."""
        return self._recorder.outside_graph(module, hook, *placeholders)

    # ------------------------------------------------------------------------------------------ bookkeeping

    def _settle(self, *, hold: bool, wait: bool = True, before_step: torch.optim.Optimizer | None = None) -> None:
        """Check; raise on every rank if this rank or another saw inf/nan, or skip the step of `before_step`
        (core/engine/arbiter.py). A detection is held for the optimizer step only where an adapter checks before each
        step."""
        self._conclude_on_host()  # a step decided on the device is concluded before any later check looks
        self._arbiter.detect(self._checker.check_safely())
        self._arbiter.settle(hold=hold and self._guarded, wait=wait, before_step=before_step)

    @property
    def decided_on_device(self) -> bool:
        """`EngineContext.decided_on_device` (core/feature_api.py)."""
        return self._on_device is not None

    def _step_decides_on_device(self) -> bool:
        """Whether the optimizer step to come checks this micro-batch on the device: then a loop (or a framework, the
        HF Trainer) that ends the micro-batch before the step has nothing read here; the step's check takes it all."""
        return (
            self.config.mode == "sentinel"
            and self.world_size == 1
            and self.config.on_detect != "rewind"
            and self._guarded
            and len(self._guarded_optimizers) > 0
            and all(takes_device_flag(optimizer) for optimizer in self._guarded_optimizers)
        )

    def _decide_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Sentinel mode before the step of an optimizer that takes `found_inf`: the check's flag goes to it, and the
        host reads the check when the next step is about to run (core/engine/decided_on_device.py). False where the
        host must decide now: other modes and optimizers, several ranks (they agree at the step, through the store),
        `on_detect="rewind"`, a GradScaler's flag already handed, a detection held or found early."""
        if (
            self.config.mode != "sentinel"
            or self.world_size != 1
            or self.config.on_detect == "rewind"
            or self._disabled_reason is not None
            or self._arbiter.held is not None
            or self._checker.found_early
            or self.config.spike_window is not None  # a spike is judged on its own micro-batch, at its own check
            or not takes_device_flag(optimizer)
            or getattr(optimizer, "found_inf", None) is not None  # a GradScaler's, or another watcher's, this step
            or not _stepped_every_parameter(optimizer)
        ):
            return False
        flag = None
        try:
            if any(feature.held(self._features.ctx) is not None for feature in self._features):
                return False  # concluded now, by the host
            launched = self._checker.launch(take=True)
            flag = skip_flag(launched)
            handed = flag is not None and hand_flag(optimizer, flag)
            if handed:
                assert flag is not None
                snapshot = self._counters.snapshot()
                self._on_device = DecidedOnDevice.start(launched, optimizer, snapshot, flag, self.model)
        except Exception as error:  # our bookkeeping must never kill a healthy run
            if flag is not None:
                take_back_flag(optimizer, flag)
            self.disable(f"checking the recorded frames failed: {error!r}")
            return True
        if not handed:  # several devices: the host decides, now
            self._arbiter.detect(self._checker.conclude_safely(launched))
            self._arbiter.settle(hold=False, before_step=optimizer)
        return True

    def _conclude_on_host(self) -> None:
        """Read and conclude the check an optimizer decided on the device a step ago: as of that step, a detection is
        reported, raised or listed as skipped (the optimizer applied nothing; the step's gradients are gone)."""
        decided, self._on_device = self._on_device, None
        if decided is not None:
            _, error = self._conclude(decided)
            if error is not None:
                raise error

    def _conclude(self, decided: DecidedOnDevice) -> tuple[Report | None, NonFiniteError | None]:
        """`decided` read back and settled as of its step, in the training modes it ran in: its report, and the
        error the arbiter raised for it (built as of that step), if any."""
        with self._counters.as_of(decided.counters), decided.as_it_ran():
            try:
                report = self._checker.conclude_safely(decided.launched, decided.values())
            finally:
                take_back_flag(decided.optimizer, decided.flag)
            self._arbiter.detect(report)
            try:
                self._arbiter.settle(hold=False, before_step=decided.optimizer, applied_nothing=True)
            except NonFiniteError as error:
                return report, error
        return report, None

    def _micro_batch_raised(self) -> None:
        resume_collection()  # the micro-batch ends here
        self._checker.batch_recorded = False  # a loop that catches this and goes on records nothing more

    def _update_recording(self) -> None:
        """Whether the hooks record, and trace, from here on: decided at batch boundaries and phase changes only (the
        hooks test one bool, so an unwatched batch costs nothing)."""
        counters, recorder, schedule = self._counters, self._recorder, self._schedule
        try:
            recorder.tracing = schedule.traces(counters.phase, counters.batch_number, self.rank)
            watched = schedule.records(counters.phase, counters.batch_number)
        except Exception as error:  # a bug in deciding what to watch must not end the run
            self.disable(f"deciding whether to watch batch_number={counters.batch_number} failed: {error!r}")
            return
        recorder.recording = self._disabled_reason is None and watched

    def disable(self, reason: str) -> None:
        """Stop watching after a failure in nanwatch itself, with a `NanwatchWarning`; the run goes on."""
        if self._disabled_reason is not None:
            return
        self._disabled_reason = reason
        self._recorder.recording = self._recorder.tracing = False
        resume_collection()
        self._recorder.drop_pending()
        warn(f"nanwatch stopped watching (the run goes on): {reason}")

    def rerun(
        self,
        run: Callable[[], Any],
        *,
        batch_number: int,
        phase: Phase,
        gradients: bool,
        frames: list[ResolvedFrame] | None = None,
    ) -> Report | None:
        """Run `run()` (a forward, maybe a backward, of this model) under a full watch of its own, with this
        engine's hooks out of the way; the report of what it saw, or None when it stayed finite. `frames`, when
        given, receives every frame the run recorded, read back (a spike's replay compares them)."""
        inner = Watcher(self.model, self.config.for_rerun(gradients=gradients), rank=self.rank, world_size=1)
        inner._replaying = True  # world_size 1 above: nothing to agree on
        inner.load_state_dict({"batch_number": batch_number, "eval_batch_number": batch_number})
        inner.start_batch(phase)
        with self._hooks.suspended():
            inner.attach()
            try:
                run()
                if frames is not None:
                    frames.extend(resolve(inner._recorder.pending))
                return inner.check()
            finally:
                inner.close(check=False)

    def _log_summary(self, summary: Summary) -> None:
        self.logger.info(summary.to_text())


# The optimizers that took a step decided on the host: their state is made (held weakly).
_STEPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _stepped_every_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's state is made for every parameter it keeps state for: a fused optimizer told to skip
    the step that would make it leaves it uninitialised (fused SGD's momentum comes from `empty_like`), so the first
    step, and the first after a parameter joins, are decided on the host. (An optimizer that keeps no state, plain
    SGD, has nothing to make.)"""
    if optimizer not in _STEPPED:
        _STEPPED.add(optimizer)  # this first step is the host's
        return False
    state = optimizer.state
    return not state or all(param in state for group in optimizer.param_groups for param in group["params"])


def _detection_of(report: Report, rank: int) -> Detection:
    return Detection(report.batch_number, rank, report.phase)


if TYPE_CHECKING:

    def _implements_the_adapter_contract(watcher: Watcher) -> AdapterContract:
        return watcher  # mypy checks that the engine offers every member core/contract.py declares
