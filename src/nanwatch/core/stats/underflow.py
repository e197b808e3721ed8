"""Underflow counts (`count_underflow=True`): values too small for their dtype, or for the `target_dtype`.

Per floating-point tensor: nonzero magnitudes below its own dtype's smallest normal (subnormal); below the target
dtype's smallest normal; at or below the target's flush-to-zero point (null where no target applies: no target, or
the tensor already has the target's dtype). The kernel also returns, hidden from every output, by how much the
larger of the first two exceeds `underflow_warn_fraction` of the tensor's size: the headroom feature folds that into
the check's one host read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from nanwatch.core.stats.base import Column, Kernel, Number, Statistic, Values

if TYPE_CHECKING:
    from nanwatch.core.config import WatchConfig

__all__ = ["Underflow", "UNDERFLOW", "EXCESS_INDEX"]

# Index of the hidden excess in the kernel's vector.
EXCESS_INDEX = 3


class Underflow(Statistic):
    name = "underflow"
    columns = (
        Column("subnormal", integer=True),
        Column("target_subnormal", integer=True),
        Column("target_zero", integer=True),
    )

    def kernel(self, config: WatchConfig) -> Kernel | None:
        if not config.count_underflow:
            return None
        from nanwatch.core.stats.limits import UnderflowCounter, target_limits  # torch: imported when watching

        return UnderflowCounter(target_limits(config.target_dtype), config.underflow_warn_fraction)

    def read(self, row: Sequence[Number]) -> Values:
        subnormal, below, flushed = (int(value) for value in row[:3])
        # -1: the target does not apply to this tensor.
        return (subnormal, None if below < 0 else below, None if flushed < 0 else flushed)


UNDERFLOW = Underflow()
