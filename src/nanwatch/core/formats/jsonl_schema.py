"""The JSON Lines schema, defined once: `LineRecord`, one line of a report or a trace, and its checked reading.

Kept apart from the writing (`jsonl_writer.py`, the engine's side) and the reading of whole files
(`jsonl_reader.py`, the tools' side) so both sides meet in one definition. Every line of every report and trace is
one self-contained record, for tools and for people.

`report_dir` holds, next to each text report, `nanwatch-report[-eval]-rank{R}-batch{N}.jsonl`, and next to each text
trace, `nanwatch-trace-rank{R}.jsonl`. Each line of those files is one JSON object, one per line of the text (a
parameter, an input or an output of one module call), schema version 2:

- `version`: 2. Version 1 files (before the statistics registry) are still read; newer versions are refused.
- `kind`: "report" (the frames of a detection report) or "trace" (a frame of a traced batch).
- `rank`, `world_size`: the process that wrote it.
- `phase`: "train" or "eval"; `batch`: the micro-batch of that phase the frame belongs to (0-indexed).
- `optimizer_step`, `epoch`: the counters when the record was written, null when nobody counted them.
- `frame`: the frame's index: within the report (0 is its oldest frame), or within the traced batch (call order).
- `module`, `class`: the module's qualified name ("" for the root) and class; `direction`: "forward", "backward" or
  "recompute" (a forward that activation checkpointing ran again during backward, recorded with `watch_gradients`).
- `label`: "weight", "input[0]", "output.logits", "grad output", ... as the text shows it (null only for a frame
  that holds no line at all); `role`: "parameter", "input", "output" or "loss" (in a backward frame: the tensor
  whose gradient the line is).
- `dtype`, `shape`: of the tensor, null when there is none (`shape` is also null for a nested tensor).
- one column per value of every registered statistic (core/stats/registry.py): `abs_min`, `abs_max` (the numbers of
  the text line), `nan`, `inf` (counts: exact where known for free or traced, else null), `subnormal`,
  `target_subnormal`, `target_zero` (with `count_underflow`, else null), and those of any statistic registered since.
- `note`: what the text shows instead of numbers ("None", "not a tensor", "empty", "meta: not measured", ...);
  beside numbers, what they were taken from where that is not every element as the tensor holds it
  ("sparse_coo: values", "nested: values"); else null.
- report records only (null in trace records): `report_batch`, `report_module` (where inf/nan was detected),
  `report_frames` (how many frames the report has), `report_culprit` (the culprit line) and `report_footer` (all the
  text the report has after its frames: the culprit, the loss scale, ...).

Numbers: JSON has no literal for infinity or nan, so a non-finite number is one of the strings "inf", "-inf" or
"nan"; any other number is a JSON number (integers stay integers, floats keep every digit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nanwatch.core.frames import BACKWARD_SUFFIX, GRAD_PREFIX, Direction, ResolvedEntry, Role, shown_class
from nanwatch.core.stats import registry
from nanwatch.core.stats.base import Number, Values, decode_number

__all__ = ["SCHEMA_VERSION", "KINDS", "LineRecord"]

SCHEMA_VERSION = 2
_READS = (1, 2)
KINDS = ("report", "trace")


@dataclass(frozen=True, slots=True)
class LineRecord:
    """One line of a report or a trace: the schema, defined once (see the module docstring for each field)."""

    kind: str
    rank: int
    world_size: int
    phase: str
    batch: int
    optimizer_step: int | None
    epoch: int | None
    frame: int
    module: str
    class_name: str
    label: str | None
    dtype: str | None
    shape: tuple[int, ...] | None
    abs_min: Number | None
    abs_max: Number | None
    note: str | None
    direction: Direction = Direction.FORWARD
    role: Role | None = None
    stats: Mapping[str, Values] = field(default_factory=dict)
    report_batch: int | None = None
    report_module: str | None = None
    report_frames: int | None = None
    report_culprit: str | None = None
    report_footer: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": SCHEMA_VERSION,
            "kind": self.kind,
            "rank": self.rank,
            "world_size": self.world_size,
            "phase": self.phase,
            "batch": self.batch,
            "optimizer_step": self.optimizer_step,
            "epoch": self.epoch,
            "frame": self.frame,
            "module": self.module,
            "class": self.class_name,
            "direction": self.direction.value,
            "label": self.label,
            "role": None if self.role is None else self.role.value,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
        }
        data.update(registry.lead().to_columns(self.range))
        for statistic in registry.extras():
            data.update(statistic.to_columns(self.stats.get(statistic.name)))
        data.update(
            note=self.note,
            report_batch=self.report_batch,
            report_module=self.report_module,
            report_frames=self.report_frames,
            report_culprit=self.report_culprit,
            report_footer=self.report_footer,
        )
        return data

    @classmethod
    def from_dict(cls, data: object) -> LineRecord:
        """Read a record back (version 1 or 2), checking every field.

        Raises:
            ValueError: a field is missing or has the wrong type, or the version is not one this nanwatch reads.
        """
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version not in _READS or isinstance(version, bool):
            raise ValueError(f"schema version {version!r} is not one this nanwatch reads (it reads {list(_READS)})")
        kind = _get(data, "kind", str)
        if kind not in KINDS:
            raise ValueError(f"kind can be one of {KINDS}, got {kind!r}")
        shape = _get(data, "shape", list, optional=True)
        if shape is not None and not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise ValueError(f"shape must be a list of whole numbers, got {shape!r}")
        class_name = _get(data, "class", str)
        label = _get(data, "label", str, optional=True)
        if version == 1:
            direction, class_name, role = _v1_meaning(class_name, label)
        else:
            direction = _enum(Direction, _get(data, "direction", str), "direction")
            role_name = _get(data, "role", str, optional=True)
            role = None if role_name is None else _enum(Role, role_name, "role")
        stats: dict[str, Values] = {}
        for statistic in registry.extras():
            values = statistic.from_columns(data)
            if values is not None:
                stats[statistic.name] = values
        optional = {key: _get(data, key, int, optional=True) if key in data else None for key in _OPTIONAL_INTS}
        return cls(
            kind=kind,
            rank=_get(data, "rank", int),
            world_size=_get(data, "world_size", int),
            phase=_get(data, "phase", str),
            batch=_get(data, "batch", int),
            optimizer_step=_get(data, "optimizer_step", int, optional=True),
            epoch=_get(data, "epoch", int, optional=True),
            frame=_get(data, "frame", int),
            module=_get(data, "module", str),
            class_name=class_name,
            label=label,
            dtype=_get(data, "dtype", str, optional=True),
            shape=tuple(shape) if shape is not None else None,
            abs_min=_number(data, "abs_min"),
            abs_max=_number(data, "abs_max"),
            note=_get(data, "note", str, optional=True),
            direction=direction,
            role=role,
            stats=stats,
            report_batch=optional["report_batch"],
            report_module=_get(data, "report_module", str, optional=True) if "report_module" in data else None,
            report_frames=optional["report_frames"],
            # Absent from files written before they existed: those read as before.
            report_culprit=_get(data, "report_culprit", str, optional=True) if "report_culprit" in data else None,
            report_footer=_get(data, "report_footer", str, optional=True) if "report_footer" in data else None,
        )

    @property
    def non_finite(self) -> bool:
        return isinstance(self.abs_max, float) and not math.isfinite(self.abs_max)

    @property
    def range(self) -> Values | None:
        return None if self.abs_max is None else (self.abs_min, self.abs_max)

    @property
    def shown_class(self) -> str:
        return shown_class(self.class_name, self.direction)

    def column(self, name: str) -> Number | None:
        """The value of one statistic column (`"nan"`, `"subnormal"`, ...), None where it is null."""
        if name in ("abs_min", "abs_max"):
            return self.abs_min if name == "abs_min" else self.abs_max
        for statistic in registry.extras():
            for index, column in enumerate(statistic.columns):
                if column.name == name:
                    values = self.stats.get(statistic.name)
                    return None if values is None else values[index]
        raise KeyError(f"no statistic has a column named {name!r}")

    def to_entry(self) -> ResolvedEntry:
        assert self.label is not None, "a frame without lines has no entry"
        role = self.role if self.role is not None else Role.OUTPUT
        return ResolvedEntry(
            self.label, role, self.abs_min, self.abs_max, self.dtype, self.shape, self.note, dict(self.stats)
        )


_OPTIONAL_INTS = ("report_batch", "report_frames")


def _v1_meaning(class_name: str, label: str | None) -> tuple[Direction, str, Role | None]:
    # Version 1 kept meaning in the display strings only; this is the one place that reads it back, for old files.
    direction = Direction.FORWARD
    if class_name.endswith(BACKWARD_SUFFIX):
        direction, class_name = Direction.BACKWARD, class_name.removesuffix(BACKWARD_SUFFIX)
    if label is None:
        return direction, class_name, None
    bare = label.removeprefix(GRAD_PREFIX) if direction is Direction.BACKWARD else label
    if bare == "loss" and class_name == "Tensor":
        role = Role.LOSS
    elif bare.startswith(("input[", "input.")) or bare == "input":
        role = Role.INPUT
    elif bare == "output" or bare.startswith(("output[", "output.")):
        role = Role.OUTPUT
    else:
        role = Role.PARAMETER
    return direction, class_name, role


def _enum(kind: type[Direction] | type[Role], value: str, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} can be one of {[member.value for member in kind]}, got {value!r}") from None


def _number(data: Mapping[str, Any], key: str) -> Number | None:
    return decode_number(data.get(key), field=key)


def _get(data: Mapping[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
    if key not in data:
        raise ValueError(f"field {key!r} is missing")
    value = data[key]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = f"{kind.__name__} or null" if optional else kind.__name__
        raise ValueError(f"field {key!r} must be {expected}, got {value!r}")
    return value
