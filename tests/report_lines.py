"""The lines a detection's report ends with, as the tests expect them: the cause (core/features/cause), the repro
capsule's line where one was written, and the culprit line, which stays the report's last line."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def capsule_line(path: str | Path) -> str:
    """The report's line for the repro capsule written to `path` (with `report_dir`, where the culprit's call was
    captured)."""
    return f"repro capsule: {path} (`nanwatch repro` runs the culprit alone; see docs/why-nan.md)"


def cause_tail(error: Any, capsule: str | Path | None = None) -> list[str]:
    """What follows a detection's frames: a blank line, `cause: <kind>: <evidence>`, the capsule's line when
    `capsule` is given, then the culprit line."""
    lines = ["", f"cause: {error.cause}"]
    if capsule is not None:
        lines.append(capsule_line(capsule))
    return [*lines, error.culprit.message]
