"""The headroom feature itself: thresholds screened in the check's one read, findings judged and warned about.

What headroom is and what it costs: the package's docstring (core/features/headroom/__init__.py). This module holds the
engine-facing part: the flags added to the check's read (`screen`), the look at the numbers once one trips
(`review`), and the warnings: at most `MAX_LINES` lines each, a tensor again only once it got worse (findings.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.feature_api import EngineContext, Feature
from nanwatch.core.features.headroom.findings import Finding, FindingKind, badness
from nanwatch.core.features.headroom.host_reads import read_counts, read_floats, unique_measurements
from nanwatch.core.features.headroom.run_summary import TITLES, RunFindings, summary_text
from nanwatch.core.frames import Entry, Frame, ResolvedFrame, counter_name
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.stats.limits import Limits, dtype_name, limits_of, round_up, target_limits
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
        # The findings of the check under way: None until `review` looked at its numbers (it does only when a flag
        # tripped and no frame holds inf/nan); kept for `judge`, which puts them into that check's report.
        self._checked: list[Finding] | None = None

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
        self._checked = None
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
        self._checked = self._findings(pending)
        self._record(self._checked)
        return None

    def annotate(self, ctx: EngineContext, report: Report, resolved: Sequence[ResolvedFrame], first: int) -> Report:
        """A frame holds inf/nan (so `review` did not run): the checked frames' values near their dtype's limits,
        read back already, go into the report (no warning of their own: the report is logged). Often how the inf/nan
        came about, whatever made the detection."""
        if not self.active:
            return report
        return self.with_findings(report, resolved)

    def with_findings(self, report: Report, resolved: Sequence[ResolvedFrame]) -> Report:
        """`report` with the section listing what `resolved` (frames read back) held near their dtype's limits; the
        report itself when nothing came close. What `annotate` adds, and a replay's report (replay.py) too."""
        return _with_findings(report, self._findings_read(resolved))

    def judge(self, ctx: EngineContext, report: Report, checked: Sequence[Frame]) -> Report | None:
        """A detection no frame holds (the guard's gradients, the sentinel's sums): what `review` found in the same
        check (warned about already) goes into its report too."""
        findings, self._checked = self._checked, None
        if not self.active or findings is None or report.section("headroom") is not None:
            return report
        return _with_findings(report, findings)

    def _findings(self, pending: Sequence[Frame]) -> list[Finding]:
        """The findings of `pending`'s finite numbers (a few transfers)."""
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
            findings += self._judge_max(frame, _Line(entry.label, measurement.dtype, measurement.shape), value)
        for measurement, row in zip(counted, counts, strict=True):
            frame, entry = where[id(measurement)]
            findings += self._judge_underflow(frame, _Line(entry.label, measurement.dtype, measurement.shape), row)
        return findings

    def _findings_read(self, resolved: Sequence[ResolvedFrame]) -> list[Finding]:
        """The max findings of frames read back already (a detection's): no transfer. A tensor several modules pass
        on (same numbers, dtype and shape) is named once, where it was first recorded."""
        seen: set[tuple[Any, ...]] = set()
        findings: list[Finding] = []
        for frame in resolved:
            for entry in frame.entries:
                value = entry.abs_max
                dtype = getattr(torch, entry.dtype, None) if entry.dtype is not None else None
                if not isinstance(value, float) or not isinstance(dtype, torch.dtype):
                    continue
                key = (entry.abs_min, value, entry.dtype, entry.shape)
                if key in seen:
                    continue
                seen.add(key)
                findings += self._judge_max(frame, _Line(entry.label, dtype, entry.shape), value)
        return findings

    def _judge_max(self, frame: Frame | ResolvedFrame, line: _Line, value: float) -> list[Finding]:
        own = limits_of(line.dtype) if line.dtype is not None else None
        if own is None or value == own.max:  # exactly the max: a mask's finfo.min, as `suspicious()` says
            return []
        if not math.isfinite(value):  # past every limit: the detection's report, not a headroom warning
            return []
        found = []
        if self.warn_fraction is not None and value >= self.warn_fraction * own.max:
            found.append(self._finding("headroom", frame, line, value, own.max / value, own))
        target = self.target
        if target is not None and self._target_applies(line.dtype):
            if value >= target.overflow_at:
                found.append(self._finding("target_overflow", frame, line, value, value / target.max))
            elif self.warn_fraction is not None and value >= self.warn_fraction * target.max:
                found.append(self._finding("target_headroom", frame, line, value, target.max / value))
        return found

    def _judge_underflow(self, frame: Frame, line: _Line, row: list[int]) -> list[Finding]:
        subnormal, below, flushed, excess = row
        if excess <= 0:
            return []
        own = limits_of(line.dtype) if line.dtype is not None else None
        if own is None:
            return []
        numel = math.prod(line.shape) if line.shape is not None else None
        # The counter's own limit, from the same size (a nested tensor has no shape here: judged on the excess).
        limit = math.floor(self.underflow_warn_fraction * numel) if numel is not None else 0
        found = []
        if subnormal > limit:
            ratio = subnormal / numel if numel else 0.0
            found.append(self._finding("underflow", frame, line, math.nan, ratio, own, count=subnormal))
        if below > limit:
            ratio = below / numel if numel else 0.0
            found.append(self._finding("target_underflow", frame, line, math.nan, ratio, count=below, flushed=flushed))
        return found

    def _finding(
        self,
        kind: FindingKind,
        frame: Frame | ResolvedFrame,
        line: _Line,
        value: float,
        ratio: float,
        limits: Limits | None = None,
        *,
        count: int | None = None,
        flushed: int | None = None,
    ) -> Finding:
        crossed = limits if limits is not None else self.target
        assert crossed is not None
        assert line.dtype is not None
        return Finding(
            kind=kind,
            batch_number=frame.batch_number,
            phase=frame.phase,
            module_name=frame.module_name,
            class_name=frame.class_name,
            label=line.label,
            dtype=dtype_name(line.dtype),
            abs_max=value,
            ratio=ratio,
            numel=math.prod(line.shape) if line.shape is not None else None,
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
        return summary_text(
            RunFindings(
                target=self.target,
                warn_fraction=self.warn_fraction,
                counts_underflow=self.counts_underflow,
                underflow_warn_fraction=self.underflow_warn_fraction,
                rank=self.rank,
                world_size=self.world_size,
                checks=self.checks,
                worst={kind: self.worst(kind) for kind in TITLES},
                largest_abs_max=self.largest_abs_max() if self.target is not None else None,
            )
        )

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


@dataclass(frozen=True)
class _Line:
    """The tensor of one line of a frame, as a finding names it."""

    label: str
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None


def _with_findings(report: Report, findings: list[Finding]) -> Report:
    """`report` with a "headroom" section listing `findings`, worst first (the report itself when there are none)."""
    if not findings:
        return report
    shown = sorted(findings, key=badness, reverse=True)
    during = f"{counter_name(report.phase)}={report.batch_number}"
    lines = [f"numbers near their dtype's limits in the frames checked with this detection ({during}):"]
    lines += [f"  {finding.line()}" for finding in shown[:MAX_LINES]]
    if len(shown) > MAX_LINES:
        lines.append(f"  ... and {len(shown) - MAX_LINES} more")
    data = [_to_json(finding) for finding in shown]
    return report.with_section(ReportSection("headroom", 15, tuple(lines), data, tuple(shown)))


def _to_json(finding: Finding) -> dict[str, Any]:
    """A finding as the JSON report holds it (an underflow finding has no abs max: null, not NaN)."""
    data = dataclasses.asdict(finding)
    data["abs_max"] = finding.abs_max if math.isfinite(finding.abs_max) else None
    data["line"] = finding.line()
    return data


def _worse(a: Finding, b: Finding) -> bool:
    return badness(a) > badness(b)
