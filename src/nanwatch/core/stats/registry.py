"""The statistics nanwatch measures: one list, read by the engine and by every output.

The lead statistic (abs-min/abs-max) is on every line and decides detection; the others follow in registration
order. `register()` adds one (a plug-in, or a test's toy statistic): from then on watchers launch its kernels and
reports, JSON Lines, `show`, `diff` and replay carry it.
"""

from __future__ import annotations

from nanwatch.core.stats.abs_range import ABS_RANGE, AbsRange
from nanwatch.core.stats.base import Statistic
from nanwatch.core.stats.non_finite import NON_FINITE_COUNTS
from nanwatch.core.stats.underflow import UNDERFLOW

__all__ = ["RESERVED_COLUMNS", "lead", "extras", "statistics", "register", "unregister"]

# The fixed fields of a JSON Lines record and of a JSON report entry (core/formats/jsonl_schema.py, core/report.py): a
# statistic's columns may not take these names.
RESERVED_COLUMNS = frozenset(
    {
        "version", "kind", "rank", "world_size", "phase", "batch", "optimizer_step", "epoch", "frame", "module",
        "class", "direction", "label", "role", "dtype", "shape", "note", "non_finite", "report_batch",
        "report_module", "report_frames", "report_culprit", "report_footer",
    }
)  # fmt: skip

_statistics: list[Statistic] = [ABS_RANGE, NON_FINITE_COUNTS, UNDERFLOW]


def lead() -> AbsRange:
    """abs-min/abs-max: first on every line, and what detection reads."""
    return ABS_RANGE


def statistics() -> tuple[Statistic, ...]:
    """Every registered statistic, the lead first."""
    return tuple(_statistics)


def extras() -> tuple[Statistic, ...]:
    """Every registered statistic but the lead, in registration order."""
    return tuple(_statistics[1:])


def register(statistic: Statistic) -> Statistic:
    """Add a statistic after those registered; returns it.

    Raises:
        TypeError: it is not a `Statistic`.
        ValueError: its name or a column name is empty, taken by another statistic, or reserved.
    """
    if not isinstance(statistic, Statistic):
        raise TypeError(f"register() takes a nanwatch Statistic, got {type(statistic).__name__}")
    if not statistic.name or not statistic.columns:
        raise ValueError(f"a statistic needs a name and at least one column, got {statistic.name!r}")
    if any(known.name == statistic.name for known in _statistics):
        raise ValueError(f"a statistic named {statistic.name!r} is already registered")
    taken = {column.name for known in _statistics for column in known.columns} | RESERVED_COLUMNS
    clashes = [column.name for column in statistic.columns if column.name in taken]
    if clashes or len({c.name for c in statistic.columns}) != len(statistic.columns):
        raise ValueError(
            f"statistic {statistic.name!r}: column names taken or repeated: {clashes or statistic.columns}"
        )
    _statistics.append(statistic)
    return statistic


def unregister(statistic: Statistic) -> None:
    """Remove a statistic added with `register()` (the built-in ones stay).

    Raises:
        ValueError: it is built in, or not registered.
    """
    if statistic in (ABS_RANGE, NON_FINITE_COUNTS, UNDERFLOW):
        raise ValueError(f"the built-in statistic {statistic.name!r} cannot be removed")
    if statistic not in _statistics:
        raise ValueError(f"statistic {statistic.name!r} is not registered")
    _statistics.remove(statistic)
