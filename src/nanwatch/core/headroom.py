"""Headroom by dtype: warn before anything is inf, count values that underflow, and ask "would this fit float16?".

Every floating-point tensor is judged against its own dtype's limits (`torch.finfo`): float16 reaches inf past 65504,
bfloat16 past ~3.39e38, float8_e4m3fn saturates at 448, float8_e5m2 reaches inf past 57344; below each one's smallest
normal number values lose precision (subnormal), and below half its smallest subnormal they round to zero.

Cost. The check that a batch is finite already reads one flag per device from the device (`find_non_finite`). The
headroom check replaces that flag by one that also trips when an abs max reaches its threshold: `abs_max < threshold`
is False for inf, for nan and for a value at or past the threshold, so the same comparison, over the same stacked
maxima, answers both questions with the same single transfer. Only when the flag trips are the numbers read back and
the offending tensors named (and a batch holding inf/nan goes on to the report as before).

Counting underflow (`count_underflow=True`) needs a few extra kernels per tensor, so it is opt-in: `measure()` then
also keeps, per tensor, `[subnormal, target_subnormal, target_zero, excess]` as one int64 vector on the device, where
`excess` > 0 says that more than `underflow_warn_fraction` of the values underflow; that excess joins the same flag.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.frames import Entry, Frame
from nanwatch.core.stats import FLOAT8_DTYPES, Measurement

__all__ = [
    "TARGET_DTYPES",
    "Limits",
    "limits_of",
    "UnderflowCounter",
    "Finding",
    "FindingKind",
    "HeadroomMonitor",
    "monitor_for",
    "underflow_to_dict",
]

# The dtypes `target_dtype` accepts: narrower formats an fp32 (or bf16) run may be moved to.
TARGET_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Limits:
    """The numbers that matter about one floating-point dtype, from `torch.finfo`.

    Attributes:
        overflow_at: the smallest magnitude that no longer rounds to `max` when cast (round to nearest even): it
            becomes inf (float16, bfloat16, float8_e5m2) or saturates/turns nan (float8_e4m3fn, which has no inf).
        flush_at: the largest magnitude that rounds to zero when cast (half the smallest subnormal).
    """

    dtype: torch.dtype
    name: str
    max: float
    smallest_normal: float
    smallest_subnormal: float
    overflow_at: float
    flush_at: float


@functools.cache
def limits_of(dtype: torch.dtype) -> Limits | None:
    """The limits of a floating-point dtype; None for any other dtype (integers, bool, complex, quantized)."""
    if not dtype.is_floating_point:
        return None
    try:
        info = torch.finfo(dtype)
    except TypeError:  # a float8 variant finfo does not describe
        return None
    ulp_at_max = 2.0 ** math.floor(math.log2(info.max)) * info.eps
    smallest_subnormal = info.smallest_normal * info.eps
    return Limits(
        dtype=dtype,
        name=dtype_name(dtype),
        max=info.max,
        smallest_normal=info.smallest_normal,
        smallest_subnormal=smallest_subnormal,
        overflow_at=info.max + ulp_at_max / 2,
        flush_at=smallest_subnormal / 2,
    )


def target_limits(name: str | None) -> Limits | None:
    """The limits of a `target_dtype` name ("float16", ...), None when no target is set."""
    if name is None:
        return None
    if name not in TARGET_DTYPES or not hasattr(torch, name):
        raise ValueError(f"target_dtype can be one of {TARGET_DTYPES} (or None), got {name!r}")
    limits = limits_of(getattr(torch, name))
    assert limits is not None
    return limits


def _round_up(value: float, dtype: torch.dtype) -> float:
    """The smallest number of `dtype` at or above `value` (inf past its max), so `x < it` is exact for x in dtype."""
    if math.isinf(value):
        return value
    rounded = torch.tensor(value, dtype=torch.float64).to(dtype)
    if float(rounded) < value:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf, dtype=dtype))
    return float(rounded)


class UnderflowCounter:
    """Counts, on the device, the values of a tensor that underflow; `measure()` calls it when asked to.

    Returns an int64 vector `[subnormal, target_subnormal, target_zero, excess]`: nonzero magnitudes below the
    tensor's own smallest normal; below the target dtype's smallest normal (-1 when the target does not apply: no
    target, or the tensor already has the target's dtype); at or below the target's flush-to-zero point (likewise);
    and how far the larger of the first two exceeds `warn_fraction` of the tensor's size (> 0: worth a warning).

    Args:
        target: the limits of `target_dtype`, or None.
        warn_fraction: the fraction of a tensor's values that may underflow before it is worth a warning.
    """

    def __init__(self, target: Limits | None, warn_fraction: float) -> None:
        self.target = target
        self.warn_fraction = warn_fraction

    def __call__(self, data: torch.Tensor) -> torch.Tensor | None:
        own = limits_of(data.dtype)
        if own is None:
            return None
        if data.is_nested:
            data = torch.cat([part.reshape(-1) for part in data.unbind()])
        numel = data.numel()
        # float8 has no comparison kernels of its own; every float8 value is exact in float32.
        magnitude = data.float().abs() if data.dtype in FLOAT8_DTYPES else data.abs()
        # count_nonzero, not .sum() of a bool tensor: several times faster on the CPU. A nan is nonzero and below no
        # threshold, so it is counted nowhere; "nonzero and below t" is "below t" less the zeros.
        zeros = numel - torch.count_nonzero(magnitude)
        # Thresholds are powers of two: exact in every floating-point dtype whose range reaches them (and a threshold
        # below a dtype's range rounds to 0, where the count is rightly 0).
        subnormal = torch.count_nonzero(magnitude < own.smallest_normal) - zeros
        limit = math.floor(self.warn_fraction * numel)
        target = self.target
        if target is None or target.dtype == data.dtype:
            not_applicable = torch.full_like(subnormal, -1)
            return torch.stack([subnormal, not_applicable, not_applicable, subnormal - limit])
        below = torch.count_nonzero(magnitude < target.smallest_normal) - zeros
        flushed = torch.count_nonzero(magnitude <= target.flush_at) - zeros
        return torch.stack([subnormal, below, flushed, torch.maximum(subnormal, below) - limit])


def underflow_to_dict(counts: Sequence[int] | None) -> dict[str, int | None] | None:
    """The underflow counts of a resolved entry as the JSON report writes them (None when not counted)."""
    if counts is None:
        return None
    subnormal, below, flushed = counts[0], counts[1], counts[2]
    return {
        "subnormal": subnormal,
        "target_subnormal": None if below < 0 else below,
        "target_zero": None if flushed < 0 else flushed,
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


class HeadroomMonitor:
    """Judges each check's measurements against dtype limits; warns through the `nanwatch` logger.

    Args:
        warn_fraction: warn when an abs max reaches this fraction of its dtype's max (None: no headroom warnings).
        target: the limits of `target_dtype`, or None.
        count_underflow: measurements carry underflow counts (`counter` is then set for `StatsCache`).
        underflow_warn_fraction: warn when more than this fraction of a tensor's values underflow.
        logger: where warnings and the closing summary go.
        rank, world_size: named in the messages when there is more than one process.
    """

    def __init__(
        self,
        *,
        warn_fraction: float | None,
        target: Limits | None,
        count_underflow: bool,
        underflow_warn_fraction: float,
        logger: logging.Logger,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.warn_fraction = warn_fraction
        self.target = target
        self.underflow_warn_fraction = underflow_warn_fraction
        self.counter = UnderflowCounter(target, underflow_warn_fraction) if count_underflow else None
        self.logger = logger
        self.rank = rank
        self.world_size = world_size
        self.checks = 0
        self.warned: list[Finding] = []  # every finding that was logged, in order (bounded by the 2x rule)
        self._last_warned: dict[tuple[str, str, str, str], Finding] = {}
        self._worst: dict[tuple[str, str, str, str], Finding] = {}  # per tensor and kind: bounded by the model
        self._thresholds: dict[torch.dtype, float] = {}
        self._largest: dict[torch.device, torch.Tensor] = {}  # target set: the largest abs max seen, on the device
        self._summarised = 0

    # ------------------------------------------------------------------------------------------ thresholds

    def _threshold(self, dtype: torch.dtype | None, abs_max_dtype: torch.dtype) -> float:
        """Below this an abs max of a `dtype` tensor needs no look (exact in `abs_max_dtype`); inf: finite is enough."""
        key = dtype if dtype is not None else abs_max_dtype
        found = self._thresholds.get(key)
        if found is None:
            found = _round_up(min(self._limits_for(dtype)), abs_max_dtype)
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

    def suspicious(self, frames: Sequence[Frame]) -> bool:
        """True when any float abs max in `frames` is inf, nan or at a threshold, or a tensor underflows too much.

        One host sync per device, like `find_non_finite`, whose question it answers too.
        """
        self.checks += 1
        maxima: dict[tuple[torch.device, torch.dtype | None], list[torch.Tensor]] = {}
        counts: dict[torch.device, list[torch.Tensor]] = {}
        for measurement in _unique_measurements(frames):
            abs_max = measurement.abs_max
            assert abs_max is not None
            if abs_max.is_floating_point():
                maxima.setdefault((abs_max.device, measurement.dtype), []).append(abs_max)
            if measurement.underflow is not None:
                counts.setdefault(measurement.underflow.device, []).append(measurement.underflow)
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for (device, dtype), values in maxima.items():
            stacked = torch.stack(values)
            fine = stacked < self._threshold(dtype, stacked.dtype)
            own = limits_of(dtype) if dtype is not None else None
            sentinel = None
            if own is not None:
                # Exactly the dtype's max: a mask filled with finfo.min (transformers' attention masks), not a value.
                sentinel = stacked == own.max
                fine = fine | sentinel
            flags.setdefault(device, []).append(fine.all())
            if self._target_applies(dtype) and sentinel is not None:
                # fmax ignores nan: the largest finite-or-inf value seen, read once, at close; masks left out.
                top = stacked.masked_fill(sentinel, 0).max().float()
                previous = self._largest.get(device)
                self._largest[device] = top if previous is None else torch.fmax(previous, top)
        for device, vectors in counts.items():
            flags.setdefault(device, []).append((torch.stack(vectors)[:, 3] <= 0).all())
        return any(not bool(torch.stack(device_flags).all()) for device_flags in flags.values())

    # ------------------------------------------------------------------------------------------- the details

    def review(self, frames: Sequence[Frame]) -> bool:
        """After `suspicious()` said so: read the numbers, and warn about what came close, unless inf/nan is there.

        Returns:
            True when some float abs max is inf or nan (the caller reports it; nothing is warned about then).
        """
        where: dict[int, tuple[Frame, Entry]] = {}
        for frame in frames:
            for entry in frame.entries:
                measurement = entry.measurement
                if measurement is not None and measurement.abs_max is not None and id(measurement) not in where:
                    where[id(measurement)] = (frame, entry)
        measurements = [entry.measurement for _, entry in where.values() if entry.measurement is not None]
        floats = [m for m in measurements if m.abs_max is not None and m.abs_max.is_floating_point()]
        values = _read([m.abs_max for m in floats if m.abs_max is not None])
        if any(not math.isfinite(v) for v in values):
            return True
        counted = [m for m in measurements if m.underflow is not None]
        counts = _read_rows([m.underflow for m in counted if m.underflow is not None])
        findings: list[Finding] = []
        for measurement, value in zip(floats, values, strict=True):
            frame, entry = where[id(measurement)]
            findings += self._judge_max(frame, entry, measurement, value)
        for measurement, row in zip(counted, counts, strict=True):
            frame, entry = where[id(measurement)]
            findings += self._judge_underflow(frame, entry, measurement, row)
        self._record(findings)
        return False

    def _judge_max(self, frame: Frame, entry: Entry, measurement: Measurement, value: float) -> list[Finding]:
        own = limits_of(measurement.dtype) if measurement.dtype is not None else None
        if own is None or value == own.max:  # exactly the max: a mask's finfo.min, as `suspicious()` says
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
        counter = "batch_number" if first.phase == "train" else f"{first.phase}_batch_number"
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
        if self.counter is not None:
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
            counter = "batch_number" if worst.phase == "train" else f"{worst.phase}_batch_number"
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
            if self.counter is None:
                lines.append("  underflow not counted (set count_underflow=True to count values that would flush)")
            elif not any(f.kind == "target_underflow" for f in self._worst.values()):
                lines.append(
                    f"  no tensor had more than {self.underflow_warn_fraction:.1%} of its values below "
                    f"{self.target.name}'s smallest normal"
                )
        return "\n".join(lines)

    def close(self) -> None:
        """Log the summary (once per run, again only if something new was found since)."""
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


def monitor_for(
    config: WatchConfig, *, logger: logging.Logger, rank: int, world_size: int, logs: bool
) -> HeadroomMonitor | None:
    """The monitor a watcher needs, or None when the config asks for nothing (then the check costs what it did).

    Args:
        logs: whether this rank logs diagnostics (`trace_ranks`): the others only detect inf/nan, at no extra cost.
    """
    wanted = config.headroom_warn_fraction is not None or config.target_dtype is not None or config.count_underflow
    if not wanted or not logs:
        return None
    return HeadroomMonitor(
        warn_fraction=config.headroom_warn_fraction,
        target=target_limits(config.target_dtype),
        count_underflow=config.count_underflow,
        underflow_warn_fraction=config.underflow_warn_fraction,
        logger=logger,
        rank=rank,
        world_size=world_size,
    )
