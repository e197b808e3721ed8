"""Headroom by dtype: warn before anything is inf, warn about values that underflow, and ask "would this fit float16?".

Every floating-point tensor is judged against its own dtype's limits (`torch.finfo`): float16 reaches inf past 65504,
bfloat16 past ~3.39e38, float8_e4m3fn saturates at 448, float8_e5m2 reaches inf past 57344; below each one's smallest
normal number values lose precision (subnormal), and below half its smallest subnormal they round to zero.

Cost. The engine reads, once per check, one flag per device that says whether every abs max is finite. This feature
adds flags to that same read: `abs_max < threshold` over the same stacked maxima (False for inf, for nan and for a
value at or past the threshold), and, with `count_underflow`, whether any tensor's underflow count exceeds
`underflow_warn_fraction` (the underflow statistic's hidden excess, core/stats/underflow.py). Only when one of them
trips are the numbers read back and the offending tensors named (a batch holding inf/nan goes on to the report).
Active on the ranks `trace_ranks` names (the others only detect inf/nan, at no extra cost).

A package, one job a module, so that the feature stays one unit to the features contract (no other feature imports
any of it): `monitor` (the feature: screen, review, warn), `findings` (what one finding is and how it reads),
`readback` (the slow path's few transfers), `run_summary` (the summary at close).
"""

from __future__ import annotations

from nanwatch.core.features.headroom.findings import WORSENING, Finding, FindingKind
from nanwatch.core.features.headroom.monitor import MAX_LINES, HeadroomMonitor

__all__ = ["Finding", "FindingKind", "HeadroomMonitor", "MAX_LINES", "WORSENING"]
