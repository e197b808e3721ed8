"""The engine: record frames from forward hooks, check them with one host read, agree across ranks, report, raise.

Adapters (the plain loop, Lightning, Accelerate, the HF Trainer) call the handful of methods under "the adapter
contract": they say when a micro-batch starts and ends, where the optimizer step is, and hand over the loss and the
loss scaler. Everything a feature adds (gradients, culprit, headroom, loss scale, capture, summary, trace) lives in
core/features/ and plugs into the events of core/events.py; the hot path below dispatches to none of them.
"""

from __future__ import annotations

import enum
import logging
import operator
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NoReturn, TypeVar

import torch

from nanwatch.core.compiler import (
    compiled_anything,
    forget_compiled_code,
    nested_code,
    run_outside_dynamo,
    stale_compiled_code,
    with_compiled_code,
    without_compile_wrappers,
)
from nanwatch.core.config import WatchConfig
from nanwatch.core.events import EngineContext, Feature, OptimizerStage, Phase
from nanwatch.core.features import features_for
from nanwatch.core.features.guard import born_in_backward, first_gradient
from nanwatch.core.features.headroom import HeadroomMonitor
from nanwatch.core.features.loss_scale import GradScalerLike, LossScaleFeature, LossScaleMonitor
from nanwatch.core.features.summary import Summary, SummaryFeature
from nanwatch.core.formats.files import prepare_report_dir, write_report
from nanwatch.core.frames import Direction, Entry, Frame, FrameRing, Role, resolve
from nanwatch.core.gcpause import pause_collection, resume_collection
from nanwatch.core.hooks import HookSet, module_class_name, named_unique_modules, reshards_after_forward
from nanwatch.core.log import get_logger, warn
from nanwatch.core.ranks import Detection, DetectionBoard, Kind, world_size_and_rank
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.scope import BatchSchedule, select_modules
from nanwatch.core.stats.compiled import (
    Sink,
    frame_key,
    frame_template,
    marker_key,
    measurements,
    record_call,
    record_marker,
)
from nanwatch.core.stats.measure import (
    Measurement,
    StatsCache,
    TrackedBatch,
    extra_kernels,
    read_flags,
    stack_maxima,
)
from nanwatch.core.walk import TooDeep, TooMany, walk
from nanwatch.errors import BatchLimitReached, NanwatchError, NonFiniteError

__all__ = ["Watcher", "PHASES", "KEEP"]

PHASES: tuple[Phase, ...] = ("train", "eval")
# A loop that never ends its batches would grow the pending frames without bound; past this many (a few tens of MB),
# they are checked and moved into the ring (a host read mid-batch, which a loop that ends its batches never pays).
_MAX_PENDING_FRAMES = 20_000
# Labels built once rather than formatted at every module call.
_INPUT_LABELS = tuple(f"input[{index}]" for index in range(16))
_ITEM_SUFFIXES = tuple(f"[{index}]" for index in range(16))
_PARAMETER, _INPUT, _OUTPUT = Role.PARAMETER, Role.INPUT, Role.OUTPUT
_FORWARD, _RECOMPUTE = Direction.FORWARD, Direction.RECOMPUTE
_ROLES = {role.value: role for role in Role}
# Keyword inputs hold flags, sizes and caches as often as tensors: only values of these kinds are looked into.
_PLAIN_VALUES = (bool, int, float, str, type(None))
_PLAIN_PARAMETERS = (torch.nn.Parameter, torch.Tensor)
_is_compiling = torch.compiler.is_compiling
# -1 unless autograd runs a backward on this thread: what `hooks.recomputing()` asks, called here directly.
_graph_task_id = torch._C._current_graph_task_id
_F = TypeVar("_F", bound=Feature)


def _kind(report: Report) -> Kind:
    """What a detection rests on: what this rank saw itself (a frame holding inf/nan, the sentinel's sum of the model's
    output), or only the gradients about to be applied, which an all-reduce spreads to every rank."""
    seen_here = report.section("sentinel") is not None or any(frame.non_finite for frame in report.frames)
    return "frames" if seen_here else "gradients"


class _Keep(enum.Enum):
    KEEP = "keep"


KEEP = _Keep.KEEP  # a counter argument left as it is


class Watcher:
    """Records what every module of `model` sees and finds the first inf/nan.

    Args:
        model: the module whose submodules are watched (every one, the root included).
        config: what to watch and report.
        rank: this process's rank; found from torch.distributed when None.
        world_size: the number of processes; found from torch.distributed when None.
    """

    def __init__(
        self, model: torch.nn.Module, config: WatchConfig, *, rank: int | None = None, world_size: int | None = None
    ) -> None:
        found_world_size, found_rank = world_size_and_rank()
        # Held while watching, and only weakly once closed (`close()`): a closed watcher keeps no tensor of the model
        # alive (a notebook that deletes the model gets its memory back while the handle lives on).
        self._model: torch.nn.Module | None = model
        self._model_ref = weakref.ref(model)
        self._entry: torch.nn.Module | None = model
        self._entry_ref = weakref.ref(model)
        self.config = config
        self.rank = found_rank if rank is None else rank
        self.world_size = found_world_size if world_size is None else world_size
        self.batch_number = 0
        self.eval_batch_number = 0
        self.optimizer_step: int | None = None
        self.epoch: int | None = None
        self.logger: logging.Logger = get_logger()
        self._phase: Phase = "train"
        self._recording = True
        self._tracing = False
        self._disabled_reason: str | None = None
        self._ring = FrameRing(config.max_frames_to_save)
        self._pending: list[Frame] = []
        self._cache = StatsCache(extra_kernels(config))
        # Under torch.compile the hooks' records arrive here as the graph runs (`_take_compiled`).
        self._sink = Sink(self._take_compiled)
        self._outside: list[Callable[[], Any]] = []  # adapter hooks run from inside a graph (`outside_graph`)
        self._modules: dict[str, torch.nn.Module] = {}  # the watched modules by name, for traced frames
        self._batch_recorded = False  # a frame was recorded since the last training batch ended
        self._told_nothing_recorded = False
        self._hooked = False  # module hooks were attached once (full mode), whether or not they are still there
        self._hooks = HookSet()
        self._schedule = BatchSchedule(config)
        self._features = features_for(config)
        self._ctx: EngineContext = _Context(self)
        self._held_report: Report | None = None
        self._last_loss: weakref.ref[torch.Tensor] | None = None
        self._replaying = False  # a watch of its own over a replay (`_rerun`)
        self._batch_started = False  # a training forward ran since the last end_batch()
        # Distributed: where ranks tell each other of a detection, with no collective (core/ranks.py).
        self._board = DetectionBoard.for_this_run(self.rank, self.world_size, config.rank_wait_s)
        self._detection: Report | None = None  # seen, and held for the optimizer step where ranks meet
        self._published = False
        self._guarded = False  # an adapter checks before each optimizer step
        self._frames_finite = True  # during a check's review: no frame of that check holds inf/nan
        self._guarded_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._feature(SummaryFeature).sink = self._log_summary
        self._update_tracing()

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
        # A torch.compile wrapper inside the model adds no frame, and `_orig_mod` no part to the names.
        candidates = without_compile_wrappers(candidates)
        # Scope is decided here, once: a module left out gets no hook and costs nothing.
        selected = select_modules(candidates, self.config.include_modules, self.config.exclude_modules)
        if self.config.mode == "full":  # sentinel mode: no per-module hook (core/features/sentinel.py)
            for name, module in selected:
                # On a module FSDP2 manages, before FSDP's own forward hook frees the gathered parameters.
                hook = self._make_hook(name, module_class_name(module))
                handle = module.register_forward_hook(
                    hook, with_kwargs=True, prepend=reshards_after_forward(module)
                )  # keyword inputs are inputs too (`model(**batch)`)
                self._hooks.add_handle(handle)
                self._modules.setdefault(name, module)
            # Measured together once per batch, rather than one launch per parameter (StatsCache).
            self._cache.track_parameters(p for _, m in selected for p in m._parameters.values() if p is not None)
            if not self._replaying:  # a replay runs the model eagerly: its compiled code is not in the way
                self._forget_stale_compiled_code([module for _, module in selected])
            self._hooked = bool(selected)
        for feature in self._features:  # after the frame hooks: their hooks run once a frame is recorded
            feature.attach(self._ctx, selected)

    def _forget_stale_compiled_code(self, modules: list[torch.nn.Module]) -> None:
        """Compiled code made before these hooks existed would run without them (dynamo does not guard on hooks
        added later), and record nothing: drop it, so the next call compiles again with the hooks in."""
        forget_compiled_code(with_compiled_code(_own_code()))  # an earlier watcher's, compiled as frames of their own
        run_outside_dynamo(_hook_code())
        stale = stale_compiled_code(modules)
        if not stale:
            return
        # Dynamo may reuse code compiled for another module of the same class (its guards need not name the module),
        # so whichever module it was made for, it goes: at worst a recompilation.
        if forget_compiled_code(stale):
            self.logger.info(
                "nanwatch: compiled code (torch.compile) of these modules' forwards existed before watching began; "
                "it runs no hook added later, so nanwatch dropped it: the next compiled call compiles again, with "
                "the hooks in"
            )
        else:
            self._warn(
                "nanwatch: the model had run compiled (torch.compile) before watching began, and this torch cannot "
                "drop that compiled code: it will record nothing. Call torch._dynamo.reset() after starting to "
                "watch, or start watching before the first compiled call."
            )

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
                report = self._check_safely()
                if report is not None:
                    self._publish(report)
        finally:
            resume_collection()
            self._hooks.remove_all()
            self._sink.close()
            # The root's hooks run in frames dynamo compiles on their own, which hold this watcher: let them go.
            forget_compiled_code(with_compiled_code(_own_code()))
            self._cache.clear()
            for feature in self._features:
                self._safely(f"closing {feature.name}", feature.detach, self._ctx)
                self._safely(f"closing {feature.name}", feature.close, self._ctx)
        try:
            if report is None and self._detection is not None:  # held for a step that never came
                report = self._detection
                if not self._published:
                    self._publish(report)
            if report is not None and raise_detection:
                self._raise_detection(report, Detection(report.batch_number, self.rank, report.phase))
        finally:
            self._let_go()
        return report

    def _let_go(self) -> None:
        """Closed: hold nothing of the model any more (the modules, the compiled path's adapter hooks, the cache's
        tracked parameters and staging buffers; each feature dropped its own in `close`), only what a user may still
        read (the counters, the ring's frames, the reports, the summary's numbers)."""
        self._model = self._entry = None
        self._modules.clear()
        self._outside.clear()
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

    def start_batch(
        self, phase: Phase, *, optimizer_step: int | None | _Keep = KEEP, epoch: int | None | _Keep = KEEP
    ) -> None:
        """The forwards that follow belong to a micro-batch of `phase` ("train": counted as `batch_number`; "eval":
        counted apart, watched only with `watch_eval`). Idempotent within a micro-batch."""
        if phase not in PHASES:
            raise ValueError(f"phase can be one of {PHASES}, got {phase!r}")
        self._set_counters(optimizer_step, epoch)
        if phase != self._phase:
            # Weights are often swapped through `.data` around evaluation (EMA), which no version counter shows.
            self._cache.forget_parameters()
            self._phase = phase
            self._update_tracing()
        if self._recording and self.config.pause_gc and self.config.mode == "full":
            pause_collection()  # until this micro-batch is checked (core/gcpause.py)
        if phase == "train":
            self._batch_started = True
            if self._board is not None and self._board.posted_elsewhere():
                # Another rank stopped: so does this one, before its next forward. With its own evidence first: an
                # adapter may start the batch again after its forward (frames not checked yet), or a detection may
                # be held for the optimizer step; settling with nothing would post nothing, and the verdict would
                # name whichever rank posted first (under DDP, a rank whose only evidence is the shared gradients).
                self._settle(hold=False)

    def end_batch(self, *, optimizer_step: int | None | _Keep = KEEP, epoch: int | None | _Keep = KEEP) -> None:
        """The current micro-batch is over: check it, then advance its phase's counter.

        A training detection raises at once in a single process; distributed, it is published now and raised at the
        next optimizer step, where every rank meets (with no guarded optimizer: now). An evaluation detection
        raises now (evaluation may run on some ranks only; the others stop at their next check).

        Raises:
            NonFiniteError: this rank, or another, saw inf/nan.
            BatchLimitReached: `abort_after_batch_num` was the batch that just ended.
        """
        self._set_counters(optimizer_step, epoch)
        try:
            self._end_batch()
        finally:
            resume_collection()

    def _end_batch(self) -> None:
        if self._phase == "eval":
            self._settle(hold=False, wait=False)
            self._dispatch("on_batch_end", "eval", self.eval_batch_number)
            self.eval_batch_number += 1
            return
        self._settle(hold=True)
        self._batch_started = False
        self._say_if_nothing_recorded()
        run_outside_dynamo(_hook_code())  # again: a torch._dynamo.reset() forgets it
        self._dispatch("on_batch_end", "train", self.batch_number)  # the scale, a due summary: may raise the floor
        self.batch_number += 1
        # The optimizer may have written the weights in a way `_version` does not show (fused kernels, `p.data`).
        self._cache.forget_parameters()
        self._update_tracing()
        limit = self.config.abort_after_batch_num
        if limit is not None and self.batch_number > limit:
            raise BatchLimitReached(
                f"nanwatch: stopping after batch_number={self.batch_number - 1} as asked by "
                f"abort_after_batch_num={limit}",
                batch_number=self.batch_number - 1,
            )

    def _say_if_nothing_recorded(self) -> None:
        """A watched training batch that recorded no frame at all: say so, once, and why as far as it is known: the
        hooks were removed (nanwatch raised, or the watcher was closed), code compiled by torch.compile before watching
        began ran the model (a compiled training step runs no hook added later), or no training forward of the model
        ran (none at all, or only in eval mode)."""
        recorded, self._batch_recorded = self._batch_recorded, False
        if recorded or self._told_nothing_recorded or not self._recording or self.config.mode != "full":
            return
        batch = f"batch_number={self.batch_number}"
        if not self.attached:
            if self._hooked:  # the hooks are gone: close(), or the adapter's own cleanup when nanwatch raised
                self._told_nothing_recorded = True
                self._warn(
                    "nanwatch: the batches since nanwatch raised (or was closed) are not watched: its hooks went with "
                    "the error. Watch the model again (nanwatch.watch) to go on watching. (Said once.)"
                )
            return
        if not self._modules:
            return
        self._told_nothing_recorded = True
        if compiled_anything():
            self._warn(
                f"nanwatch: no watched module recorded anything during {batch}. If the model runs inside code "
                "compiled by torch.compile before watching began, that code runs no hook added later: start watching "
                "before the first compiled call, or call torch._dynamo.reset() after starting to watch. (Said once.)"
            )
        else:
            self._warn(
                f"nanwatch: no watched module recorded anything during {batch}: no forward of the watched model ran "
                "in training mode since the previous batch ended (a forward in eval mode is not watched unless "
                "watch_eval=True). (Said once.)"
            )

    def agreement_point(self, *, hold: bool = True) -> None:
        """Check now (before backward, say) rather than at the end of the micro-batch; a detection raises as in
        `end_batch()` (`hold=False`: at once, on every rank that meets this check)."""
        self._settle(hold=hold)

    def on_optimizer_step(
        self,
        stage: OptimizerStage,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        optimizer_step: int | None | _Keep = KEEP,
    ) -> None:
        """An optimizer step is at `stage`: "guarded" (the adapter will report "before" for each of its steps),
        "before" it applies the gradients (the recorded frames and the gradients are checked, and every rank agrees:
        a step that would apply inf/nan never runs), "after" it ran (counted), or "settled" (the loss scaler decided
        the last micro-batch's step). `optimizer_step`: the framework's own count of completed steps, if it keeps one.
        """
        self._set_counters(optimizer_step, KEEP)
        if stage == "guarded":
            self._guarded = True
            if optimizer is not None:
                self._guarded_optimizers.add(optimizer)
            return
        self._dispatch("on_optimizer_step", stage, optimizer)
        if stage == "before":
            self._settle(hold=False)
        elif stage == "after" and optimizer_step is KEEP:
            self.optimizer_step = 1 if self.optimizer_step is None else self.optimizer_step + 1

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Record a loss computed outside the watched modules as a frame of its own (module `(loss)`)."""
        if not self._recording or not isinstance(loss, torch.Tensor):
            return
        if self._last_loss is not None and self._last_loss() is loss:  # told twice (the user and the adapter)
            return
        try:
            self._last_loss = weakref.ref(loss)
            with torch.no_grad():
                entry = Entry("loss", Role.LOSS, self._cache.measure(loss))
            self._pending.append(Frame("(loss)", type(loss).__name__, self.current_batch, self._phase, [entry]))
        except Exception as error:  # our bookkeeping must never kill a healthy run
            self._disable(f"recording the loss failed: {error!r}")

    def watch_scaler(
        self, scaler: GradScalerLike, *, read_scale: Literal["at_batch_end", "when_settled"] = "at_batch_end"
    ) -> None:
        """Follow a `torch.amp.GradScaler`: inf/nan gradients on steps it skips are expected (core/features/
        loss_scale.py). `read_scale`: when its scale is read, as each micro-batch ends or at the "settled" stage.

        Raises:
            TypeError: `scaler` is not a GradScaler.
        """
        self._feature(LossScaleFeature).on_scaler(self._ctx, scaler, read_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_number": self.batch_number,
            "eval_batch_number": self.eval_batch_number,
            "optimizer_step": self.optimizer_step,
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch_number = self._counter("batch_number", state["batch_number"]) or 0
        self.eval_batch_number = self._counter("eval_batch_number", state.get("eval_batch_number", 0)) or 0
        self.optimizer_step = self._counter("optimizer_step", state.get("optimizer_step"))
        self.epoch = self._counter("epoch", state.get("epoch"))
        self._update_tracing()

    # ------------------------------------------------------------------------------------------ what to read

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def current_batch(self) -> int:
        return self.batch_number if self._phase == "train" else self.eval_batch_number

    @property
    def recording(self) -> bool:
        return self._recording

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

    @property
    def loss_scale(self) -> LossScaleMonitor | None:
        """The scaler follower (its `history()`, `overflows`), or None without a scaler."""
        return self._feature(LossScaleFeature).monitor

    @property
    def headroom(self) -> HeadroomMonitor | None:
        """The headroom feature (its findings and `summary()`), or None where it is off."""
        found = self._find(HeadroomMonitor)
        return found if found is not None and found.active else None

    def summary(self) -> Summary | None:
        """Abs max per watched module in the last training batch checked clean (reads its numbers back), or None."""
        return self._feature(SummaryFeature).summary()

    @property
    def summary_sink(self) -> Callable[[Summary], None] | None:
        """Where a due summary goes: the "nanwatch" logger by default; adapters send it to their framework."""
        return self._feature(SummaryFeature).sink

    @summary_sink.setter
    def summary_sink(self, sink: Callable[[Summary], None] | None) -> None:
        self._feature(SummaryFeature).sink = sink

    def recent_frames(self) -> list[Frame]:
        """The ring's frames followed by those not yet checked (for tests and tools)."""
        return self._ring.frames() + list(self._pending)

    def check(self) -> Report | None:
        """Check the pending frames on this rank alone (one host read); a report if they hold inf/nan."""
        return self._check_safely()

    # ----------------------------------------------------------------------------------------- the hot path

    def _make_hook(self, name: str, class_name: str) -> Any:
        prefix, kernels, record = frame_key(self._sink.token, name, class_name), self._cache.kernels, self._record
        recomputes_shown = self.config.watch_gradients
        known = _ParameterLines()  # this module's parameter lines, made once per batch (`_record`)

        def forward_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self._recording:
                return
            if _is_compiling():
                # Dynamo is tracing this hook: the statistics go into the graph, the bookkeeping runs after each call
                # of it (core/stats/compiled.py).
                record_call(prefix, module, args, kwargs, output, kernels)
                return
            # A recompute of activation checkpointing (during backward) repeats a call already recorded, not a new
            # one: it is part of the backward story, shown with it (watch_gradients) as a frame marked `(recompute)`.
            direction = _FORWARD
            if _graph_task_id() != -1:  # `recomputing()`, asked here without a second `_is_compiling()`
                if not recomputes_shown:
                    return
                direction = _RECOMPUTE
            try:
                record(name, class_name, module, args, kwargs, output, known, direction)
            except Exception as error:  # our bookkeeping must never kill a healthy run
                self._disable(f"recording {name or type(module).__name__} failed: {error!r}")

        return forward_hook

    def _record(
        self,
        name: str,
        class_name: str,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        known: _ParameterLines,
        direction: Direction,
    ) -> None:
        # Runs after every module's forward, right after heavy kernels have flushed the CPU caches, where each
        # Python operation costs several times what it costs in isolation: keep the work per call minimal. No
        # `torch.no_grad()` here: measuring works on detached tensors, so it never builds a graph anyway.
        cache = self._cache
        params = module._parameters
        entries = known.lines(params, cache) if params else []
        activation = cache.activation
        for index, value in enumerate(args):
            label = _INPUT_LABELS[index] if index < len(_INPUT_LABELS) else f"input[{index}]"
            if isinstance(value, torch.Tensor):
                entries.append(Entry(label, _INPUT, activation(value)))
            else:
                self._add_leaves(entries, value, label, _INPUT)
        if kwargs:
            self._add_keyword_inputs(entries, kwargs)
        if isinstance(output, torch.Tensor):
            entries.append(Entry("output", _OUTPUT, activation(output)))
        else:
            self._add_leaves(entries, output, "output", _OUTPUT)
        phase = self._phase
        batch = self.batch_number if phase == "train" else self.eval_batch_number
        frame = Frame(name, class_name, batch, phase, entries, direction)
        self._pending.append(frame)
        if self._tracing:
            self._dispatch("on_frame", frame, module, args, output)
        if len(self._pending) > _MAX_PENDING_FRAMES:
            self._commit_if_clean()

    def _add_keyword_inputs(self, entries: list[Entry], kwargs: dict[str, Any]) -> None:
        """Keyword inputs, labelled `input.<name>`: their tensors only (None, flags and sizes get no line, so a
        frame has the lines transformers' tool prints, and the keyword tensors after them)."""
        activation = self._cache.activation
        for keyword, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                entries.append(Entry("input." + keyword, _INPUT, activation(value)))
            elif not isinstance(value, _PLAIN_VALUES):
                for leaf_label, leaf in walk(value, "input." + keyword):
                    if isinstance(leaf, torch.Tensor):
                        entries.append(Entry(leaf_label, _INPUT, activation(leaf)))

    def _add_leaves(self, entries: list[Entry], value: Any, label: str, role: Role) -> None:
        activation = self._cache.activation
        if type(value) is tuple and len(value) <= len(_ITEM_SUFFIXES):
            # The common case (attention blocks return `(hidden, None)`): a flat tuple of tensors and Nones needs
            # no walk. Anything else in it, and the whole value is walked as usual (the same labels: core/walk.py).
            flat = []
            for index, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    flat.append(Entry(label + _ITEM_SUFFIXES[index], role, activation(item)))
                elif item is None:
                    flat.append(Entry(label + _ITEM_SUFFIXES[index], role, note="None"))
                else:
                    break
            else:
                entries.extend(flat)
                return
        for leaf_label, leaf in walk(value, label):
            if isinstance(leaf, torch.Tensor):
                entries.append(Entry(leaf_label, role, activation(leaf)))
            elif leaf is None:
                entries.append(Entry(leaf_label, role, note="None"))
            elif isinstance(leaf, TooDeep):
                entries.append(Entry(leaf_label, role, note="nested too deep"))
            elif isinstance(leaf, TooMany):
                entries.append(Entry(leaf_label, role, note="not shown"))
            else:
                entries.append(Entry(leaf_label, role, note="not a tensor"))

    # --------------------------------------------------------------------------------------- torch.compile

    def outside_graph(
        self, module: torch.nn.Module, hook: Callable[..., Any], *placeholders: Any
    ) -> Callable[..., Any]:
        """An adapter's `hook` on `module` (bookkeeping, no code for a graph), as a hook a compiled graph does not
        trace: dynamo puts one call of nanwatch's operator in its place, and the hook runs, outside the graph, when
        the graph gets there (given `placeholders` for the arguments after the module, which the graph does not
        hand over). A torch.nn container compiled whole (`torch.compile(nn.Sequential(...))`) traces its hooks; the
        root of a user's model runs them as frames of their own, which dynamo compiles too."""
        key = marker_key(self._sink.token, len(self._outside))
        self._outside.append(lambda: hook(module, *placeholders))

        def outside(called: torch.nn.Module, *args: Any) -> Any:
            if _is_compiling():
                record_marker(key)
                return None
            return hook(called, *args)

        return outside

    def _take_compiled(self, key: str, values: list[torch.Tensor], sizes: list[int]) -> None:
        """A record of a hook call inside a compiled graph, handed over as the graph runs (core/stats/compiled.py):
        the frame the eager hook would have made, or an adapter hook noted there (`outside_graph`)."""
        template = frame_template(key)
        if template.marker is not None:
            self._outside[template.marker]()  # an adapter's own hook: its errors are the adapter's, as in eager mode
            return
        if not self._recording:  # stopped (disabled, an unwatched batch) since the graph began
            return
        try:
            entries = []
            for leaf, found in zip(template.leaves, measurements(template, values, sizes), strict=True):
                if isinstance(found, str):
                    entries.append(Entry(leaf.label, _ROLES[leaf.role], note=found))
                else:
                    entries.append(Entry(leaf.label, _ROLES[leaf.role], found))
            phase = self._phase
            batch = self.batch_number if phase == "train" else self.eval_batch_number
            frame = Frame(template.module_name, template.class_name, batch, phase, entries)
            self._pending.append(frame)
            if self._tracing:
                self._dispatch("on_frame", frame, self._modules[frame.module_name], (), None)
            if len(self._pending) > _MAX_PENDING_FRAMES:
                self._commit_if_clean()
        except NanwatchError:
            raise
        except Exception as error:  # our bookkeeping must never kill a healthy run
            self._disable(f"recording {template.module_name or template.class_name} (compiled) failed: {error!r}")

    # ------------------------------------------------------------------------------------------ the check

    def _check(self) -> Report | None:
        """Look at the frames recorded since the last check (one host read per device); a report if any holds
        inf/nan. Clean frames move into the ring."""
        pending = self._pending
        if pending and not self._batch_recorded:
            self._batch_recorded = any(frame.module_name != "(loss)" for frame in pending)
        non_finite, tripped = self._screen(pending, features=True)
        # Only a micro-batch whose forward was recorded can say its forward was finite (not one that
        # watch_every_n_batches or include_modules left unwatched, nor one whose hooks are gone).
        self._frames_finite = not non_finite and self._batch_recorded
        found = None
        for feature in tripped:  # a feature's own flag: it reads what it needs, warns, or reports (the guard)
            if non_finite and not feature.detects:
                continue
            report = feature.review(self._ctx, pending)
            if report is not None:  # several findings: one report, every section
                found = report if found is None else found.with_sections(report.sections)
        if not non_finite:
            self._commit(pending)
            return found
        self._pending = []
        self._cache.forget_activations()
        report = self._report_of(pending)
        if report is not None and found is not None:  # the frames lead; the features' findings come with them
            report = report.with_sections(found.sections)
        return report or found

    def _screen(self, frames: Sequence[Frame], *, features: bool) -> tuple[bool, list[Feature]]:
        """Whether any float abs max in `frames` is inf/nan, and which features' flags tripped: one read per device."""
        maxima = stack_maxima(entry.measurement for frame in frames for entry in frame.entries if entry.measurement)
        flags: list[tuple[torch.Tensor, Feature | None]] = [(torch.isfinite(s).all(), None) for s in maxima.values()]
        for feature in self._features if features else ():
            flags += [(flag, feature) for flag in feature.screen(self._ctx, frames, maxima)]
        tripped = read_flags(flags)
        return None in tripped, list(dict.fromkeys(owner for owner in tripped if owner is not None))

    def _report_of(self, frames: Sequence[Frame]) -> Report | None:
        """The report of `frames` (read back), ending at the first non-finite frame, earlier frames from the ring."""
        resolved = resolve(frames)
        first = next((index for index, frame in enumerate(resolved) if frame.non_finite), None)
        if first is None:
            return None
        size = self.config.max_frames_to_save
        earlier = resolve(self._ring.last(size - (first + 1)))
        first_frame = frames[first]
        report = Report(
            batch_number=first_frame.batch_number,
            phase=first_frame.phase,
            rank=self.rank,
            world_size=self.world_size,
            module_name=first_frame.module_name,
            frames=earlier + resolved[max(0, first + 1 - size) : first + 1],
            optimizer_step=self.optimizer_step,
            epoch=self.epoch,
        )
        for feature in self._features:
            report = feature.annotate(self._ctx, report, resolved, first)
        return report

    def _detection_report(self, section: ReportSection, module_name: str | None) -> Report:
        """A detection a feature made from its own flags: the latest frames for context, and the feature's section."""
        if self._phase == "eval":
            batch = self.eval_batch_number
        else:  # the micro-batch that ran last (a loop may end it before the optimizer steps)
            batch = self.batch_number if self._batch_started or self.batch_number == 0 else self.batch_number - 1
        frames = (self._ring.frames() + self._pending)[-self.config.max_frames_to_save :]
        return Report(
            batch_number=batch,
            phase=self._phase,
            rank=self.rank,
            world_size=self.world_size,
            module_name=module_name,
            frames=resolve(frames),
            optimizer_step=self.optimizer_step,
            epoch=self.epoch,
            sections=(section,),
        )

    def _rerun(self, run: Callable[[], Any], *, batch_number: int, phase: Phase, gradients: bool) -> Report | None:
        """Run `run()` (a forward, maybe a backward, of this model) under a full watch of its own, with this
        engine's hooks out of the way; the report of what it saw, or None when it stayed finite."""
        config = self.config.model_copy(
            update={
                "mode": "full",
                "watch_gradients": gradients,
                "watch_eval": True,
                "trace_batch_nums": [],
                "capture_on_detect": False,
                "report_dir": None,
                "summary_every_n_batches": None,
                "headroom_warn_fraction": None,
                "target_dtype": None,
                "count_underflow": False,
            }
        )
        inner = Watcher(self.model, config, rank=self.rank, world_size=1)  # world_size 1: nothing to agree on
        inner._replaying = True
        inner.load_state_dict({"batch_number": batch_number, "eval_batch_number": batch_number})
        inner.start_batch(phase)
        with self._hooks.suspended():
            inner.attach()
            try:
                run()
                return inner.check()
            finally:
                inner.close(check=False)

    def _commit(self, frames: list[Frame]) -> None:
        self._ring.extend(frames)
        self._dispatch("on_commit", frames)  # references only
        self._pending = []
        self._cache.forget_activations()

    def _commit_if_clean(self) -> None:
        # A micro-batch this long (a loop that never ends its batches): its frames go now, and so does the pause.
        resume_collection()
        report = self._check()
        # Kept for the next check (raising here would skip the collective); the first detection is the one.
        if report is not None and self._held_report is None:
            self._held_report = report

    def _check_safely(self) -> Report | None:
        """The check, judged by the features; a failure in nanwatch itself disables watching instead of propagating."""
        held, self._held_report = self._held_report, None
        if held is not None:
            self._pending = []
            return held
        try:
            for feature in self._features:
                held = feature.held(self._ctx)
                if held is not None:
                    return held
            checked = self._pending
            report = self._check()
            for feature in self._features:
                if report is None:
                    break
                report = feature.judge(self._ctx, report, checked)
            return report
        except Exception as error:
            self._disable(f"checking the recorded frames failed: {error!r}")
            return None

    def _settle(self, *, hold: bool, wait: bool = True) -> None:
        """Check; raise on every rank if this rank or another saw inf/nan. Distributed, a detection may be held
        (published, raised at the optimizer step, where a nan on any rank reaches every rank's gradients)."""
        report = self._check_safely()
        if report is not None and self._detection is None:
            self._detection = report
            # On disk before anything else: once other ranks learn of it they may exit, and a launcher such as
            # torchrun can then kill this process before it gets further. Non-finite gradients alone are what
            # every rank sees after the all-reduce: published only if no rank saw where they came from.
            if self._board is None or _kind(report) == "frames":
                self._publish(report)
                self._published = True
        mine = self._detection
        if mine is None:
            if self._board is not None and self._board.posted_elsewhere():
                self._raise_verdict(None)
            return
        if self._board is None:
            self._raise_detection(mine, Detection(mine.batch_number, self.rank, mine.phase))
        if hold and self._guarded:
            return
        self._raise_verdict(mine, wait=wait)

    def _raise_verdict(self, mine: Report | None, *, wait: bool = True) -> None:
        """Settle with the other ranks on one detection (bounded by `rank_wait_s`) and raise it."""
        assert self._board is not None
        detection = None if mine is None else Detection(mine.batch_number, self.rank, mine.phase, _kind(mine))
        try:
            verdict = self._board.settle(detection, wait=wait)
        except TimeoutError:
            return  # nothing was posted after all: nothing to raise
        except Exception as error:  # the store failed: this rank still stops on what it saw itself
            self.logger.warning(f"nanwatch could not reach the other ranks ({error!r}); raising on this rank")
            if detection is None:
                return
            verdict = detection
        if (
            mine is not None
            and not self._published
            and (verdict.batch_number, verdict.rank) == (mine.batch_number, self.rank)
        ):
            self._publish(mine)
        self._raise_detection(mine, verdict)

    # --------------------------------------------------------------------------------------- report, raise

    def _publish(self, report: Report) -> None:
        """Log the report, then write it to `report_dir`, before anything raises. Nothing here may stop the
        detection from being raised: a failure is warned about, and the rest goes on."""
        self.logger.error("\n" + self._text(report) + "\n")
        if self.config.report_dir is not None:
            try:
                write_report(self.config.report_dir, report)
            except Exception as error:  # a full disk, or a bug in a format: the log has the report already
                self._warn(f"nanwatch could not write the report to {self.config.report_dir}: {error!r}")
        try:
            missed = self._schedule.missed_note(report.batch_number) if report.phase == "train" else None
        except Exception as error:
            missed = None
            self._disable(f"working out which batches went unwatched failed: {error!r}")
        if missed is not None:
            self.logger.warning(missed)
        self._dispatch("on_publish", report)

    def _text(self, report: Report) -> str:
        """The report's text; if rendering it fails (a bug of ours), its header and why, so nothing is lost."""
        try:
            return report.to_text()
        except Exception as error:
            self._disable(f"rendering the report failed: {error!r}")
            return f"{report.header} (nanwatch could not render its frames: {error!r})"

    def _warn(self, message: str) -> None:
        warn(message)  # once: a NanwatchWarning (at the user's line), and the logger's other destinations

    def _raise_detection(self, local: Report | None, agreed: Detection) -> NoReturn:
        """Raise `NonFiniteError`: the same on every rank, for the detecting rank and batch `agreed` names."""
        resume_collection()  # the micro-batch ends here
        self._detection, self._published = None, False  # raised once: it is the caller's now
        self._batch_recorded = False  # a loop that catches this and goes on records nothing more (hooks removed)
        ours = local is not None and (local.batch_number, self.rank) == (agreed.batch_number, agreed.rank)
        mine = local if ours else None
        module_name = mine.module_name if mine is not None else None
        phase = agreed.phase
        counter = "batch_number" if phase == "train" else f"{phase}_batch_number"
        where = f" on rank {agreed.rank}" if self.world_size > 1 else ""
        culprit = mine.culprit if mine is not None else None
        gradient = first_gradient(mine) if mine is not None and _kind(mine) == "gradients" else None
        if gradient is not None:  # no frame held it: the module named is only where the first bad gradient is
            first = f" in the gradients about to be applied (first: {gradient!r})"
            note = born_in_backward(mine) if mine is not None else None
            if note is not None:  # the guard found every forward value of this micro-batch finite
                first += f"; {note}"
        else:
            first = f", first in module {module_name!r}" if module_name is not None else ""
        if culprit is not None:
            first += f": {culprit}"
        shown = "the frames that led there" if gradient is None else "the last frames recorded, then the gradients"
        message = f"nanwatch: inf/nan detected during {counter}={agreed.batch_number}{where}{first}. " + (
            f"The report above shows {shown}." if mine is not None else "See that rank's report."
        )
        raise NonFiniteError(
            message,
            batch_number=agreed.batch_number,
            rank=agreed.rank,
            module_name=module_name,
            report=self._text(mine) if mine is not None else "",
            optimizer_step=self.optimizer_step,
            epoch=self.epoch,
            phase=phase,
            culprit=culprit,
        )

    # ------------------------------------------------------------------------------------------ bookkeeping

    def set_counters(self, *, optimizer_step: int | None | _Keep = KEEP, epoch: int | None | _Keep = KEEP) -> None:
        """The framework's counters as they are now (numpy integers and 0-d tensors are taken as ints)."""
        self._set_counters(optimizer_step, epoch)

    def _set_counters(self, optimizer_step: int | None | _Keep, epoch: int | None | _Keep) -> None:
        if optimizer_step is not KEEP:
            self.optimizer_step = self._counter("optimizer_step", optimizer_step)
        if epoch is not KEEP:
            self.epoch = self._counter("epoch", epoch)

    def _counter(self, name: str, value: object) -> int | None:
        """A counter as a plain int: frameworks hand over numpy integers, 0-d tensors, integral floats."""
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        try:
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, float) and value.is_integer():
                return int(value)
            return operator.index(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            self.logger.warning(f"nanwatch: {name} must be a whole number, got {value!r}; reports leave it out")
            return None

    def _update_tracing(self) -> None:
        try:
            self._tracing = (
                self._phase == "train"
                and self.batch_number in self.config.trace_batch_nums
                and self._ctx.rank_logs(self.config.trace_ranks)
            )
            # At batch boundaries and phase changes only: the hooks test one bool, so an unwatched batch costs nothing.
            watched = self._schedule.watched(self.batch_number) if self._phase == "train" else self.config.watch_eval
        except Exception as error:  # a bug in deciding what to watch must not end the run
            self._disable(f"deciding whether to watch batch_number={self.batch_number} failed: {error!r}")
            return
        self._recording = self._disabled_reason is None and watched

    def _disable(self, reason: str) -> None:
        if self._disabled_reason is not None:
            return
        self._disabled_reason = reason
        self._recording = self._tracing = False
        resume_collection()
        self._pending.clear()
        self._warn(f"nanwatch stopped watching (the run goes on): {reason}")

    def _dispatch(self, event: str, *args: Any) -> None:
        """Run one event on every feature. nanwatch's own errors (a detection, the loss scale's floor) propagate;
        anything else a feature raises is a bug of ours: it disables watching, and the run goes on."""
        for feature in self._features:
            self._safely(f"{feature.name}.{event}", getattr(feature, event), self._ctx, *args)

    def _safely(self, what: str, call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except NanwatchError:
            raise
        except Exception as error:
            self._disable(f"{what} failed: {error!r}")

    def _find(self, kind: type[_F]) -> _F | None:
        return next((feature for feature in self._features if isinstance(feature, kind)), None)

    def _feature(self, kind: type[_F]) -> _F:
        found = self._find(kind)
        if found is None:
            raise LookupError(f"features_for() gave this watcher no {kind.__name__}")
        return found

    def _log_summary(self, summary: Summary) -> None:
        self.logger.info(summary.to_text())


def _held(module: torch.nn.Module | None, ref: weakref.ref[torch.nn.Module], what: str) -> torch.nn.Module:
    found = module if module is not None else ref()
    if found is None:
        raise ReferenceError(f"nanwatch: the watched {what} no longer exists (this watcher was closed, and let it go)")
    return found


def _hook_code() -> list[types.CodeType]:
    """The code of nanwatch's module hooks, which a compiled root's `_call_impl` calls outside its `forward`."""
    return nested_code(Watcher._make_hook, Watcher.outside_graph)


def _own_code() -> list[types.CodeType]:
    """nanwatch's code that dynamo may have compiled as frames of their own: the hooks and what they call."""
    return [*_hook_code(), record_call.__code__, record_marker.__code__]


class _Read:
    """A read-only view of one engine attribute, for the context below."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, context: _Context, owner: type | None = None) -> Any:
        return getattr(context._engine, self.name)


class _ParameterLines:
    """One module's parameter lines. Made once per batch from the parameters' batch measurements, and used again at
    every later call of the batch; asked of the cache one by one only when a parameter is not tracked, or was changed
    (version counter, storage) or replaced since it was measured. Each call then costs a check of the parameters'
    fingerprints, not a lookup per parameter, and the calls of a batch share the line objects (fewer objects for the
    garbage collector to walk)."""

    __slots__ = ("batch", "entries", "slots", "named")

    def __init__(self) -> None:
        self.batch: TrackedBatch | None = None  # the batch whose measurements `entries` hold
        self.entries: list[Entry] = []
        # Per item of the module's parameter dict: the tensor and where it is among the tracked (-1 for a None); None
        # until made, or when not every parameter is tracked.
        self.slots: list[tuple[torch.Tensor | None, int]] | None = None
        self.named: list[tuple[str, int]] = []

    def lines(self, params: Mapping[str, torch.Tensor | None], cache: StatsCache) -> list[Entry]:
        slots = self.slots
        if slots is not None:
            batch = cache.tracked_batch()
            if batch is not None and self._unchanged(params, slots, batch):
                if self.batch is not batch:  # the module's first call of this batch
                    measurements = batch.measurements
                    self.entries = [Entry(name, _PARAMETER, measurements[index]) for name, index in self.named]
                    self.batch = batch
                return self.entries.copy()
        return self._make(params, cache)

    @staticmethod
    def _unchanged(
        params: Mapping[str, torch.Tensor | None], slots: list[tuple[torch.Tensor | None, int]], batch: TrackedBatch
    ) -> bool:
        if len(params) != len(slots):
            return False
        versions, pointers = batch.versions, batch.pointers
        for param, (known, index) in zip(params.values(), slots, strict=True):
            if param is not known:
                return False
            if param is not None and (param._version != versions[index] or param.data_ptr() != pointers[index]):
                return False
        return True

    def _make(self, params: Mapping[str, torch.Tensor | None], cache: StatsCache) -> list[Entry]:
        entries: list[Entry] = []
        slots: list[tuple[torch.Tensor | None, int]] = []
        named: list[tuple[str, int]] = []
        tracked = True
        for name, param in params.items():
            if param is None:
                slots.append((None, -1))
                continue
            entries.append(Entry(name, _PARAMETER, cache.parameter(param)))
            plain = type(param) in _PLAIN_PARAMETERS and param.layout is torch.strided
            index = cache.index_of(param) if plain else None
            if index is None:  # measured apart (an inference or sparse tensor, a DTensor): asked for at every call
                tracked = False
            else:
                slots.append((param, index))
                named.append((name, index))
        self.slots, self.named = (slots if tracked else None), named
        self.batch = None  # these lines may hold a changed parameter's own measurement, not the batch's
        return entries


class _Context:
    """The `EngineContext` features get: a narrow view of one engine (core/events.py)."""

    model, entry, config = _Read("model"), _Read("entry"), _Read("config")
    rank, world_size = _Read("rank"), _Read("world_size")
    logger, hooks, phase, batch_number = _Read("logger"), _Read("hooks"), _Read("phase"), _Read("batch_number")
    current_batch, optimizer_step, epoch = _Read("current_batch"), _Read("optimizer_step"), _Read("epoch")
    recording, tracing, disabled_reason = _Read("recording"), _Read("_tracing"), _Read("disabled_reason")
    guarded, frames_finite = _Read("_guarded"), _Read("_frames_finite")

    def __init__(self, engine: Watcher) -> None:
        self._engine = engine

    def rank_logs(self, ranks: Literal["zero", "all"] | list[int]) -> bool:
        rank = self._engine.rank
        return ranks == "all" or (rank == 0 if ranks == "zero" else rank in ranks)

    def watches_batch(self, batch_number: int) -> bool:
        return self._engine._schedule.watched(batch_number)

    def measure(self, tensor: torch.Tensor) -> Measurement:
        return self._engine._cache.measure(tensor)

    def add_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        engine = self._engine
        engine._pending.append(frame)
        if engine._tracing:
            engine._dispatch("on_frame", frame, module, (), None)
        if len(engine._pending) > _MAX_PENDING_FRAMES:
            engine._commit_if_clean()

    def trace_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        if self._engine._tracing:
            self._engine._dispatch("on_frame", frame, module, (), None)

    def is_last_pending(self, frame: Frame) -> bool:
        pending = self._engine._pending
        return bool(pending) and pending[-1] is frame

    def detection_report(self, section: ReportSection, module_name: str | None) -> Report:
        return self._engine._detection_report(section, module_name)

    def rerun(self, run: Callable[[], Any], *, batch_number: int, phase: Phase, gradients: bool) -> Report | None:
        return self._engine._rerun(run, batch_number=batch_number, phase=phase, gradients=gradients)

    def report_for(self, frames: Sequence[Frame]) -> Report | None:
        engine = self._engine
        return engine._report_of(frames) if engine._screen(frames, features=False)[0] else None

    def keep_as_context(self, frames: Iterable[Frame]) -> None:
        self._engine._ring.extend(frames)

    def publish(self, report: Report) -> None:
        self._engine._publish(report)

    def disable(self, reason: str) -> None:
        self._engine._disable(reason)
