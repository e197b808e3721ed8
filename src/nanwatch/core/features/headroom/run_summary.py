"""The headroom monitor's summary at close: the worst tensor of each kind over the run, and target_dtype's answer.

Apart from the monitor because it only reads what the run found (the monitor's settings, its worst findings and the
largest abs max), in words; the warnings during the run are the monitor's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanwatch.core.features.headroom.findings import Finding, FindingKind, times
from nanwatch.core.frames import counter_name
from nanwatch.core.stats.limits import Limits

__all__ = ["RunFindings", "TITLES", "summary_text"]

# Each kind's line in the summary, in the order shown; `{target}` is the target dtype's name.
TITLES: dict[FindingKind, str] = {
    "target_overflow": "would overflow {target}",
    "target_headroom": "within the warn fraction of {target}'s max",
    "headroom": "within the warn fraction of their own dtype's max",
    "underflow": "too many subnormal values in their own dtype",
    "target_underflow": "too many values that would be subnormal in {target}",
}


@dataclass(frozen=True, slots=True)
class RunFindings:
    """What the monitor found over the run, and the settings it judged by: all the summary reads."""

    target: Limits | None
    warn_fraction: float | None
    counts_underflow: bool
    underflow_warn_fraction: float
    rank: int
    world_size: int
    checks: int
    worst: dict[FindingKind, list[Finding]]  # each kind's worst finding per tensor, worst first
    largest_abs_max: float | None  # with a target: the largest abs max of any tensor it applies to


def summary_text(monitor: RunFindings) -> str | None:
    """What the run showed, in a few lines; None when there is nothing to say (no target, nothing found)."""
    target = monitor.target
    worst = monitor.worst
    if target is None and not any(worst.values()):
        return None
    settings = []
    if monitor.warn_fraction is not None:
        settings.append(f"headroom_warn_fraction={monitor.warn_fraction:g}")
    if target is not None:
        settings.append(f"target_dtype={target.name}")
    if monitor.counts_underflow:
        settings.append(f"underflow_warn_fraction={monitor.underflow_warn_fraction:g}")
    on_rank = f" on rank {monitor.rank}" if monitor.world_size > 1 else ""
    lines = [f"nanwatch headroom summary{on_rank} after {monitor.checks} checks ({', '.join(settings)}):"]
    target_name = target.name if target is not None else ""
    for kind, title in TITLES.items():
        found = worst[kind]
        if not found:
            continue
        tensors = "1 tensor" if len(found) == 1 else f"{len(found)} tensors"
        counter = counter_name(found[0].phase)
        lines.append(
            f"  {title.format(target=target_name)}: {tensors}; worst at {counter}={found[0].batch_number}: "
            f"{found[0].line()}"
        )
    if target is not None:
        largest = monitor.largest_abs_max
        if largest is not None and math.isfinite(largest) and largest > 0:
            room = target.max / largest
            verdict = f"headroom {times(room)}x" if room >= 1 else f"{times(1 / room)}x over"
            lines.append(
                f"  largest abs max of any tensor judged against {target.name}: {largest:.2e} "
                f"({verdict} its max {target.max:.2e})"
            )
        if not worst["target_overflow"]:
            lines.append(f"  no watched tensor would overflow {target.name}")
        if not monitor.counts_underflow:
            lines.append("  underflow not counted (set count_underflow=True to count values that would flush)")
        elif not worst["target_underflow"]:
            lines.append(
                f"  no tensor had more than {monitor.underflow_warn_fraction:.1%} of its values below "
                f"{target.name}'s smallest normal"
            )
    return "\n".join(lines)
