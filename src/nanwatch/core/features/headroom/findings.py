"""One finding of the headroom monitor: a tensor near or past a dtype's limits, and how it reads in a warning.

Apart from the monitor because a finding is plain data with its own wording and its own order ("worse than"): the
monitor makes them, the warnings and the closing summary only read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from nanwatch.core.stats.limits import limits_of

__all__ = ["Finding", "FindingKind", "WORSENING", "badness", "times"]

# A long run warns about a tensor again only when it got this many times worse.
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
                f"{where}: {self.dtype} abs max {self.abs_max:.2e}, headroom {times(self.ratio)}x "
                f"({math.log2(self.ratio):.1f} bits) below {whose} max {limits.max:.2e}"
            )
        if self.kind == "target_overflow":
            return (
                f"{where}: {self.dtype} abs max {self.abs_max:.2e} would overflow {self.limit_dtype} "
                f"({times(self.ratio)}x over its max {limits.max:.2e})"
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
        return badness(self) >= badness(other) * WORSENING


def times(ratio: float) -> str:
    """A ratio for people: 3 significant digits, more when it is within 1% of 1 (65520 vs 65504: 1.0002)."""
    return f"{ratio:.5g}" if abs(ratio - 1) < 0.01 else f"{ratio:.3g}"


def badness(finding: Finding) -> float:
    """How bad a finding is, comparable within one question: abs max / the dtype's max for the max questions
    (headroom kinds keep its inverse), the fraction of values for underflow."""
    return 1 / finding.ratio if finding.kind in ("headroom", "target_headroom") else finding.ratio
