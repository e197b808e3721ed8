"""Per-tensor statistics: each declared once (`base.Statistic`), listed in `registry`.

The declarations import no torch; `kernels`, `limits`, `measure`, `grouped`, `pooled`, `paths`, `cache` and
`readback` (the device side) do, and only watchers import them.
"""

from nanwatch.core.stats.abs_range import ABS_RANGE, AbsRange
from nanwatch.core.stats.base import Column, Kernel, Statistic, Values, decode_number, encode_number
from nanwatch.core.stats.non_finite import NON_FINITE_COUNTS, NonFiniteCounts
from nanwatch.core.stats.registry import extras, lead, register, statistics, unregister
from nanwatch.core.stats.underflow import UNDERFLOW, Underflow

__all__ = [
    "ABS_RANGE",
    "NON_FINITE_COUNTS",
    "UNDERFLOW",
    "AbsRange",
    "Column",
    "Kernel",
    "NonFiniteCounts",
    "Statistic",
    "Underflow",
    "Values",
    "decode_number",
    "encode_number",
    "extras",
    "lead",
    "register",
    "statistics",
    "unregister",
]
