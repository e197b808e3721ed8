"""The framework-neutral engine: record frames from forward hooks, check them once per batch, report, stop.

Adapters (the plain loop, Lightning, Accelerate, the HF Trainer) only decide *when* a batch ends, which phase a
forward belongs to, and what the framework's counters are; everything else lives here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch

from nanwatch.core.amp import GradScalerLike, LossScaleMonitor
from nanwatch.core.capture import ReplayCapture
from nanwatch.core.config import WatchConfig
from nanwatch.core.culprit import Culprit, find_culprit
from nanwatch.core.frames import Entry, Frame, FrameRing, ResolvedFrame, find_non_finite, resolve
from nanwatch.core.gradients import GradientRecorder, is_backward_frame
from nanwatch.core.headroom import HeadroomMonitor, monitor_for
from nanwatch.core.hooks import HookSet, named_unique_modules
from nanwatch.core.jsonl import count_non_finite, trace_records
from nanwatch.core.log import get_logger
from nanwatch.core.output import append_trace, append_trace_records, write_report
from nanwatch.core.ranks import GlobalDetection, agree_on_detection, world_size_and_rank
from nanwatch.core.report import TABLE_HEADER, Report, format_batch_start, format_frame
from nanwatch.core.scope import BatchSchedule, select_modules
from nanwatch.core.stats import StatsCache, measure
from nanwatch.core.summary import Summary, SummaryCollector
from nanwatch.core.walk import TooDeep, TooMany, walk
from nanwatch.errors import BatchLimitReached, NanwatchWarning, NonFiniteError

__all__ = ["Watcher", "PHASES"]

PHASES = ("train", "eval")
# A loop that never ends its batches would grow the pending frames without bound; past this many, check and commit.
_MAX_PENDING_FRAMES = 100_000
# Labels built once rather than formatted at every module call.
_INPUT_LABELS = tuple(f"input[{index}]" for index in range(16))
_ITEM_SUFFIXES = tuple(f"[{index}]" for index in range(16))


class Watcher:
    """Records what every module of `model` sees and finds the first inf/nan.

    Args:
        model: the module whose submodules are watched (every one, the root included).
        config: what to watch and report.
        rank: this process's rank; found from torch.distributed when None.
        world_size: the number of processes; found from torch.distributed when None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: WatchConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        found_world_size, found_rank = world_size_and_rank()
        self.model = model
        self.config = config
        self.rank = found_rank if rank is None else rank
        self.world_size = found_world_size if world_size is None else world_size
        self.batch_number = 0
        self.eval_batch_number = 0
        self.optimizer_step: int | None = None
        self.epoch: int | None = None
        self.logger: logging.Logger = get_logger()
        self._phase = "train"
        self._recording = True
        self._ring = FrameRing(config.max_frames_to_save)
        self._pending: list[Frame] = []
        # Headroom by dtype (core/headroom.py): None when the config asks for none of it, or this rank does not log.
        self._headroom: HeadroomMonitor | None = monitor_for(
            config,
            logger=self.logger,
            rank=self.rank,
            world_size=self.world_size,
            logs=self._rank_traces(config.trace_ranks),
        )
        self._cache = StatsCache(None if self._headroom is None else self._headroom.counter)
        self._hooks = HookSet()
        self._disabled_reason: str | None = None
        self._tracing = False
        self._traced_batch_started = False
        self._traced_batch = -1  # the batch whose trace header was written, and how many of its frames
        self._traced_frames = 0
        self._held_report: Report | None = None
        self._agreed_this_batch = False
        self._capture: ReplayCapture | None = None  # only with capture_on_detect: off, it costs nothing
        self._gradients: GradientRecorder | None = None  # only with watch_gradients (see core/gradients.py)
        self._amp: LossScaleMonitor | None = None  # only once watch_scaler() was called (see core/amp.py)
        # False: the adapter reads the loss scale itself with follow_loss_scale() (the plain loop, the HF Trainer).
        self.read_scale_at_batch_end = True
        self.schedule = BatchSchedule(config)
        self._summaries = SummaryCollector(config.summary_every_n_batches)
        # Where a due summary goes; adapters replace it with their framework's logging, or None (no read-back).
        self.summary_sink: Callable[[Summary], None] | None = self._log_summary
        self._update_tracing()

    # ----------------------------------------------------------------------------------------------------- hooks

    def attach(self, modules: Iterable[tuple[str, torch.nn.Module]] | None = None) -> None:
        """Put a forward hook on every module (or on the given `(name, module)` pairs) that the config's scope keeps.

        Raises:
            ConfigError: an `include_modules`/`exclude_modules` pattern matches none of the modules, or together
                they leave none; no hook is added then.
        """
        if len(self._hooks):
            raise RuntimeError("nanwatch: hooks are already attached; call detach() first")
        candidates = modules if modules is not None else named_unique_modules(self.model)
        # Scope is decided here, once: a module left out gets no hook and costs nothing.
        selected = select_modules(candidates, self.config.include_modules, self.config.exclude_modules)
        for name, module in selected:
            self._hooks.add_forward(module, self._make_hook(name, type(module).__name__))
        if self.config.watch_gradients:
            # After the frame hooks: a module's tensors are hooked once its forward frame is recorded.
            self._gradients = GradientRecorder(self)
            self._gradients.attach(selected, self._hooks)
        if self.config.capture_on_detect:
            # After the frame hooks, so on the root its forward hook runs once the root's frame is recorded.
            self._capture = ReplayCapture(self)
            self._capture.attach(self._hooks)

    def detach(self) -> None:
        """Remove every hook nanwatch put on the model; afterwards the model carries none of ours."""
        self._hooks.remove_all()
        if self._gradients is not None:
            self._gradients.detach()  # and the hooks still on live activations: they would outlive the graph's use
            self._gradients = None
        self._cache.clear()
        if self._headroom is not None:
            try:
                self._headroom.close()  # the summary of what came near the limits (and target_dtype's answer)
            except Exception as error:  # closing must never fail because of a summary
                self.logger.warning(f"nanwatch could not summarise headroom: {error!r}")

    @property
    def attached(self) -> bool:
        return len(self._hooks) > 0

    @property
    def hooks(self) -> HookSet:
        """The handles of every hook this watcher owns; adapters add theirs here so `detach()` removes them too."""
        return self._hooks

    def _make_hook(self, name: str, class_name: str) -> Any:
        def forward_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._recording:
                return
            try:
                self._record(name, class_name, module, args, output)
            except Exception as error:  # our bookkeeping must never kill a healthy run
                self._disable(f"recording {name or type(module).__name__} failed: {error!r}")

        return forward_hook

    # ---------------------------------------------------------------------------------------------- recording

    @property
    def phase(self) -> str:
        return self._phase

    def set_phase(self, phase: str) -> None:
        """Say which kind of forward comes next: "train" (counted as batch_number) or "eval" (counted apart)."""
        if phase not in PHASES:
            raise ValueError(f"phase can be one of {PHASES}, got {phase!r}")
        if phase != self._phase:
            # Weights are often swapped through `.data` around evaluation (EMA), which no version counter shows.
            self._cache.forget_parameters()
        self._phase = phase
        self._update_tracing()

    @property
    def recording(self) -> bool:
        return self._recording

    @property
    def current_batch(self) -> int:
        return self.batch_number if self._phase == "train" else self.eval_batch_number

    def _record(self, name: str, class_name: str, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # Runs after every module's forward, right after heavy kernels have flushed the CPU caches, where each
        # Python operation costs several times what it costs in isolation: keep the work per call minimal. No
        # `torch.no_grad()` here: `measure()` works on detached tensors, so it never builds a graph anyway.
        cache = self._cache
        entries: list[Entry] = []
        for param_name, param in module._parameters.items():
            if param is not None:
                entries.append(Entry(param_name, cache.parameter(param)))
        activation = cache.activation
        for index, value in enumerate(args):
            label = _INPUT_LABELS[index] if index < len(_INPUT_LABELS) else f"input[{index}]"
            if isinstance(value, torch.Tensor):
                entries.append(Entry(label, activation(value)))
            else:
                self._add_leaves(entries, value, label)
        if isinstance(output, torch.Tensor):
            entries.append(Entry("output", activation(output)))
        else:
            self._add_leaves(entries, output, "output")
        phase = self._phase
        frame = Frame(
            name, class_name, self.batch_number if phase == "train" else self.eval_batch_number, phase, entries
        )
        self._pending.append(frame)
        if self._tracing:
            self._trace(frame, module, args, output)
        if len(self._pending) > _MAX_PENDING_FRAMES:
            self._commit_if_clean()

    def _add_leaves(self, entries: list[Entry], value: Any, label: str) -> None:
        activation = self._cache.activation
        if type(value) is tuple and len(value) <= len(_ITEM_SUFFIXES):
            # The common case (attention blocks return `(hidden, None)`): a flat tuple of tensors and Nones needs
            # no walk. Anything else in it, and the whole value is walked as usual.
            flat = []
            for index, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    flat.append(Entry(label + _ITEM_SUFFIXES[index], activation(item)))
                elif item is None:
                    flat.append(Entry(label + _ITEM_SUFFIXES[index], note="None"))
                else:
                    break
            else:
                entries.extend(flat)
                return
        for leaf_label, leaf in walk(value, label):
            if isinstance(leaf, torch.Tensor):
                entries.append(Entry(leaf_label, activation(leaf)))
            elif leaf is None:
                entries.append(Entry(leaf_label, note="None"))
            elif isinstance(leaf, TooDeep):
                entries.append(Entry(leaf_label, note="nested too deep"))
            elif isinstance(leaf, TooMany):
                entries.append(Entry(leaf_label, note="not shown"))
            else:
                entries.append(Entry(leaf_label, note="not a tensor"))

    @property
    def tracing(self) -> bool:
        """True while the current batch is traced (every frame logged as it is recorded)."""
        return self._tracing

    def add_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        """Add a frame recorded outside the forward hooks (a backward frame) to the pending frames, and trace it."""
        self._pending.append(frame)
        if self._tracing:
            self.trace_frame(frame, module)
        if len(self._pending) > _MAX_PENDING_FRAMES:
            self._commit_if_clean()

    def trace_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        """Log `frame` to the trace (when tracing) without adding it to the pending frames."""
        if self._tracing:
            self._trace(frame, module, (), None)

    def is_last_pending(self, frame: Frame) -> bool:
        """True when `frame` is the latest frame recorded and not checked yet (so it may still take lines)."""
        return bool(self._pending) and self._pending[-1] is frame

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Record the loss as a frame of its own (module `(loss)`), so a non-finite loss is reported as such.

        Under a `GradScaler` this matters: a loss computed outside the watched modules that is inf makes every
        gradient inf, which would otherwise look like an overflow the scaler handles.
        """
        if not self._recording or not isinstance(loss, torch.Tensor):
            return
        try:
            with torch.no_grad():
                entry = Entry("loss", measure(loss))
            self._pending.append(Frame("(loss)", type(loss).__name__, self.current_batch, self._phase, [entry]))
        except Exception as error:  # our bookkeeping must never kill a healthy run
            self._disable(f"recording the loss failed: {error!r}")

    def _disable(self, reason: str) -> None:
        if self._disabled_reason is not None:
            return
        self._disabled_reason = reason
        self._recording = False
        self._pending.clear()
        message = f"nanwatch stopped watching (the run goes on): {reason}"
        self.logger.warning(message)
        warnings.warn(message, NanwatchWarning, stacklevel=3)

    @property
    def disabled_reason(self) -> str | None:
        """Why watching stopped after an internal failure, or None while it works."""
        return self._disabled_reason

    # ------------------------------------------------------------------------------------------------ tracing

    def _update_tracing(self) -> None:
        tracing = (
            self._phase == "train"
            and self.batch_number in self.config.trace_batch_nums
            and self._rank_traces(self.config.trace_ranks)
        )
        if tracing and not self._tracing:
            self._traced_batch_started = False
        self._tracing = tracing
        self._update_recording()

    def _update_recording(self) -> None:
        # At batch boundaries and phase changes only: the hooks test one bool, so an unwatched batch costs nothing.
        watched = self.schedule.watched(self.batch_number) if self._phase == "train" else self.config.watch_eval
        self._recording = self._disabled_reason is None and watched

    def watches_batch(self, batch_number: int) -> bool:
        """True when training batch `batch_number` is recorded (`watch_every_n_batches`, the window, tracing)."""
        return self.schedule.watched(batch_number)

    def _rank_traces(self, ranks: str | list[int]) -> bool:
        if ranks == "all":
            return True
        if ranks == "zero":
            return self.rank == 0
        return self.rank in ranks

    def _trace(self, frame: Frame, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        lines = []
        # Each traced batch opens with its own header, consecutive ones (149 and 150) included.
        if not self._traced_batch_started or frame.batch_number != self._traced_batch:
            self._traced_batch_started = True
            self._traced_batch = frame.batch_number
            self._traced_frames = 0
            lines += [format_batch_start(frame.batch_number, self.rank, self.world_size), TABLE_HEADER]
        resolved = resolve([frame])[0]
        lines.append(format_frame(resolved))
        text = "\n".join(lines)
        self.logger.info(text)
        if self.config.report_dir is not None:
            append_trace(self.config.report_dir, self.rank, text)
            # The tensors are alive only now: count nan/inf of the non-finite lines (tracing only, never untraced).
            counts = count_non_finite(resolved, module, args, output)
            records = trace_records(
                resolved,
                frame_index=self._traced_frames,
                rank=self.rank,
                world_size=self.world_size,
                optimizer_step=self.optimizer_step,
                epoch=self.epoch,
                counts=counts,
            )
            append_trace_records(self.config.report_dir, self.rank, records)
        self._traced_frames += 1

    # ----------------------------------------------------------------------------------------------- checking

    def check(self) -> Report | None:
        """Look at the frames recorded since the last check (one host sync); return a report if any holds inf/nan.

        Clean frames move into the ring. This is local to the process: use `end_batch()` to agree across ranks.
        """
        pending = self._pending
        if not pending:
            return None
        if not self._holds_non_finite(pending):
            self._commit(pending)
            return None
        resolved = resolve(pending)
        first = next(index for index, frame in enumerate(resolved) if frame.non_finite)
        size = self.config.max_frames_to_save
        earlier_needed = size - (first + 1)
        earlier = resolve(self._ring.frames()[-earlier_needed:]) if earlier_needed > 0 else []
        frames = earlier + resolved[max(0, first + 1 - size) : first + 1]
        self._pending = []
        self._cache.forget_activations()
        first_frame = pending[first]
        return Report(
            batch_number=first_frame.batch_number,
            phase=first_frame.phase,
            rank=self.rank,
            world_size=self.world_size,
            module_name=first_frame.module_name,
            frames=frames,
            optimizer_step=self.optimizer_step,
            epoch=self.epoch,
            culprit=self._find_culprit(resolved, first),
        )

    def _holds_non_finite(self, pending: list[Frame]) -> bool:
        """inf/nan in `pending`? One read per device. With headroom checks, that same read also flags values near a
        dtype's limits; those are warned about (reading their numbers only then) and are no detection."""
        headroom = self._headroom
        if headroom is None:
            return find_non_finite(pending)
        return headroom.suspicious(pending) and headroom.review(pending)

    def _find_culprit(self, resolved: list[ResolvedFrame], first: int) -> Culprit | None:
        try:
            return find_culprit(resolved, first)
        except Exception as error:  # the report matters more than its last line
            self.logger.warning(f"nanwatch could not name the first culprit: {error!r}")
            return None

    @property
    def headroom(self) -> HeadroomMonitor | None:
        """The headroom monitor (its findings and `summary()`), or None when no headroom check is configured."""
        return self._headroom

    def _commit(self, frames: list[Frame]) -> None:
        self._ring.extend(frames)
        self._summaries.collect(frames)  # references only; read back at the summary interval
        self._pending = []
        self._cache.forget_activations()

    def _commit_if_clean(self) -> None:
        report = self.check()
        # Keep it for the next end_batch() (raising here would skip the collective); the first detection is the one.
        if report is not None and self._held_report is None:
            self._held_report = report

    def check_safely(self) -> Report | None:
        """`check()`, but a failure in nanwatch itself disables watching instead of propagating."""
        held, self._held_report = self._held_report, None
        if held is not None:
            self._pending = []
            return held
        if self._amp is not None:
            fatal = self._amp.take_fatal()  # an overflow on a step the scaler did not skip
            if fatal is not None:
                return fatal
        try:
            return self.check() if self._amp is None else self._check_under_scaler(self._amp)
        except Exception as error:
            self._disable(f"checking the recorded frames failed: {error!r}")
            return None

    def _check_under_scaler(self, amp: LossScaleMonitor) -> Report | None:
        # Inf/nan first in gradients, and nowhere in the forward, may be an overflow the scaler skips (core/amp.py).
        pending = list(self._pending)
        report = self.check()
        if report is None or not amp.enabled:
            return report
        # check() ends the report's frames at the first frame holding inf/nan.
        if not report.frames or not is_backward_frame(report.frames[-1]):
            return amp.annotate(report)
        forward = [frame for frame in pending if not is_backward_frame(frame)]
        if forward and find_non_finite(forward):  # one more read, on the rare overflow path only
            # A later forward (or the loss) holds inf/nan too: never the scaler's doing, and that is the report.
            self._pending = forward
            fatal = self.check()
            return None if fatal is None else amp.annotate(fatal)
        self._ring.extend(pending)  # the overflow's frames stay as context for later reports
        return amp.gradient_overflow(report)

    def agree(self, local: Report | None) -> GlobalDetection | None:
        """One all-reduce (when distributed) so that every rank learns of the first detection on any rank."""
        return agree_on_detection(None if local is None else local.batch_number, self.rank, self.world_size)

    def check_and_agree(self) -> None:
        """Check locally, agree across ranks, and raise `NonFiniteError` on every rank if any rank saw inf/nan."""
        if self._nothing_to_agree():
            return
        local = self.check_safely()
        if local is not None:
            # On disk before the collective: once other ranks learn of it they may exit, and a launcher such as
            # torchrun can then kill this process before it gets further.
            self.publish(local)
        agreed = self.agree(local)
        if agreed is not None:
            self.raise_detection(local, agreed, published=True)

    def publish(self, report: Report) -> None:
        """Write the report to `report_dir` (first: it must be on disk before anything raises), then log it."""
        text = report.to_text()
        if self.config.report_dir is not None:
            try:
                write_report(self.config.report_dir, report)
            except OSError as error:
                self.logger.warning(f"nanwatch could not write the report to {self.config.report_dir}: {error}")
        self.logger.error("\n" + text + "\n")
        if report.phase == "train":
            missed = self.schedule.missed_note(report.batch_number)
            if missed is not None:
                self.logger.warning(missed)
        if self._capture is not None:
            self._capture.save(report)  # never raises; the replay file is on disk before the detection is raised

    def raise_detection(self, local: Report | None, agreed: GlobalDetection, *, published: bool = False) -> NoReturn:
        """Publish this rank's report (if it saw inf/nan and `published` is False) and raise `NonFiniteError`.

        Every rank raises the same error: the detecting rank and batch agreed on by `agree()`.
        """
        if local is not None and not published:
            self.publish(local)
        mine = local is not None and local.batch_number == agreed.batch_number and agreed.rank == self.rank
        module_name = local.module_name if mine and local is not None else None
        phase = local.phase if local is not None else self._phase
        counter = "batch_number" if phase == "train" else f"{phase}_batch_number"
        where = f" on rank {agreed.rank}" if self.world_size > 1 else ""
        first = f", first in module {module_name!r}" if module_name is not None else ""
        report_text = local.to_text() if mine and local is not None else ""
        culprit = local.culprit if mine and local is not None else None
        if culprit is not None:
            first += f": {culprit}"
        message = f"nanwatch: inf/nan detected during {counter}={agreed.batch_number}{where}{first}. " + (
            "The report above shows the frames that led there." if report_text else "See that rank's report."
        )
        raise NonFiniteError(
            message,
            batch_number=agreed.batch_number,
            rank=agreed.rank,
            module_name=module_name,
            report=report_text,
            optimizer_step=self.optimizer_step,
            epoch=self.epoch,
            phase=phase,
            culprit=culprit,
        )

    def agreement_point(self) -> None:
        """Check and agree across ranks now, at a point every rank reaches (before backward or the optimizer step).

        Raises `NonFiniteError` on every rank if any rank saw inf/nan. `end_batch()` then skips its own collective
        for this micro-batch, so there is at most one all-reduce per micro-batch.
        """
        self.check_and_agree()
        self._agreed_this_batch = True

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Call before the optimizer applies the gradients: a step that would apply inf/nan never runs.

        Args:
            optimizer: the optimizer about to step; under a `GradScaler`, its `found_inf` says whether an optimizer
                that unscales in its own step (fused Adam) will skip this one.
        """
        self.optimizer_step_applying(optimizer)
        self.agreement_point()

    def optimizer_step_applying(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """An optimizer step is about to run (from its step pre-hook); no collective, nothing raised here.

        Under a `GradScaler`, gradients found non-finite before are then not on a skipped step: the next check (on
        every rank) raises them. Adapters whose agreement point is not in the pre-hook call this one from it.
        """
        if self._amp is not None and self._amp.enabled:
            self._amp.step_applying(optimizer, self.batch_number, self.optimizer_step)

    def after_optimizer_step(self) -> None:
        """Count a completed optimizer step."""
        self.optimizer_step = 1 if self.optimizer_step is None else self.optimizer_step + 1
        if self._amp is not None:
            self._amp.step_done()

    # ------------------------------------------------------------------------------------------- loss scaling

    def watch_scaler(self, scaler: GradScalerLike) -> None:
        """Follow a `torch.amp.GradScaler`: inf/nan gradients on steps it skips are expected (see core/amp.py).

        Raises:
            TypeError: `scaler` is not a GradScaler.
        """
        self._amp = LossScaleMonitor(scaler, self.config.min_loss_scale, self.logger)
        # The first reading: the baseline a first skipped step is seen against (before any scale(), the initial
        # scale, read without touching the device).
        self._amp.observe(self.batch_number, self.optimizer_step)

    @property
    def loss_scale(self) -> LossScaleMonitor | None:
        """The scaler follower (its `history()`, `overflows`), or None without a scaler."""
        return self._amp

    def follow_loss_scale(self, batch_number: int, optimizer_step: int | None = None) -> None:
        """Read the loss scale now (one scalar), put a change on training micro-batch `batch_number`, check the floor.

        `end_batch()` calls it unless `read_scale_at_batch_end` is False, for an adapter that reads the scale itself:
        the plain loop reads it as the next micro-batch starts (after the scaler decided the previous one's step,
        whichever side of it the loop ended that batch), the HF Trainer callback right after each optimizer step.

        Raises:
            LossScaleBelowFloor: the scale is below `min_loss_scale` (on every rank alike), named after `batch_number`.
        """
        amp = self._amp
        if amp is None:
            return
        step = self.optimizer_step if optimizer_step is None else optimizer_step
        try:
            scale = amp.observe(batch_number, step)
        except Exception as failure:  # a scaler we cannot read must not kill a healthy run
            self.logger.warning(f"nanwatch could not read the GradScaler's scale (the run goes on): {failure!r}")
            return
        if scale is None or not amp.below_floor(scale):
            return
        report, error = amp.floor_detection(
            scale,
            batch_number=batch_number,
            rank=self.rank,
            world_size=self.world_size,
            optimizer_step=step,
            epoch=self.epoch,
        )
        self.publish(report)
        # The scale is the same on every rank (the scaler decides from all-reduced gradients), so every rank stops
        # here, at the same batch, without a collective.
        raise error

    def end_eval_batch(self) -> None:
        """An eval forward is over: check it on this rank alone and count it in `eval_batch_number`.

        No collective (evaluation often runs on some ranks only), and the open training micro-batch keeps its
        agreement state, so the training side still runs at most one all-reduce per micro-batch.

        Raises:
            NonFiniteError: this rank saw inf/nan (raised on this rank only).
        """
        local = self.check_safely()
        if local is not None:
            self.raise_detection(local, GlobalDetection(local.batch_number, self.rank))
        self.eval_batch_number += 1

    def end_batch(self, *, agree: bool | None = None) -> None:
        """The current micro-batch is over: check it (and agree across ranks), then advance the phase's counter.

        Args:
            agree: run the check and its collective now. By default, only if no agreement point ran during this
                micro-batch (frames recorded after it stay pending and are checked at the next one).

        Raises:
            NonFiniteError: some rank saw inf/nan in a batch checked now.
            BatchLimitReached: `abort_after_batch_num` was the batch that just ended.
        """
        if agree is None:
            agree = not self._agreed_this_batch
        self._agreed_this_batch = False
        if agree:
            self.check_and_agree()
        if self._phase == "eval":
            self.eval_batch_number += 1
            return
        if self._amp is not None:
            self._amp.step_done()
            if self.read_scale_at_batch_end:
                self.follow_loss_scale(self.batch_number)  # may raise LossScaleBelowFloor, on every rank alike
        self.batch_number += 1
        # The optimizer may have written the weights in a way `_version` does not show (fused kernels, `p.data`).
        self._cache.forget_parameters()
        self._update_tracing()
        self._send_summary_if_due()
        limit = self.config.abort_after_batch_num
        if limit is not None and self.batch_number > limit:
            raise BatchLimitReached(
                f"nanwatch: stopping after batch_number={self.batch_number - 1} as asked by "
                f"abort_after_batch_num={limit}",
                batch_number=self.batch_number - 1,
            )

    def flush(self) -> Report | None:
        """Check what is still pending without any collective (at close): publish a report if there is one."""
        held_by_scaler = self._amp is not None and self._amp.has_fatal  # an overflow on a step the scaler let through
        if (not self._pending and not held_by_scaler) or self._disabled_reason is not None:
            return None
        report = self.check_safely()
        if report is not None:
            self.publish(report)
        return report

    # ------------------------------------------------------------------------------------------ scope, summary

    def _nothing_to_agree(self) -> bool:
        # Inside a stretch of unwatched training batches nothing was recorded, on any rank: skip the check and its
        # collective. Decided from the config and batch_number alone (the previous batch too: frames it recorded
        # after its own agreement point are checked now), so every rank skips the same ones.
        if self._phase != "train" or self.schedule.watches_all:
            return False
        return not self.schedule.watched(self.batch_number) and not self.schedule.watched(self.batch_number - 1)

    def summary(self) -> Summary | None:
        """Abs max per watched module in the last training batch checked clean (reads its numbers back), or None."""
        return self._summaries.summary()

    def _send_summary_if_due(self) -> None:
        sink = self.summary_sink
        if sink is None or self._summaries.every is None:
            return
        try:
            summary = self._summaries.due(self.batch_number)
            if summary is not None:
                sink(summary)
        except Exception as error:  # a logger that fails must not kill a healthy run
            self.logger.warning(f"nanwatch could not send its summary (the run goes on): {error!r}")

    def _log_summary(self, summary: Summary) -> None:
        self.logger.info(summary.to_text())

    # ------------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_number": self.batch_number,
            "eval_batch_number": self.eval_batch_number,
            "optimizer_step": self.optimizer_step,
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_number = int(state["batch_number"])
        self.eval_batch_number = int(state.get("eval_batch_number", 0))
        self.optimizer_step = state.get("optimizer_step")
        self.epoch = state.get("epoch")
        self._update_tracing()

    def recent_frames(self) -> list[Frame]:
        """The ring's frames followed by those not yet checked (for tests and tools)."""
        return self._ring.frames() + list(self._pending)
