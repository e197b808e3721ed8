"""Spike warnings: the loss or the gradients jump far above their recent level, and the modules that moved with them.

Off unless `spike_window` is set. Two signals, judged against a rolling window of their own recent values:
- the loss an adapter hands over (`watch_loss`), as each micro-batch's check runs;
- the largest gradient magnitude about to be applied at each optimizer step, which the guard (core/features/guard.py)
  already reduces, after DDP's all-reduce: every rank judges the same number, with no collective of nanwatch's.

A value is a spike when it is more than `spike_factor` times the window's mean (above it by (factor - 1) x |mean|) and
more than `spike_zscore` standard deviations above it, once `min(spike_window, 8)` values are in. Both windows live
on the signal's device: the judgement is a flag folded into the check's one host read, and the window is updated
there too (a spike enters it as the mean, so one spike does not hide the next). Nothing is read back unless a flag
trips. Then the report says which value spiked against which window, and which watched modules moved: each module's
abs max in the checked frames (forward outputs; backward output gradients with `watch_gradients`) against the median
of its own over the last `HISTORY` checks, largest jumps first; the first (in recording order) to grow by
`spike_factor` or more leads. Sentinel mode records no module: there the sentinel replays the spiking micro-batch and
the one before it under a full watch, on the same weights (`SPIKE_REPLAY`), and the modules that moved are those that
moved with the data. It is logged (a warning) and written to `report_dir/nanwatch-spike-rank{R}-batch{N}.txt`, and
the run goes on: a spike is not inf/nan.

One spike event is one warning and one report. A spike opens an event; the spikes that follow it within `QUIET`
judgements of the last are the same event, counted, not reported again. Once the event spans `LASTING` judgements,
if their median is itself a spike against the window the event began with, the level lasts (a loss that jumps and
stays): the window starts again from those values as its new baseline (judging again once warm), and the event
closes. Either way it ends with one line at INFO level (the level taken up, or the repeats counted once the signal
has been quiet for `QUIET` judgements). A spike after that is a new event, judged against the level then.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nanwatch.core.feature_api import EngineContext, Feature
from nanwatch.core.formats.files import atomic_write
from nanwatch.core.frames import Direction, Frame, RecordedFrame, ResolvedFrame, Role, counter_name, resolve
from nanwatch.core.readouts import GRADIENT_MAXIMUM, SPIKE_REPLAY, ReplayedLevels
from nanwatch.core.report import Report

__all__ = ["HISTORY", "LASTING", "SpikeMonitor", "Window"]

# Checks whose output lines are kept (references only) to tell each module's recent level. Kept objects cost: the
# garbage collector walks them, so only each frame's output lines are kept, for a few checks.
HISTORY = 4
# Modules named in a spike's report.
MAX_MODULES = 10
_MIN_VALUES = 8
# Judgements of one signal since a spike (the spike included) before its event may be a level that lasts.
LASTING = 3
# Judgements without a spike that close an event.
QUIET = 8


@dataclass
class _Event:
    """A spike and what followed it, one event: reported once."""

    opened: int  # the window's count at the spike's judgement
    batch_number: int
    mean: float  # the window the spike was judged against
    std: float
    # The window's count at a spike's judgement: its value (it entered the window as the mean), for the latest
    # `size` judgements; and how many spikes the event has had.
    spikes: dict[int, torch.Tensor] = field(default_factory=dict)
    spiked: int = 1
    quiet: int = 0  # judgements without a spike since the last


@dataclass
class Window:
    """The recent values of one signal, on its device: a ring of `size` values and how many went in."""

    size: int
    factor: float
    zscore: float
    values: torch.Tensor | None = None
    count: int = 0
    judged: list[torch.Tensor] = field(default_factory=list)  # value, mean, std of the latest judgement
    event: _Event | None = None

    def judge(self, value: torch.Tensor) -> torch.Tensor | None:
        """A device flag (True = no spike) for `value`, which joins the window; None while the window warms up."""
        value = value.detach().reshape(()).float()
        if self.values is None or self.values.device != value.device:
            self.values, self.count, self.event = torch.zeros(self.size, device=value.device), 0, None
        filled = min(self.count, self.size)
        flag = None
        entering = value
        if filled >= min(self.size, _MIN_VALUES):
            recent = self.values[:filled]
            mean, std = recent.mean(), recent.std(correction=0)
            spike = (value > mean + (self.factor - 1) * mean.abs()) & (value > mean + self.zscore * std)
            flag = ~spike
            # A spike (or inf/nan, which the check reports itself) enters the window as the mean.
            entering = torch.where(spike | ~torch.isfinite(value), mean, value)
            self.judged = [value, mean, std]
        self.values[self.count % self.size] = entering
        self.count += 1
        return flag

    def since(self, event: _Event) -> torch.Tensor:
        """The values judged since `event` opened (the latest `size` of them), spikes as they were."""
        assert self.values is not None
        start = max(event.opened, self.count - self.size)
        return torch.stack(
            [event.spikes[i] if i in event.spikes else self.values[i % self.size] for i in range(start, self.count)]
        )

    def restart(self, values: torch.Tensor) -> None:
        """Start again from `values` (a level that lasts): judged against them once the window is warm again."""
        assert self.values is not None
        fresh = torch.zeros_like(self.values)
        fresh[: len(values)] = values
        self.values, self.count, self.judged, self.event = fresh, len(values), [], None


class SpikeMonitor(Feature):
    name = "spikes"

    def __init__(self, window: int, factor: float, zscore: float) -> None:
        self._windows = {signal: Window(window, factor, zscore) for signal in ("loss", "gradients")}
        self._factor = factor  # a module moved when its output grew by at least this much (as a spike must)
        self._loss: torch.Tensor | None = None
        self._loss_batch = 0
        self._flags: list[tuple[str, torch.Tensor]] = []
        self._history: deque[list[Frame]] = deque(maxlen=HISTORY)
        self.spikes: list[dict[str, Any]] = []  # every spike reported, as its JSON says

    def on_loss(self, ctx: EngineContext, loss: torch.Tensor) -> None:
        self._loss, self._loss_batch = loss.detach(), ctx.counters.current_batch

    def screen(
        self, ctx: EngineContext, pending: Sequence[Frame], maxima: Mapping[tuple[Any, Any], torch.Tensor]
    ) -> list[torch.Tensor]:
        for signal, _ in self._flags:  # not reviewed: no flag tripped (or inf/nan took the check): no spike
            self._quiet(ctx, signal)
        self._flags = []
        signals = [("loss", self._loss), ("gradients", ctx.read(GRADIENT_MAXIMUM))]
        self._loss = None
        for signal, value in signals:
            if value is not None and value.numel() == 1 and value.is_floating_point():
                flag = self._windows[signal].judge(value)
                if flag is not None:
                    self._flags.append((signal, flag))
        return [flag for _, flag in self._flags]

    def review(self, ctx: EngineContext, pending: Sequence[Frame]) -> Report | None:
        flags, self._flags = self._flags, []
        tripped = [signal for signal, flag in flags if not bool(flag)]
        # The loss's own micro-batch; the gradients': the last one before the step (an adapter may have ended it).
        batch = self._loss_batch if "loss" in tripped else ctx.counters.last_batch
        fresh = []  # the signals whose spike opens an event: reported
        for signal, _ in flags:
            window = self._windows[signal]
            if signal not in tripped:
                self._quiet(ctx, signal)
                continue
            value, mean, std = window.judged
            event = window.event
            if event is None:
                fresh.append(signal)
                window.event = _Event(window.count - 1, batch, float(mean), float(std), {window.count - 1: value})
                continue
            event.spikes[window.count - 1], event.quiet = value, 0
            event.spiked += 1
            if len(event.spikes) > window.size:  # only the window's worth is ever read
                event.spikes = {i: v for i, v in event.spikes.items() if i >= window.count - window.size}
            if window.count - event.opened >= LASTING:
                self._maybe_lasting(ctx, signal, window, event)
        if fresh:
            self._report(ctx, fresh, pending, batch)
        return None  # a spike is a warning: the run goes on

    def _quiet(self, ctx: EngineContext, signal: str) -> None:
        """A judgement of `signal` without a spike: its event closes after `QUIET` of them in a row."""
        window = self._windows[signal]
        event = window.event
        if event is None:
            return
        event.quiet += 1
        if event.quiet >= QUIET:
            window.event = None
            if event.spiked > 1:
                ctx.logger.info(
                    f"nanwatch: the {_WHAT[signal]} spike during "
                    f"{counter_name(ctx.counters.phase)}={event.batch_number} "
                    f"repeated {event.spiked - 1} times in the {window.count - event.opened - QUIET} judgements "
                    f"after it (not reported again), then none for {QUIET}"
                )

    def _maybe_lasting(self, ctx: EngineContext, signal: str, window: Window, event: _Event) -> None:
        """The values since the event opened: when their median is a spike against the window the event began with,
        the level lasts, and becomes the window's new baseline."""
        since = window.since(event)
        median = statistics.median(since.tolist())
        mean, std = event.mean, event.std
        if not (median > mean + (window.factor - 1) * abs(mean) and median > mean + window.zscore * std):
            return  # spikes around a level that has not moved (yet): still the same event
        window.restart(since)
        ctx.logger.info(
            f"nanwatch: the {_WHAT[signal]} stayed up after its spike during {counter_name(ctx.counters.phase)}="
            f"{event.batch_number}: median {median:.3e} over the {len(since)} judgements since (mean before "
            f"{mean:.3e}), {event.spiked} spikes, reported once. Taken as its new level: spikes are "
            f"judged against it once {min(window.size, _MIN_VALUES)} values are in"
        )

    def on_commit(self, ctx: EngineContext, frames: Sequence[Frame]) -> None:
        outputs: list[Frame] = [
            RecordedFrame(frame.module_name, frame.class_name, frame.batch_number, frame.phase, lines, frame.direction)
            for frame in frames
            if (lines := [entry for entry in frame.entries if entry.role is Role.OUTPUT])
        ]
        if outputs:
            self._history.append(outputs)

    def close(self, ctx: EngineContext) -> None:
        # Nothing on a device stays: the windows' values and latest judgement, the flags not reviewed. The spikes
        # reported (`spikes`, plain numbers) stay for the user to read.
        self._history.clear()
        self._loss = None
        self._flags = []
        for window in self._windows.values():
            window.values, window.count, window.judged = None, 0, []

    # ---------------------------------------------------------------------------------------------- the report

    def _report(self, ctx: EngineContext, tripped: list[str], pending: Sequence[Frame], batch: int) -> None:
        lines: list[str] = []
        signals: list[dict[str, Any]] = []
        data: dict[str, Any] = {"batch_number": batch, "optimizer_step": ctx.counters.optimizer_step, "rank": ctx.rank}
        for signal in tripped:
            window = self._windows[signal]
            value, mean, std = (float(number) for number in window.judged)
            sigmas = (value - mean) / std if std > 0 else math.inf
            what = _WHAT[signal]
            lines.append(
                f"nanwatch: {what} spiked during {counter_name(ctx.counters.phase)}={batch} (optimizer step "
                f"{ctx.counters.optimizer_step}): {value:.3e} against a window of {min(window.count - 1, window.size)} "
                f"(mean {mean:.3e}, std {std:.2e}: x{value / mean if mean else math.inf:.3g}, {sigmas:.3g} sigma)"
            )
            signals.append({"signal": signal, "value": value, "mean": mean, "std": std})
        data["signals"] = signals
        compared = f"abs max now against the median of the last {HISTORY} checks"
        if ctx.config.mode == "sentinel":  # no frames of its own: the micro-batch replayed under a full watch
            moved, notes, data["replay"] = _moved_in_replay(
                ctx.read(SPIKE_REPLAY), batch, self._factor, distributed=ctx.world_size > 1
            )
            lines += notes
            compared = f"output abs max against micro-batch {data['replay'].get('compared_with')}, same weights"
        else:
            moved = self._modules_that_moved(pending, batch)
        first = _first_to_move(moved, self._factor)
        data["first_moved"] = None if first is None else {"module": first[0], "kind": first[1]}
        if first is not None:
            name, kind, now, before = first
            lines.append(
                f"first module to move (in the order the frames were recorded): {name} ({kind}, x{_jump(first):.3g})"
            )
        moved = sorted(moved, key=_jump, reverse=True)
        if moved:
            lines.append(f"modules that moved most ({compared}):")
            for name, kind, now, before in moved[:MAX_MODULES]:
                ratio = now / before if before > 0 else math.inf
                lines.append(f"  {name} ({kind}): {now:.2e} against {before:.2e} (x{ratio:.3g})")
        data["modules"] = [
            {"module": name, "kind": kind, "abs_max": now, "recent": before} for name, kind, now, before in moved
        ]
        self.spikes.append(data)
        text = "\n".join(lines)
        ctx.logger.warning(text)
        report_dir = ctx.config.report_dir
        if report_dir is not None:
            try:
                report_dir.mkdir(parents=True, exist_ok=True)
                stem = f"nanwatch-spike-rank{ctx.rank}-batch{batch}"
                atomic_write(report_dir / f"{stem}.txt", text + "\n")
                atomic_write(report_dir / f"{stem}.json", json.dumps(data, indent=1) + "\n")
            except OSError as error:
                ctx.logger.warning(f"nanwatch could not write the spike report to {report_dir}: {error!r}")

    def _modules_that_moved(self, pending: Sequence[Frame], batch: int) -> list[tuple[str, str, float, float]]:
        """(module, "output" or "grad output", abs max now, its median over the kept checks), in the order the
        frames were recorded; `_first_to_move` and the report sort them."""
        # The spiking micro-batch's frames: pending, or checked already (an adapter may check as a micro-batch ends,
        # before the step whose gradients spiked).
        kept = [frame for frames in self._history for frame in frames if frame.batch_number == batch]
        now = _levels(resolve([*kept, *pending]))
        earlier: dict[tuple[str, str], list[float]] = {}
        for frames in self._history:
            others = [frame for frame in frames if frame.batch_number != batch]
            for key, level in _levels(resolve(others)).items():
                earlier.setdefault(key, []).append(level)
        moved = []
        for key, level in now.items():
            recent = earlier.get(key)
            if recent and math.isfinite(level):
                before = statistics.median(recent)
                if level > before:
                    moved.append((key[0], key[1], level, before))
        return moved


_WHAT = {"loss": "loss", "gradients": "largest gradient magnitude about to be applied"}


def _moved_in_replay(
    replay: Callable[[int], ReplayedLevels] | None, batch: int, factor: float, *, distributed: bool
) -> tuple[list[tuple[str, str, float, float]], list[str], dict[str, Any]]:
    """Sentinel mode: the modules whose output moved between the spiking micro-batch and the one before it, both
    replayed under a full watch on the same weights (core/features/sentinel/spike_replay.py); the report's lines
    saying what was compared (or why nothing was); the replay's part of the JSON."""
    if replay is None:  # no sentinel to ask (it stopped watching)
        why = "not replayed: sentinel mode is not watching"
        return [], [f"({why}; mode='full' names the modules that moved)"], {"why_not": why}
    replayed = replay(batch)
    data: dict[str, Any] = {"batch_number": replayed.batch_number, "compared_with": replayed.baseline_batch}
    if replayed.why_not is not None:
        data["why_not"] = replayed.why_not
        return [], [f"({replayed.why_not}; mode='full' names the modules that moved)"], data
    now, before = _levels(replayed.frames), _levels(replayed.baseline)
    moved = [
        (name, kind, level, before[(name, kind)])
        for (name, kind), level in now.items()
        if (name, kind) in before and math.isfinite(level) and level > before[(name, kind)]
    ]
    lines = [
        f"sentinel mode: micro-batch {replayed.batch_number} replayed under a full watch, against micro-batch "
        f"{replayed.baseline_batch} replayed on the same weights (forward outputs)"
    ]
    data["moved_with_the_data"] = _first_to_move(moved, factor) is not None
    if not data["moved_with_the_data"]:
        # On the same weights, no output outgrew its level on the earlier data: the forward did not do it.
        elsewhere = "; for the gradients, or from another rank's micro-batch (averaged in)" if distributed else ""
        lines.append(
            f"no module's output grew x{factor:g} or more with this micro-batch's data: the spike came with the "
            "weights (the optimizer steps since the earlier micro-batch ran) or from outside the forward (the "
            f"targets, the loss){elsewhere}"
        )
    return moved, lines, data


def _jump(item: tuple[str, str, float, float]) -> float:
    return item[2] / item[3] if item[3] > 0 else math.inf


def _first_to_move(moved: list[tuple[str, str, float, float]], factor: float) -> tuple[str, str, float, float] | None:
    """The first module (in recording order: forward, inner modules before the ones that call them) whose jump is of
    the order of the largest (at least its square root): where the spike began, as far as the frames show. None when
    no module grew by `factor` (spike_factor) or more: jitter names no module."""
    if not moved:
        return None
    largest = max(_jump(item) for item in moved)
    if largest < factor:
        return None
    bar = math.sqrt(largest) if math.isfinite(largest) else math.inf
    for item in moved:
        if _jump(item) >= bar:
            return item
    return None


def _levels(frames: Sequence[ResolvedFrame]) -> dict[tuple[str, str], float]:
    """Each module's largest output abs max in `frames` (and output gradient's, for backward frames)."""
    levels: dict[tuple[str, str], float] = {}
    for frame in frames:
        kind = "grad output" if frame.direction is Direction.BACKWARD else "output"
        for entry in frame.entries:
            if entry.role is Role.OUTPUT and entry.abs_max is not None:
                key = (frame.module_name or "(root)", kind)
                levels[key] = max(levels.get(key, 0.0), float(entry.abs_max))
    return levels
