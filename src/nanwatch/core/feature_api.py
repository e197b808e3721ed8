"""How features plug into the engine: named events with no-op defaults, and what a feature may read and do.

A feature (core/features/) subclasses `Feature` and overrides the events it cares about, like a Lightning
`Callback`. It never imports the engine: everything it may read or do goes through the `EngineContext` it is handed.
The engine's hot path (one closure per module) dispatches nothing; a feature that needs per-call work registers hooks
of its own through `ctx.hooks` in `attach`.

The events, in the order a micro-batch meets them:

- `attach(ctx, modules)` / `detach(ctx)`: watching starts and ends (the engine removes every hook in `ctx.hooks`).
- `on_frame(ctx, frame, module, args, output)`: a frame was recorded; only while the batch is traced.
- `screen(ctx, pending, maxima)`: device flags (True = fine) folded into the check's single host read.
- `review(ctx, pending)`: one of this feature's flags tripped and no frame is inf/nan: read what it needs, warn, or
  return a detection of its own (the guard: non-finite gradients about to be applied).
- `on_commit(ctx, frames)`: frames were checked clean and moved into the ring.
- `held(ctx)`: a detection the feature held back earlier that must be raised now.
- `annotate(ctx, report, resolved, first)`: add a section to a detection's report.
- `judge(ctx, report, checked)`: raise the report (return it, perhaps changed) or tolerate it (return None).
- `on_publish(ctx, report)`: the report is logged and on disk; the error is about to be raised.
- `on_batch_end(ctx, phase, batch_number)`, `on_optimizer_step(ctx, stage, optimizer)`, `on_scaler(ctx, ...)`.
- `on_loss(ctx, loss)`: the loss of a recorded micro-batch (the spike monitor).
- `on_checkpoint(ctx, state, path, step, write_aside)`: a checkpoint is about to be written (the checkpoint guard).
- `readouts()`: what the feature offers adapters and users (its summary, the loss scale's history).
- `close(ctx)`: watching ended (after `detach`): summaries, release what was held.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch

    from nanwatch.core.config import WatchConfig
    from nanwatch.core.frames import Frame, ResolvedFrame
    from nanwatch.core.readouts import Readout, Summary
    from nanwatch.core.report import Report, ReportSection
    from nanwatch.core.stats.measure import Measurement
    from nanwatch.core.stats.readback import Screened
    from nanwatch.core.torch_glue.hooks import HookSet

__all__ = [
    "KEEP",
    "EngineContext",
    "EngineState",
    "Feature",
    "Kept",
    "OptimizerStage",
    "Phase",
    "QUARANTINE_FOLDER",
    "RunCounters",
    "WriteAside",
]

Phase = Literal["train", "eval"]
# "guarded": an adapter will report "before" for each step of this optimizer; "before": the optimizer is about to
# apply the gradients; "after": its step ran; "settled": the loss scaler has decided the last micro-batch's step and
# updated its scale (the scale can be read); "settling": the same, said from inside a hook (the next micro-batch's
# forward), where the scale is copied on its device and read with the next check instead (no host sync in a hook).
OptimizerStage = Literal["guarded", "before", "after", "settled", "settling"]


class _Keep(enum.Enum):
    KEEP = "keep"


KEEP = _Keep.KEEP  # a counter argument left as it is
Kept: TypeAlias = "int | None | _Keep"  # a counter's new value, or KEEP


# The folder a refused checkpoint is written aside into; each adapter puts it beside the framework's own folders.
QUARANTINE_FOLDER = "nanwatch-quarantine"


@dataclass(frozen=True)
class WriteAside:
    """How an adapter writes a refused checkpoint aside (`checkpoint_guard="quarantine"`): `write(path)` writes it to
    `path` (creating its folder), which the guard puts in `folder`, a folder the framework neither scans for a
    checkpoint to resume from nor rotates."""

    folder: str
    write: Callable[[str], None]


class RunCounters(Protocol):
    """Where the run is, read-only: what a report and an error carry (`watcher.counters`, `ctx.counters`)."""

    @property
    def phase(self) -> Phase:
        """The phase the next frames belong to."""

    @property
    def batch_number(self) -> int:
        """The current (or next) training micro-batch (what transformers' tool calls `batch_number`)."""

    @property
    def eval_batch_number(self) -> int:
        """The current (or next) evaluation micro-batch."""

    @property
    def current_batch(self) -> int:
        """The current micro-batch of the current phase."""

    @property
    def last_batch(self) -> int:
        """The micro-batch that ran last: the current one, except between a training micro-batch's end and the next
        one's start (an adapter may end a micro-batch before its optimizer step)."""

    @property
    def optimizer_step(self) -> int | None:
        """The optimizer steps done: the framework's own count where it keeps one."""

    @property
    def epoch(self) -> int | None:
        """The framework's epoch, where it keeps one."""


class EngineState(Protocol):
    """What both a feature (`EngineContext`) and an adapter (`core/contract.py`) may read of the engine."""

    @property
    def model(self) -> torch.nn.Module:
        """The watched model (inside a DDP or torch.compile wrapper)."""

    @property
    def config(self) -> WatchConfig:
        """The run's config (read-only)."""

    @property
    def logger(self) -> logging.Logger:
        """The "nanwatch" logger."""

    @property
    def hooks(self) -> HookSet:
        """Where hook handles go, so that closing the engine removes them with its own."""

    @property
    def counters(self) -> RunCounters:
        """Where the run is: the phase and the micro-batch, optimizer-step and epoch counters (read-only)."""

    @property
    def recording(self) -> bool:
        """False in an unwatched batch, a phase not watched, or once watching was disabled."""

    @property
    def disabled_reason(self) -> str | None:
        """Why watching stopped after a failure of nanwatch's own, or None while it works."""


class EngineContext(EngineState, Protocol):
    """What a feature may read and do. The engine hands one to every event."""

    @property
    def entry(self) -> torch.nn.Module:
        """The module the user calls: `model`, or a wrapper of it (DDP, torch.compile)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...

    @property
    def guarded(self) -> bool:
        """An adapter checks before each optimizer step (core/features/guard.py)."""

    @property
    def frames_finite(self) -> bool:
        """In `review`: whether the micro-batch's forward was recorded and every frame of this check is finite (the
        feature's own flags tripped alone)."""

    @property
    def decided_on_device(self) -> bool:
        """At an optimizer step's "after": this step's check was handed to the optimizer as its `found_inf` and is
        read when the next step is about to run (what it covers must be kept until then)."""

    @property
    def tracing(self) -> bool:
        """True while the current batch is traced."""

    @property
    def summary_sink(self) -> Callable[[Summary], None] | None:
        """Where a due summary goes: the logger by default, an adapter's framework logger, or nowhere (None)."""

    def rank_logs(self, ranks: Literal["zero", "all"] | list[int]) -> bool:
        """Whether this rank is one of `ranks` (as `trace_ranks` names them)."""

    def read(self, readout: Readout[Callable[[], Any]]) -> Any:
        """What another feature offers under `readout` (core/readouts.py), or None where none does."""

    def watches_batch(self, batch_number: int) -> bool:
        """Whether training batch `batch_number` is recorded."""

    def weights_changed(self) -> bool:
        """Whether a watched weight changed in place since this micro-batch measured the weights (an optimizer step
        that ran before the check); False where the weights were not measured this micro-batch."""

    def measure(self, tensor: torch.Tensor) -> Measurement:
        """Launch the run's statistics on a tensor (nothing remembered, no host sync)."""

    def add_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        """Add a frame recorded outside the forward hooks (a backward frame) to the pending frames, and trace it."""

    def trace_frame(self, frame: Frame, module: torch.nn.Module) -> None:
        """Trace lines that join a frame already pending (when tracing), without adding a frame."""

    def is_last_pending(self, frame: Frame) -> bool:
        """True when `frame` is the latest pending frame (so later lines may still join it)."""

    def report_for(self, frames: Sequence[Frame]) -> Report | None:
        """The report of `frames` if one holds inf/nan (one read), annotated by every feature; nothing committed."""

    def detection_report(self, section: ReportSection, module_name: str | None) -> Report:
        """A report of a detection a feature made from its own flags (the current micro-batch): the latest frames
        for context, then `section`."""

    def rerun(
        self,
        run: Callable[[], Any],
        *,
        batch_number: int,
        phase: Phase,
        gradients: bool,
        frames: list[ResolvedFrame] | None = None,
    ) -> Report | None:
        """Run `run()` (a forward, maybe a backward, of the model) again under a full watch of its own, this
        engine's hooks out of the way; the full report of what it saw, or None when it stayed finite. `frames`, when
        given, receives every frame the run recorded, read back."""

    def keep_as_context(self, frames: Iterable[Frame]) -> None:
        """Put frames into the ring, as earlier frames for later reports."""

    def publish(self, report: Report) -> None:
        """Log the report, write it to `report_dir`, tell the features; before anything raises."""

    def disable(self, reason: str) -> None:
        """Stop watching (the run goes on) after a failure in nanwatch itself, with a `NanwatchWarning`."""


class Feature:
    """Base class of the engine's plug-ins: every event is a no-op until overridden."""

    name = "feature"
    # A feature whose flags are detections of their own (the guard's gradients, the sentinel's sums): its findings
    # join the report even when a frame holds inf/nan too. Other features' flags (headroom) are about clean batches.
    detects = False

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        """Watching starts on `modules` (the scope's choice); register hooks through `ctx.hooks`."""

    def detach(self, ctx: EngineContext) -> None:
        """Watching stops; the engine removes the hooks in `ctx.hooks` itself."""

    def on_frame(
        self, ctx: EngineContext, frame: Frame, module: torch.nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        """A frame was recorded while tracing (`args` and `output` are empty for a frame made outside a forward)."""

    def screen(
        self, ctx: EngineContext, pending: Sequence[Frame], maxima: Mapping[tuple[Any, Any], torch.Tensor]
    ) -> Sequence[Screened]:
        """What this feature asks the check to look at, read with the check's one host read: 0-d bool flags (True =
        fine), or values that are all finite when fine (a float tensor, or a list of 0-d float tensors: the check
        folds every part of one dtype into one reduction, so hand over what was computed, not a flag made of it).

        Args:
            pending: the frames of this check.
            maxima: the floating-point abs maxima of `pending`, stacked by `(device, dtype of the tensor)`.
        """
        return []

    def review(self, ctx: EngineContext, pending: Sequence[Frame]) -> Report | None:
        """A flag of this feature tripped and no abs max is inf/nan: read what is needed and warn, or return a
        detection (a report, raised as any other)."""
        return None

    def on_commit(self, ctx: EngineContext, frames: Sequence[Frame]) -> None:
        """`frames` were checked clean (references only: nothing here may read the device)."""

    def held(self, ctx: EngineContext) -> Report | None:
        """A detection held back earlier that is to be raised now, once; None when there is none."""
        return None

    def annotate(self, ctx: EngineContext, report: Report, resolved: Sequence[ResolvedFrame], first: int) -> Report:
        """`report` with this feature's section. `resolved` are the checked frames, `first` the first non-finite."""
        return report

    def judge(self, ctx: EngineContext, report: Report, checked: Sequence[Frame]) -> Report | None:
        """Raise `report` (return it, perhaps changed) or tolerate it (None; the checked frames are then settled)."""
        return report

    def on_publish(self, ctx: EngineContext, report: Report) -> None:
        """A report was published (logged and written)."""

    def on_batch_end(self, ctx: EngineContext, phase: Phase, batch_number: int) -> None:
        """Micro-batch `batch_number` of `phase` ended (its check passed); counters advance after this."""

    def on_optimizer_step(
        self, ctx: EngineContext, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None
    ) -> None:
        """An optimizer step is at `stage`."""

    def on_loss(self, ctx: EngineContext, loss: torch.Tensor) -> None:
        """An adapter (or the user) handed over the micro-batch's loss (`watch_loss`), while it is recorded."""

    def on_checkpoint(
        self, ctx: EngineContext, state: Any, path: str, step: int | None, write_aside: WriteAside | None
    ) -> None:
        """`state` (what a checkpoint holds: dicts, modules, optimizers, tensors) is about to be written to `path`;
        raising stops the write. `write_aside` writes it elsewhere (None where the adapter cannot)."""

    def readouts(self) -> Mapping[Readout[Any], Callable[[], Any]]:
        """What this feature offers adapters and users (core/readouts.py), read when asked."""
        return {}

    def on_scaler(self, ctx: EngineContext, scaler: Any, read_scale: str) -> None:
        """The adapter found the run's loss scaler (a `torch.amp.GradScaler`); `read_scale` says when its scale can
        be read: "at_batch_end", or "when_settled" (the adapter reports the "settled" optimizer stage)."""

    def close(self, ctx: EngineContext) -> None:
        """Watching ended: log summaries, release what was kept."""
