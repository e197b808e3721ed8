"""Headroom by dtype: warn before anything is inf, warn about values that underflow, and ask "would this fit float16?".

Every floating-point tensor is judged against its own dtype's limits (`torch.finfo`): float16 reaches inf past 65504,
bfloat16 past ~3.39e38, float8_e4m3fn saturates at 448, float8_e5m2 reaches inf past 57344; below each one's smallest
normal number values lose precision (subnormal), and below half its smallest subnormal they round to zero.

Cost. The engine reads, once per check, one flag per device that says whether every abs max is finite. This feature
adds flags to that same read: `abs_max < threshold` over the same stacked maxima (False for inf, for nan and for a
value at or past the threshold), and, with `count_underflow`, whether any tensor's underflow count exceeds
`underflow_warn_fraction` (the underflow statistic's hidden excess, core/stats/underflow.py). Only when one of them
trips are the numbers read back and the offending tensors named (a batch holding inf/nan goes on to the report).
Active on the ranks `trace_ranks` names (the others only detect inf/nan, at no extra cost).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.events import EngineContext, Feature
from nanwatch.core.frames import Entry, Frame, counter_name
from nanwatch.core.report import Report
from nanwatch.core.stats.limits import Limits, dtype_name, limits_of, round_up, target_limits
from nanwatch.core.stats.measure import Measurement
from nanwatch.core.stats.underflow import EXCESS_INDEX, UNDERFLOW

__all__ = ["Finding", "FindingKind", "HeadroomMonitor", "MAX_LINES", "WORSENING"]

# Lines shown per warning; the rest are counted. A long run warns about a tensor again only when it got 2x worse.
MAX_LINES = 10
WORSENING = 2.0

FindingKind = Literal["headroom", "target_headroom", "target_overflow", "underflow", "target_underflow"]
_QUESTION: dict[str, str] = {
    "headroom": "own max",
    "target_headroom": "target max",
    "target_overflow": "target max",
    "underflow": "own underflow",
    "target_underflow": "target underflow",
}


@dataclass(frozen=True)
class Finding:
    """One tensor that came close to a dtype's max, would not fit the target dtype, or underflowed.

    Attributes:
        kind: "headroom" (within the warn fraction of its own dtype's max), "target_headroom" (of the target's
            max), "target_overflow" (past the target's max: it would be inf), "underflow" (too many of its values
            are subnormal in its own dtype), "target_underflow" (too many would be subnormal in the target).
        ratio: for headroom kinds, dtype max / abs max (the headroom, > 1); for "target_overflow", abs max /
            target max (> 1); for underflow kinds, the fraction of values that underflow.
    """

    kind: FindingKind
    batch_number: int
    phase: str
    module_name: str
    class_name: str
    label: str
    dtype: str
    abs_max: float
    ratio: float
    numel: int | None
    count: int | None = None  # underflow kinds: how many values
    flushed: int | None = None  # target_underflow: how many of them would round to zero
    limit_dtype: str = ""  # the dtype whose limits were crossed

    @property
    def key(self) -> tuple[str, str, str, str]:
        """One tensor and one question: near or past the target's max is one question, asked by two kinds."""
        return (self.phase, self.module_name, self.label, _QUESTION[self.kind])

    def line(self) -> str:
        where = f"{self.module_name or '(top-level model)'} ({self.class_name}) {self.label}"
        limits = limits_of(getattr(torch, self.limit_dtype))
        assert limits is not None
        if self.kind in ("headroom", "target_headroom"):
            whose = "its" if self.kind == "headroom" else f"{self.limit_dtype}'s"
            if self.ratio < 1:  # past the target's max, yet close enough to round down to it
                return (
                    f"{where}: {self.dtype} abs max {self.abs_max:.2e}, just past {whose} max {limits.max:.2e} "
                    "(rounds to it)"
                )
            return (
                f"{where}: {self.dtype} abs max {self.abs_max:.2e}, headroom {_times(self.ratio)}x "
                f"({math.log2(self.ratio):.1f} bits) below {whose} max {limits.max:.2e}"
            )
        if self.kind == "target_overflow":
            return (
                f"{where}: {self.dtype} abs max {self.abs_max:.2e} would overflow {self.limit_dtype} "
                f"({_times(self.ratio)}x over its max {limits.max:.2e})"
            )
        of = f"{self.ratio:.1%} of {self.numel} {self.dtype} values" if self.numel else f"{self.count} values"
        if self.kind == "underflow":
            return f"{where}: {of} are subnormal (nonzero, below {limits.smallest_normal:.2e})"
        flushed = ""
        if self.flushed and self.numel:
            flushed = f", {self.flushed / self.numel:.1%} would flush to zero"
        return (
            f"{where}: {of} would be subnormal in {self.limit_dtype} (nonzero, below "
            f"{limits.smallest_normal:.2e}){flushed}"
        )

    def worse_than(self, other: Finding) -> bool:
        """True when this finding is at least `WORSENING` times worse than `other` (same tensor, same question)."""
        return _badness(self) >= _badness(other) * WORSENING


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
            for measurement in _unique_measurements(pending):
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
        values = _read([m.abs_max for m in floats if m.abs_max is not None])
        counted = [m for m in measurements if (m.extra or {}).get(UNDERFLOW.name) is not None]
        counts = _read_rows([m.extra[UNDERFLOW.name] for m in counted if m.extra is not None])
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
        return sorted(found, key=_badness, reverse=True)

    def largest_abs_max(self) -> float | None:
        """With a target dtype: the largest abs max of any tensor it applies to, over the run (one read)."""
        if not self._largest:
            return None
        return max(float(value) for value in self._largest.values())

    def summary(self) -> str | None:
        """What the run showed, in a few lines; None when there is nothing to say (no target, nothing found)."""
        if self.target is None and not self._worst:
            return None
        settings = []
        if self.warn_fraction is not None:
            settings.append(f"headroom_warn_fraction={self.warn_fraction:g}")
        if self.target is not None:
            settings.append(f"target_dtype={self.target.name}")
        if self.counts_underflow:
            settings.append(f"underflow_warn_fraction={self.underflow_warn_fraction:g}")
        on_rank = f" on rank {self.rank}" if self.world_size > 1 else ""
        lines = [f"nanwatch headroom summary{on_rank} after {self.checks} checks ({', '.join(settings)}):"]
        names = {
            "target_overflow": "would overflow {target}",
            "target_headroom": "within the warn fraction of {target}'s max",
            "headroom": "within the warn fraction of their own dtype's max",
            "underflow": "too many subnormal values in their own dtype",
            "target_underflow": "too many values that would be subnormal in {target}",
        }
        target_name = self.target.name if self.target is not None else ""
        for kind, title in names.items():
            found = self.worst(kind)  # type: ignore[arg-type]
            if not found:
                continue
            tensors = "1 tensor" if len(found) == 1 else f"{len(found)} tensors"
            worst = found[0]
            counter = counter_name(worst.phase)
            lines.append(
                f"  {title.format(target=target_name)}: {tensors}; worst at {counter}={worst.batch_number}: "
                f"{worst.line()}"
            )
        if self.target is not None:
            largest = self.largest_abs_max()
            if largest is not None and math.isfinite(largest) and largest > 0:
                room = self.target.max / largest
                verdict = f"headroom {_times(room)}x" if room >= 1 else f"{_times(1 / room)}x over"
                lines.append(
                    f"  largest abs max of any tensor judged against {self.target.name}: {largest:.2e} "
                    f"({verdict} its max {self.target.max:.2e})"
                )
            if not any(f.kind == "target_overflow" for f in self._worst.values()):
                lines.append(f"  no watched tensor would overflow {self.target.name}")
            if not self.counts_underflow:
                lines.append("  underflow not counted (set count_underflow=True to count values that would flush)")
            elif not any(f.kind == "target_underflow" for f in self._worst.values()):
                lines.append(
                    f"  no tensor had more than {self.underflow_warn_fraction:.1%} of its values below "
                    f"{self.target.name}'s smallest normal"
                )
        return "\n".join(lines)

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


def _times(ratio: float) -> str:
    """A ratio for people: 3 significant digits, more when it is within 1% of 1 (65520 vs 65504: 1.0002)."""
    return f"{ratio:.5g}" if abs(ratio - 1) < 0.01 else f"{ratio:.3g}"


def _badness(finding: Finding) -> float:
    # abs max / the dtype's max for the max questions (headroom kinds keep its inverse), the fraction for underflow.
    return 1 / finding.ratio if finding.kind in ("headroom", "target_headroom") else finding.ratio


def _worse(a: Finding, b: Finding) -> bool:
    return _badness(a) > _badness(b)


def _unique_measurements(frames: Sequence[Frame]) -> Iterable[Measurement]:
    """Each measured tensor once (an output is usually the next module's input: one measurement, two lines)."""
    seen: set[int] = set()
    for frame in frames:
        for entry in frame.entries:
            measurement = entry.measurement
            if measurement is None or measurement.abs_max is None or id(measurement) in seen:
                continue
            seen.add(id(measurement))
            yield measurement


def _read(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Read 0-d tensors back as Python floats: one transfer per (device, dtype) group."""
    out: list[float] = [0.0] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for indices in groups.values():
        for index, value in zip(indices, torch.stack([tensors[i] for i in indices]).tolist(), strict=True):
            out[index] = float(value)
    return out


def _read_rows(vectors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Read int64 count vectors back: one transfer per device."""
    out: list[list[int]] = [[] for _ in vectors]
    groups: dict[torch.device, list[int]] = {}
    for index, vector in enumerate(vectors):
        groups.setdefault(vector.device, []).append(index)
    for indices in groups.values():
        for index, row in zip(indices, torch.stack([vectors[i] for i in indices]).tolist(), strict=True):
            out[index] = [int(v) for v in row]
    return out
