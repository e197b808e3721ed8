"""nan and inf counts: how many elements of a tensor are nan and how many are ±inf.

Two extra kernels per tensor, which nanwatch never adds to the watched forward. The counts are exact wherever they
are known for free: a finite abs max means the tensor holds no nan and no inf (a max is nan as soon as one element
is), so both are 0. A traced frame is the slow path and still holds its tensors, so its lines whose abs max is inf or
nan are counted exactly, on the device. A report is built after the batch, when the tensors are gone: its non-finite
lines have null counts (not measured), never a guess. The JSON report predates the counts and keeps its shape
without them; JSON Lines carry them.
"""

from __future__ import annotations

import math

from nanwatch.core.stats.base import Column, Kernel, Number, Statistic, Values

__all__ = ["NonFiniteCounts", "NON_FINITE_COUNTS"]


class NonFiniteCounts(Statistic):
    name = "non_finite_counts"
    columns = (Column("nan", integer=True), Column("inf", integer=True))
    in_report_json = False

    def traced_kernel(self) -> Kernel | None:
        from nanwatch.core.stats.kernels import count_non_finite  # torch: imported when a trace starts

        return count_non_finite

    def derive(self, abs_min: Number | None, abs_max: Number | None) -> Values | None:
        if abs_max is None or (isinstance(abs_max, float) and not math.isfinite(abs_max)):
            return None
        return (0, 0)


NON_FINITE_COUNTS = NonFiniteCounts()
