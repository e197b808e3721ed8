"""What features hand to adapters and users, and the names they hand it under.

The engine passes these values on without knowing which feature makes them (`Feature.readouts`,
`Watcher.read`), and adapters import them from here, never from a feature: the loss scaler a framework keeps
(`scaler_of`), the loss scale's history, the per-module summary a framework's logger gets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

from nanwatch.core.frames import ResolvedFrame
from nanwatch.core.scope import ROOT_NAME

__all__ = [
    "ABSMAX_PREFIX",
    "BATCH_KEY",
    "GLOBAL_KEY",
    "GRADIENT_MAXIMUM",
    "LAST_GOOD_CHECKPOINT",
    "LOSS_SCALE_HISTORY",
    "METRIC_PREFIX",
    "SPIKE_REPLAY",
    "SUMMARY",
    "GradScalerLike",
    "LossScaleHistory",
    "Readout",
    "ReplayedLevels",
    "ScaleReading",
    "ScaleRecord",
    "Summary",
    "checked_scaler",
    "scaler_of",
    "order_key",
    "scale_text",
]

_T = TypeVar("_T")


class Readout(Generic[_T]):
    """The name under which one feature offers a value (read when asked: `Watcher.read(SUMMARY)`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Readout({self.name!r})"


# When the scale of a micro-batch's step can be read: as it ends (Lightning, Accelerate), or when the adapter says the
# scaler has settled (the "settled" optimizer stage: the plain loop, the HF Trainer).
ScaleReading = Literal["at_batch_end", "when_settled"]


@runtime_checkable
class GradScalerLike(Protocol):
    """What nanwatch needs of a loss scaler: `torch.amp.GradScaler` (and the deprecated `torch.cuda.amp` one)."""

    def get_scale(self) -> float: ...

    def is_enabled(self) -> bool: ...


def checked_scaler(scaler: object, read_scale: str) -> GradScalerLike:
    """`scaler`, if nanwatch can follow it and `read_scale` says when; else a one-line error naming what was wrong.

    Raises:
        TypeError: `scaler` is not a GradScaler.
        ValueError: `read_scale` is neither "at_batch_end" nor "when_settled".
    """
    if not isinstance(scaler, GradScalerLike):
        raise TypeError(
            "scaler must be a torch.amp.GradScaler (an object with get_scale() and is_enabled()), "
            f"got {type(scaler).__name__}"
        )
    if read_scale not in ("at_batch_end", "when_settled"):
        raise ValueError(f"read_scale can be 'at_batch_end' or 'when_settled', got {read_scale!r}")
    return scaler


def scaler_of(holder: object) -> GradScalerLike | None:
    """The loss scaler a framework object keeps in its `scaler` attribute, or None when it has none.

    Where each framework keeps the run's `GradScaler` (None there when the loss is not scaled): Lightning's precision
    plugin (`trainer.precision_plugin.scaler`), an `accelerate.Accelerator` (`accelerator.scaler`), and each
    `AcceleratedOptimizer` it prepares (`optimizer.scaler`, the one the transformers Trainer hands its callbacks).
    """
    scaler = getattr(holder, "scaler", None)
    return scaler if isinstance(scaler, GradScalerLike) else None


@dataclass(frozen=True, slots=True)
class ScaleRecord:
    """The loss scale as read at the end of a training batch, when it differs from the reading before."""

    batch_number: int
    optimizer_step: int | None
    scale: float

    def to_dict(self) -> dict[str, Any]:
        return {"batch_number": self.batch_number, "optimizer_step": self.optimizer_step, "scale": self.scale}


@dataclass(frozen=True, slots=True)
class LossScaleHistory:
    """The loss scale over the run, as it goes into a report (a text line and a JSON object).

    Attributes:
        records: the first reading, then each change (oldest first); at most 64, the oldest changes dropped first.
        skipped_steps: how many times the scale went down (each is at least one step the scaler skipped).
        gradient_overflows: how many checks found inf/nan first in gradients and let the run go on.
        min_loss_scale: the floor below which nanwatch stops the run (None: no floor).
        dropped: how many older changes are not in `records`.
    """

    records: tuple[ScaleRecord, ...]
    skipped_steps: int
    gradient_overflows: int
    min_loss_scale: float | None
    dropped: int = 0

    @property
    def current(self) -> float | None:
        return self.records[-1].scale if self.records else None

    def skipped_since(self, batch_number: int) -> bool:
        """Whether the scale went down at training micro-batch `batch_number` or later: the scaler skipped the
        optimizer step of that micro-batch or of a later one."""
        return any(
            later.batch_number >= batch_number and later.scale < earlier.scale
            for earlier, later in zip(self.records, self.records[1:], strict=False)
        )

    def to_text(self) -> str:
        """One line: `Loss scale (GradScaler): 65536 at batch 0 -> 32768 at batch 3 -> ...; 1 skipped step; ...`."""
        steps = [f"{scale_text(r.scale)} at batch {r.batch_number}" for r in self.records]
        if self.dropped:
            steps.insert(1, f"... {self.dropped} earlier change{'s' if self.dropped != 1 else ''} ...")
        floor = "none" if self.min_loss_scale is None else scale_text(self.min_loss_scale)
        return (
            f"Loss scale (GradScaler): {' -> '.join(steps) or 'not read yet'}; "
            f"{_count(self.skipped_steps, 'skipped step')}, "
            f"{_count(self.gradient_overflows, 'gradient overflow')} tolerated; min_loss_scale={floor}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": [record.to_dict() for record in self.records],
            "dropped": self.dropped,
            "current": self.current,
            "skipped_steps": self.skipped_steps,
            "gradient_overflows": self.gradient_overflows,
            "min_loss_scale": self.min_loss_scale,
        }


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' if number != 1 else ''}"


def scale_text(value: float) -> str:
    # Scales are powers of two in practice (65536, 0.5, 0.0009765625): printed in full, never rounded.
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


METRIC_PREFIX = "nanwatch"
ABSMAX_PREFIX = f"{METRIC_PREFIX}/absmax/"
GLOBAL_KEY = f"{METRIC_PREFIX}/absmax_global"
BATCH_KEY = f"{METRIC_PREFIX}/batch_number"
# The text form lists this many modules, the largest first; the metrics hold all of them.
_TEXT_TOP = 10


@dataclass(frozen=True)
class Summary:
    """Per-module abs max over the float forward tensors (parameters, inputs, outputs) of one training batch.

    Attributes:
        batch_number: the watched training batch the numbers come from.
        absmax: module name -> the largest abs max among its float tensors in that batch (over all its calls), in
            the order the modules were first called. Modules that saw no float tensor are left out.
        class_names: module name -> its class name.
    """

    batch_number: int
    absmax: dict[str, float]
    class_names: dict[str, str] = field(default_factory=dict)
    # Other statistics' summaries (metric name -> module -> value), from statistics registered beside abs-min/max.
    others: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def max_module(self) -> str | None:
        """The module holding the largest abs max (the first one on a tie), or None when the summary is empty."""
        if not self.absmax:
            return None
        return max(self.absmax, key=lambda name: order_key(self.absmax[name]))

    @property
    def max_value(self) -> float | None:
        module = self.max_module
        return None if module is None else self.absmax[module]

    def metrics(self) -> dict[str, float]:
        """Flat numeric metrics for a framework logger: `nanwatch/absmax/<module>` for every module, then
        `nanwatch/absmax_global` (the largest of them) and `nanwatch/batch_number`. The root module is `(root)`."""
        values = {ABSMAX_PREFIX + (name or ROOT_NAME): value for name, value in self.absmax.items()}
        if self.max_value is not None:
            values[GLOBAL_KEY] = self.max_value
        for metric, modules in self.others.items():
            values.update((f"{METRIC_PREFIX}/{metric}/{name or ROOT_NAME}", value) for name, value in modules.items())
        values[BATCH_KEY] = float(self.batch_number)
        return values

    def to_text(self, top: int = _TEXT_TOP) -> str:
        """A few lines for a log: the largest abs max and where, then the `top` largest modules."""
        module = self.max_module
        if module is None:
            return f"nanwatch summary of batch_number={self.batch_number}: no float tensor was recorded"
        ranked = sorted(self.absmax, key=lambda name: order_key(self.absmax[name]), reverse=True)[:top]
        lines = [
            f"nanwatch summary of batch_number={self.batch_number}: largest abs max {self.absmax[module]:.2e} in "
            f"{module or ROOT_NAME} ({self.class_names.get(module, '?')}); {len(self.absmax)} modules, largest first:"
        ]
        lines += [
            f"{self.absmax[name]:8.2e} {name or ROOT_NAME} {self.class_names.get(name, '')}".rstrip() for name in ranked
        ]
        return "\n".join(lines)


def order_key(value: float) -> float:
    # nan sorts above everything, so a summary never hides it behind a finite maximum.
    return math.inf if math.isnan(value) else value


# The summary of the latest training batch checked clean (reads its numbers back), or None before any.
SUMMARY: Readout[Callable[[], Summary | None]] = Readout("summary")
# The loss scale's history under a GradScaler, or None without one.
LOSS_SCALE_HISTORY: Readout[Callable[[], LossScaleHistory | None]] = Readout("loss_scale_history")
# The last checkpoint verified finite before it was written, as (path, optimizer step), or None before any.
LAST_GOOD_CHECKPOINT: Readout[Callable[[], tuple[str, int | None] | None]] = Readout("last_good_checkpoint")
# The largest gradient magnitude about to be applied by the optimizer step being checked (a 0-d device tensor, read
# by no one unless a flag trips), or None outside such a check.
GRADIENT_MAXIMUM: Readout[Callable[[], Any]] = Readout("gradient_maximum")


@dataclass(frozen=True)
class ReplayedLevels:
    """Sentinel mode's answer to a spike: the spiking micro-batch's forward, replayed under a full watch, beside the
    micro-batch before it replayed the same way (the same weights, so what differs is what the data did).

    Attributes:
        batch_number: the spiking micro-batch.
        frames: its replayed frames (empty when it could not be replayed).
        baseline_batch: the micro-batch replayed for comparison, or None.
        baseline: its replayed frames.
        why_not: what could not be replayed and why, or None.
    """

    batch_number: int
    frames: list[ResolvedFrame] = field(default_factory=list)
    baseline_batch: int | None = None
    baseline: list[ResolvedFrame] = field(default_factory=list)
    why_not: str | None = None


# Sentinel mode (with spike_window): replays a micro-batch still kept, and the one before it, for a spike's report.
SPIKE_REPLAY: Readout[Callable[[], Callable[[int], ReplayedLevels]]] = Readout("spike_replay")
