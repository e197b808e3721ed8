"""The headroom feature itself: thresholds screened in the check's one read, findings judged and warned about.

What headroom is and what it costs: the package's docstring (core/features/headroom/__init__.py). This module holds the
engine-facing part: the flags added to the check's read (`screen`), the look at the numbers once one trips
(`review`), and the warnings: at most `MAX_LINES` lines each, a tensor again only once it got worse (findings.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.events import EngineContext, Feature
from nanwatch.core.features.headroom.findings import Finding, FindingKind, badness
from nanwatch.core.features.headroom.readback import read_counts, read_floats, unique_measurements
from nanwatch.core.features.headroom.run_summary import summary_text
from nanwatch.core.frames import Entry, Frame, counter_name
from nanwatch.core.report import Report
from nanwatch.core.stats.limits import Limits, dtype_name, limits_of, round_up, target_limits
from nanwatch.core.stats.measure import Measurement
from nanwatch.core.stats.underflow import EXCESS_INDEX, UNDERFLOW

__all__ = ["HeadroomMonitor", "MAX_LINES"]

# Lines shown per warning; the rest are counted.
MAX_LINES = 10


class HeadroomMonitor(Feature):
    """Judges each check's measurements against dtype limits; warns through the `nanwatch` logger.

    Built from the config (`headroom_warn_fraction`, `target_dtype`, `count_underflow`, `underflow_warn_fraction`);
    active once attached on a rank that logs (`trace_ranks`).
    """

    name = "headroom"

    def __init__(self, config: WatchConfig) -> None:
        self.warn_fraction = config.headroom_warn_fraction
        self.target = target_limits(config.target_dtype)
        self.underflow_warn_fraction = config.underflow_warn_fraction
        self.counts_underflow = config.count_underflow
        self.trace_ranks = config.trace_ranks
        self.active = False
        self.logger = logging.getLogger("nanwatch")
        self.rank = 0
        self.world_size = 1
        self.checks = 0
        self.warned: list[Finding] = []  # every finding that was logged, in order (bounded by the 2x rule)
        self._last_warned: dict[tuple[str, str, str, str], Finding] = {}
        self._worst: dict[tuple[str, str, str, str], Finding] = {}  # per tensor and kind: bounded by the model
        self._thresholds: dict[torch.dtype, float] = {}
        self._largest: dict[torch.device, torch.Tensor] = {}  # target set: the largest abs max seen, on the device
        self._summarised = 0

    @staticmethod
    def wanted(config: WatchConfig) -> bool:
        """Whether the config asks for any of it (otherwise the check costs what it did without it)."""
        return config.headroom_warn_fraction is not None or config.target_dtype is not None or config.count_underflow

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        self.active = ctx.rank_logs(self.trace_ranks)
        self.logger, self.rank, self.world_size = ctx.logger, ctx.rank, ctx.world_size

    # ------------------------------------------------------------------------------------------ thresholds

    def _threshold(self, dtype: torch.dtype | None, abs_max_dtype: torch.dtype) -> float:
        """Below this an abs max of a `dtype` tensor needs no look (exact in `abs_max_dtype`); inf: finite is enough."""
        key = dtype if dtype is not None else abs_max_dtype
        found = self._thresholds.get(key)
        if found is None:
            found = round_up(min(self._limits_for(dtype)), abs_max_dtype)
            self._thresholds[key] = found
        return found

    def _limits_for(self, dtype: torch.dtype | None) -> list[float]:
        own = limits_of(dtype) if dtype is not None else None
        bounds = [math.inf]
        if own is None:
            return bounds
        if self.warn_fraction is not None:
            bounds.append(self.warn_fraction * own.max)
        if self._target_applies(dtype):
            assert self.target is not None
            bounds.append(self.target.overflow_at)
            if self.warn_fraction is not None:
                bounds.append(self.warn_fraction * self.target.max)
        return bounds

    def _target_applies(self, dtype: torch.dtype | None) -> bool:
        return self.target is not None and dtype is not None and dtype != self.target.dtype and dtype.is_floating_point

    # -------------------------------------------------------------------------------------- the one transfer

    def screen(
        self, ctx: EngineContext, pending: Sequence[Frame], maxima: Mapping[tuple[Any, Any], torch.Tensor]
    ) -> list[torch.Tensor]:
        """Flags that trip when an abs max reaches a threshold (or is inf/nan), or a tensor underflows too much."""
        if not self.active or not maxima:
            return []
        self.checks += 1
        flags = []
        for (device, dtype), stacked in maxima.items():
            fine = stacked < self._threshold(dtype, stacked.dtype)
            own = limits_of(dtype) if dtype is not None else None
            sentinel = None
            if own is not None:
                # Exactly the dtype's max: a mask filled with finfo.min (transformers' attention masks), not a value.
                sentinel = stacked == own.max
                fine = fine | sentinel
            flags.append(fine.all())
            if self._target_applies(dtype) and sentinel is not None:
                # fmax ignores nan: the largest finite-or-inf value seen, read once, at close; masks left out.
                top = stacked.masked_fill(sentinel, 0).max().float()
                previous = self._largest.get(device)
                self._largest[device] = top if previous is None else torch.fmax(previous, top)
        if self.counts_underflow:
            counts: dict[torch.device, list[torch.Tensor]] = {}
            for measurement in unique_measurements(pending):
                vector = (measurement.extra or {}).get(UNDERFLOW.name)
                if vector is not None:
                    counts.setdefault(vector.device, []).append(vector)
            flags += [(torch.stack(vectors)[:, EXCESS_INDEX] <= 0).all() for vectors in counts.values()]
        return flags

    # ------------------------------------------------------------------------------------------- the details

    def review(self, ctx: EngineContext, pending: Sequence[Frame]) -> Report | None:
        """A flag tripped and nothing is inf/nan: read the numbers, and warn about what came close."""
        where: dict[int, tuple[Frame, Entry]] = {}
        for frame in pending:
            for entry in frame.entries:
                measurement = entry.measurement
                if measurement is not None and measurement.abs_max is not None and id(measurement) not in where:
                    where[id(measurement)] = (frame, entry)
        measurements = [entry.measurement for _, entry in where.values() if entry.measurement is not None]
        floats = [m for m in measurements if m.abs_max is not None and m.abs_max.is_floating_point()]
        values = read_floats([m.abs_max for m in floats if m.abs_max is not None])
        counted = [m for m in measurements if (m.extra or {}).get(UNDERFLOW.name) is not None]
        counts = read_counts([m.extra[UNDERFLOW.name] for m in counted if m.extra is not None])
        findings: list[Finding] = []
        for measurement, value in zip(floats, values, strict=True):
            frame, entry = where[id(measurement)]
            findings += self._judge_max(frame, entry, measurement, value)
        for measurement, row in zip(counted, counts, strict=True):
            frame, entry = where[id(measurement)]
            findings += self._judge_underflow(frame, entry, measurement, row)
        self._record(findings)
        return None

    def _judge_max(self, frame: Frame, entry: Entry, measurement: Measurement, value: float) -> list[Finding]:
        own = limits_of(measurement.dtype) if measurement.dtype is not None else None
        if own is None or value == own.max:  # exactly the max: a mask's finfo.min, as `suspicious()` says
            return []
        if not math.isfinite(value):  # past every limit: the detection's report, not a headroom warning
            return []
        found = []
        if self.warn_fraction is not None and value >= self.warn_fraction * own.max:
            found.append(self._finding("headroom", frame, entry, measurement, value, own.max / value, own))
        target = self.target
        if target is not None and self._target_applies(measurement.dtype):
            if value >= target.overflow_at:
                found.append(self._finding("target_overflow", frame, entry, measurement, value, value / target.max))
            elif self.warn_fraction is not None and value >= self.warn_fraction * target.max:
                found.append(self._finding("target_headroom", frame, entry, measurement, value, target.max / value))
        return found

    def _judge_underflow(self, frame: Frame, entry: Entry, measurement: Measurement, row: list[int]) -> list[Finding]:
        subnormal, below, flushed, excess = row
        if excess <= 0:
            return []
        own = limits_of(measurement.dtype) if measurement.dtype is not None else None
        if own is None:
            return []
        numel = math.prod(measurement.shape) if measurement.shape is not None else None
        # The counter's own limit, from the same size (a nested tensor has no shape here: judged on the excess).
        limit = math.floor(self.underflow_warn_fraction * numel) if numel is not None else 0
        found = []
        if subnormal > limit:
            ratio = subnormal / numel if numel else 0.0
            found.append(self._finding("underflow", frame, entry, measurement, math.nan, ratio, own, count=subnormal))
        if below > limit:
            ratio = below / numel if numel else 0.0
            found.append(
                self._finding(
                    "target_underflow", frame, entry, measurement, math.nan, ratio, count=below, flushed=flushed
                )
            )
        return found

    def _finding(
        self,
        kind: FindingKind,
        frame: Frame,
        entry: Entry,
        measurement: Measurement,
        value: float,
        ratio: float,
        limits: Limits | None = None,
        *,
        count: int | None = None,
        flushed: int | None = None,
    ) -> Finding:
        crossed = limits if limits is not None else self.target
        assert crossed is not None
        assert measurement.dtype is not None
        return Finding(
            kind=kind,
            batch_number=frame.batch_number,
            phase=frame.phase,
            module_name=frame.module_name,
            class_name=frame.class_name,
            label=entry.label,
            dtype=dtype_name(measurement.dtype),
            abs_max=value,
            ratio=ratio,
            numel=math.prod(measurement.shape) if measurement.shape is not None else None,
            count=count,
            flushed=flushed,
            limit_dtype=crossed.name,
        )

    def _record(self, findings: Iterable[Finding]) -> None:
        """Keep the worst of each (tensor, kind); log those never warned about, or 2x worse than when last warned."""
        fresh = []
        for finding in findings:
            worst = self._worst.get(finding.key)
            if worst is None or _worse(finding, worst):
                self._worst[finding.key] = finding
            last = self._last_warned.get(finding.key)
            if last is None or finding.worse_than(last):
                self._last_warned[finding.key] = finding
                fresh.append(finding)
        if not fresh:
            return
        self.warned += fresh
        first = fresh[0]
        counter = counter_name(first.phase)
        on_rank = f" on rank {self.rank}" if self.world_size > 1 else ""
        lines = [f"nanwatch: numbers near their dtype's limits during {counter}={first.batch_number}{on_rank}:"]
        lines += [f"  {finding.line()}" for finding in fresh[:MAX_LINES]]
        if len(fresh) > MAX_LINES:
            lines.append(f"  ... and {len(fresh) - MAX_LINES} more")
        self.logger.warning("\n".join(lines))

    # ------------------------------------------------------------------------------------------------ closing

    def worst(self, kind: FindingKind) -> list[Finding]:
        """The worst finding of each tensor for `kind`, worst first."""
        found = [f for f in self._worst.values() if f.kind == kind]
        return sorted(found, key=badness, reverse=True)

    def largest_abs_max(self) -> float | None:
        """With a target dtype: the largest abs max of any tensor it applies to, over the run (one read)."""
        if not self._largest:
            return None
        return max(float(value) for value in self._largest.values())

    def summary(self) -> str | None:
        """What the run showed, in a few lines; None when there is nothing to say (no target, nothing found)."""
        return summary_text(self)

    def close(self, ctx: EngineContext | None = None) -> None:
        """Log the summary (once per run, again only if something new was found since)."""
        if not self.active:
            return
        seen = len(self._worst) + self.checks
        if seen == self._summarised:
            return
        self._summarised = seen
        text = self.summary()
        if text is not None:
            # Something was found: a warning; only the answer to target_dtype's question: information.
            self.logger.log(logging.WARNING if self._worst else logging.INFO, text)


def _worse(a: Finding, b: Finding) -> bool:
    return badness(a) > badness(b)
