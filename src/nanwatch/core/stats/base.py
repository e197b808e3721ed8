"""What a statistic is: declared once, it says how its kernels are launched, its columns, how it reads back and prints.

Nothing here imports torch: the declarations are read by the tools (`nanwatch show`, `diff`, `plot`) that never do.
A statistic's kernels are imported when a watcher asks for them (`Statistic.kernel`), once per run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from nanwatch.core.config import WatchConfig

__all__ = ["Column", "Kernel", "Statistic", "Values", "Number", "encode_number", "decode_number"]

Number = int | float
# One value per column, as read back; None where the statistic says nothing for that tensor.
Values = tuple[Number | None, ...]
# Launches the kernels for one tensor (already detached) and returns a 1-D device tensor, one value per column (it may
# hold more: trailing values only the screening needs), or None when the statistic does not apply to the tensor.
# Never synchronises with the device.
Kernel = Callable[["torch.Tensor"], "torch.Tensor | None"]


@dataclass(frozen=True)
class Column:
    """One value of a statistic: its key in JSON Lines (unique over every registered statistic), and its kind."""

    name: str
    integer: bool = False


class Statistic:
    """A per-tensor statistic. Subclass it, give it a `name` and `columns`, and register it (`core/stats/registry.py`).

    Every output is driven by these declarations: the text line (`format`), the JSON report (`to_report_json`), JSON
    Lines (one column per `Column`), `nanwatch show` (the text), `nanwatch diff` (`diverges`), replay's comparison
    (`from_report_json`) and the summaries (`summary_value`).

    Attributes:
        name: unique; the key of the statistic's values on a resolved entry.
        columns: its values, in order.
        in_report_json: whether the JSON report carries it (JSON Lines always does).
        summary_metric: the metric name of its per-module summary (`nanwatch/<summary_metric>/<module>`), or None.
    """

    name: str = ""
    columns: tuple[Column, ...] = ()
    in_report_json: bool = True
    summary_metric: str | None = None

    # ----------------------------------------------------------------------------------------------- launching

    def kernel(self, config: WatchConfig) -> Kernel | None:
        """The kernel launched on every measured tensor in a run with `config`, or None when not measured there."""
        return None

    def traced_kernel(self) -> Kernel | None:
        """A kernel launched only on the lines of a traced frame (the slow path, while its tensors live), or None."""
        return None

    def derive(self, abs_min: Number | None, abs_max: Number | None) -> Values | None:
        """Values known for free from a tensor's abs range (no kernel), or None when they are not."""
        return None

    # -------------------------------------------------------------------------------------------------- reading

    def read(self, row: Sequence[Number]) -> Values:
        """The column values from the numbers the kernel's tensor read back as (in order, maybe more than needed)."""
        return tuple(
            int(value) if column.integer else float(value) for column, value in zip(self.columns, row, strict=False)
        )

    # ------------------------------------------------------------------------------------------------- printing

    def format(self, values: Values) -> str | None:
        """Text added to the line after its label in the text report (and `show`), or None for nothing."""
        return None

    def to_report_json(self, values: Values | None) -> dict[str, Any]:
        """The keys this statistic adds to an entry of the JSON report (nothing when it was not measured)."""
        if values is None:
            return {}
        return {
            self.name: {column.name: encode_number(value) for column, value in zip(self.columns, values, strict=True)}
        }

    def from_report_json(self, entry: Mapping[str, Any]) -> Values | None:
        """The inverse of `to_report_json`, for an entry of a JSON report; None when it is not there."""
        found = entry.get(self.name)
        if not isinstance(found, Mapping):
            return None
        return tuple(decode_number(found.get(column.name), field=column.name) for column in self.columns)

    def to_columns(self, values: Values | None) -> dict[str, Any]:
        """The JSON Lines columns of this statistic (nulls when it was not measured)."""
        if values is None:
            return {column.name: None for column in self.columns}
        return {column.name: encode_number(value) for column, value in zip(self.columns, values, strict=True)}

    def from_columns(self, record: Mapping[str, Any]) -> Values | None:
        """The values from a JSON Lines record; None when every column is null or absent.

        Raises:
            ValueError: a column holds something that is not a number, null, "inf", "-inf" or "nan".
        """
        values = tuple(decode_number(record.get(column.name), field=column.name) for column in self.columns)
        return None if all(value is None for value in values) else values

    # -------------------------------------------------------------------------------------------------- judging

    def diverges(self, a: Values | None, b: Values | None, *, rtol: float, atol: float) -> str | None:
        """Why two matched lines' values differ beyond tolerance (for `nanwatch diff`), or None when they agree.

        By default only values both sides measured are compared: exactly, or within the tolerances for floats.
        """
        if a is None or b is None:
            return None
        for column, first, second in zip(self.columns, a, b, strict=True):
            if first is None or second is None or _same(first, second, rtol=rtol, atol=atol):
                continue
            return f"{column.name} {_show(first)} in A, {_show(second)} in B"
        return None

    def summary_value(self, values: Values | None) -> float | None:
        """The number this statistic contributes to a module's summary (the largest over its lines is kept)."""
        return None


def _same(first: Number, second: Number, *, rtol: float, atol: float) -> bool:
    if isinstance(first, int) and isinstance(second, int):
        return first == second
    a, b = float(first), float(second)
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def _show(value: Number) -> str:
    return str(value) if isinstance(value, int) else f"{value:.2e}"


_NON_FINITE_STRINGS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def encode_number(value: Number | None) -> Number | str | None:
    """A number as JSON writes it here: non-finite floats as "inf", "-inf" or "nan", anything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def decode_number(value: object, *, field: str = "number") -> Number | None:
    """The inverse of `encode_number`.

    Raises:
        ValueError: `value` is neither a JSON number, null, nor one of "inf", "-inf", "nan".
    """
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value in _NON_FINITE_STRINGS:
        return _NON_FINITE_STRINGS[value]
    raise ValueError(f"{field} must be a number, null, or one of {sorted(_NON_FINITE_STRINGS)}, got {value!r}")
