"""abs-min and abs-max: the statistic of transformers' report, measured on every tensor and leading every line.

It is the one statistic the engine itself reads: a tensor's abs max is inf when any value is inf and nan when any is
nan, so the maxima alone decide whether a check found anything. Values are exact (a min and a max are exact in any
dtype), so the numbers printed are the ones transformers prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nanwatch.core.stats.base import Column, Number, Statistic, Values, decode_number, encode_number

if TYPE_CHECKING:
    import torch

__all__ = ["AbsRange", "ABS_RANGE", "RangeKernel", "format_range"]

# The lead statistic's kernel returns its two values as 0-d device tensors (no stacking: one kernel less per tensor).
RangeKernel = Callable[["torch.Tensor"], "tuple[torch.Tensor, torch.Tensor]"]


def format_range(abs_min: Number, abs_max: Number) -> str:
    """The two number columns of a text line: `1.00e-03 2.00e+01` (transformers' `%8.2e`)."""
    return f"{abs_min:8.2e} {abs_max:8.2e}"


class AbsRange(Statistic):
    name = "abs_range"
    columns = (Column("abs_min"), Column("abs_max"))
    summary_metric = "absmax"

    def range_kernel(self) -> RangeKernel:
        """`(abs min, abs max)` of a plain strided tensor of a dtype whose abs keeps its dtype (see `measure()`)."""
        from nanwatch.core.stats.kernels import abs_aminmax  # torch: imported when a watcher starts, not by the tools

        return abs_aminmax

    def read(self, row: Sequence[Number]) -> Values:
        # ints stay ints (integer tensors), floats keep every digit. A nan max means a nan min, as a float min
        # propagates nan (the magnitudes reduced as integers leave that to this read: kernels.py).
        if isinstance(row[1], float) and math.isnan(row[1]):
            return (math.nan, math.nan)
        return (row[0], row[1])

    def format(self, values: Values) -> str | None:
        abs_min, abs_max = values
        return None if abs_min is None or abs_max is None else format_range(abs_min, abs_max)

    def to_report_json(self, values: Values | None) -> dict[str, Any]:
        # Flat keys, and always present (null for a line without numbers): the report's shape from the start.
        abs_min, abs_max = values if values is not None else (None, None)
        return {"abs_min": encode_number(abs_min), "abs_max": encode_number(abs_max)}

    def from_report_json(self, entry: Mapping[str, Any]) -> Values | None:
        values = (decode_number(entry.get("abs_min")), decode_number(entry.get("abs_max")))
        return None if values == (None, None) else values

    def diverges(self, a: Values | None, b: Values | None, *, rtol: float, atol: float) -> str | None:
        first = None if a is None else a[1]
        second = None if b is None else b[1]
        if first is None and second is None:
            return None
        if first is None or second is None:
            return f"numbers in {'A' if second is None else 'B'} only"
        x, y = float(first), float(second)
        if not (math.isfinite(x) and math.isfinite(y)):
            if math.isfinite(x):
                return "non-finite in B only"
            if math.isfinite(y):
                return "non-finite in A only"
            if _word(x) == _word(y):
                return None
            return f"{_word(x)} in A, {_word(y)} in B"
        if abs(x - y) > atol + rtol * max(abs(x), abs(y)):
            return f"relative difference {relative_difference(x, y):.2e} > rtol {rtol:g}"
        return None

    def summary_value(self, values: Values | None) -> float | None:
        # Floats only: token ids and masks are integers whose magnitudes say nothing about overflow.
        if values is None or not isinstance(values[1], float):
            return None
        return values[1]


def relative_difference(first: float, second: float) -> float:
    scale = max(abs(first), abs(second))
    return abs(first - second) / scale if scale > 0 else 0.0


def _word(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


ABS_RANGE = AbsRange()
