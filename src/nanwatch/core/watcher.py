"""The framework-neutral engine: record frames from forward hooks, check them once per batch, report, stop.

Adapters (the plain loop, Lightning, Accelerate, the HF Trainer) only decide *when* a batch ends, which phase a
forward belongs to, and what the framework's counters are; everything else lives here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from typing import Any, NoReturn

import torch

from nanwatch.core.capture import ReplayCapture
from nanwatch.core.config import WatchConfig
from nanwatch.core.frames import Entry, Frame, FrameRing, find_non_finite, resolve
from nanwatch.core.hooks import HookSet, named_unique_modules
from nanwatch.core.jsonl import count_non_finite, trace_records
from nanwatch.core.log import get_logger
from nanwatch.core.output import append_trace, append_trace_records, write_report
from nanwatch.core.ranks import GlobalDetection, agree_on_detection, world_size_and_rank
from nanwatch.core.report import TABLE_HEADER, Report, format_batch_start, format_frame
from nanwatch.core.stats import StatsCache
from nanwatch.core.walk import TooDeep, TooMany, walk
from nanwatch.errors import BatchLimitReached, NanwatchWarning, NonFiniteError

__all__ = ["Watcher", "PHASES"]

PHASES = ("train", "eval")
# A loop that never ends its batches would grow the pending frames without bound; past this many, check and commit.
_MAX_PENDING_FRAMES = 100_000


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
        self._cache = StatsCache()
        self._hooks = HookSet()
        self._disabled_reason: str | None = None
        self._tracing = False
        self._traced_batch_started = False
        self._traced_batch = -1  # the batch whose trace header was written, and how many of its frames
        self._traced_frames = 0
        self._held_report: Report | None = None
        self._agreed_this_batch = False
        self._capture: ReplayCapture | None = None  # only with capture_on_detect: off, it costs nothing
        self._update_tracing()

    # ----------------------------------------------------------------------------------------------------- hooks

    def attach(self, modules: Iterable[tuple[str, torch.nn.Module]] | None = None) -> None:
        """Put a forward hook on every module (or on the given `(name, module)` pairs)."""
        if len(self._hooks):
            raise RuntimeError("nanwatch: hooks are already attached; call detach() first")
        for name, module in modules if modules is not None else named_unique_modules(self.model):
            self._hooks.add_forward(module, self._make_hook(name, type(module).__name__))
        if self.config.capture_on_detect:
            # After the frame hooks, so on the root its forward hook runs once the root's frame is recorded.
            self._capture = ReplayCapture(self)
            self._capture.attach(self._hooks)

    def detach(self) -> None:
        """Remove every hook nanwatch put on the model; afterwards the model carries none of ours."""
        self._hooks.remove_all()
        self._cache.clear()

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
        self._recording = self._disabled_reason is None and (phase == "train" or self.config.watch_eval)
        self._update_tracing()

    @property
    def recording(self) -> bool:
        return self._recording

    @property
    def current_batch(self) -> int:
        return self.batch_number if self._phase == "train" else self.eval_batch_number

    def _record(self, name: str, class_name: str, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        frame = Frame(name, class_name, self.current_batch, self._phase)
        entries = frame.entries
        cache = self._cache
        with torch.no_grad():
            for param_name, param in module._parameters.items():
                if param is not None:
                    entries.append(Entry(param_name, cache.parameter(param)))
            for index, value in enumerate(args):
                if isinstance(value, torch.Tensor):
                    entries.append(Entry(f"input[{index}]", cache.activation(value)))
                else:
                    self._add_leaves(entries, value, f"input[{index}]")
            if isinstance(output, torch.Tensor):
                entries.append(Entry("output", cache.activation(output)))
            else:
                self._add_leaves(entries, output, "output")
        self._pending.append(frame)
        if self._tracing:
            self._trace(frame, module, args, output)
        if len(self._pending) > _MAX_PENDING_FRAMES:
            self._commit_if_clean()

    def _add_leaves(self, entries: list[Entry], value: Any, label: str) -> None:
        for leaf_label, leaf in walk(value, label):
            if isinstance(leaf, torch.Tensor):
                entries.append(Entry(leaf_label, self._cache.activation(leaf)))
            elif leaf is None:
                entries.append(Entry(leaf_label, note="None"))
            elif isinstance(leaf, TooDeep):
                entries.append(Entry(leaf_label, note="nested too deep"))
            elif isinstance(leaf, TooMany):
                entries.append(Entry(leaf_label, note="not shown"))
            else:
                entries.append(Entry(leaf_label, note="not a tensor"))

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
        if not find_non_finite(pending):
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
        culprit = pending[first]
        return Report(
            batch_number=culprit.batch_number,
            phase=culprit.phase,
            rank=self.rank,
            world_size=self.world_size,
            module_name=culprit.module_name,
            frames=frames,
            optimizer_step=self.optimizer_step,
            epoch=self.epoch,
        )

    def _commit(self, frames: list[Frame]) -> None:
        self._ring.extend(frames)
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
        try:
            return self.check()
        except Exception as error:
            self._disable(f"checking the recorded frames failed: {error!r}")
            return None

    def agree(self, local: Report | None) -> GlobalDetection | None:
        """One all-reduce (when distributed) so that every rank learns of the first detection on any rank."""
        return agree_on_detection(None if local is None else local.batch_number, self.rank, self.world_size)

    def check_and_agree(self) -> None:
        """Check locally, agree across ranks, and raise `NonFiniteError` on every rank if any rank saw inf/nan."""
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
        message = (
            f"nanwatch: inf/nan detected during {counter}={agreed.batch_number}{where}{first}. "
            + ("The report above shows the frames that led there." if report_text else "See that rank's report.")
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
        )

    def agreement_point(self) -> None:
        """Check and agree across ranks now, at a point every rank reaches (before backward or the optimizer step).

        Raises `NonFiniteError` on every rank if any rank saw inf/nan. `end_batch()` then skips its own collective
        for this micro-batch, so there is at most one all-reduce per micro-batch.
        """
        self.check_and_agree()
        self._agreed_this_batch = True

    def before_optimizer_step(self) -> None:
        """Call before the optimizer applies the gradients: a step that would apply inf/nan never runs."""
        self.agreement_point()

    def after_optimizer_step(self) -> None:
        """Count a completed optimizer step."""
        self.optimizer_step = 1 if self.optimizer_step is None else self.optimizer_step + 1

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

    def flush(self) -> Report | None:
        """Check what is still pending without any collective (at close): publish a report if there is one."""
        if not self._pending or self._disabled_reason is not None:
            return None
        report = self.check_safely()
        if report is not None:
            self.publish(report)
        return report

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
