"""nanwatch's framework-neutral core: hooks, stats, frames, reports, config. Depends on torch only."""

from nanwatch.core.config import ConfigError, WatchConfig, resolve_config
from nanwatch.core.frames import Entry, Frame, FrameRing, ResolvedEntry, ResolvedFrame
from nanwatch.core.ranks import GlobalDetection, agree_on_detection, world_size_and_rank
from nanwatch.core.report import Report
from nanwatch.core.stats import Measurement, StatsCache, measure
from nanwatch.core.watcher import Watcher

__all__ = [
    "ConfigError",
    "Entry",
    "Frame",
    "FrameRing",
    "GlobalDetection",
    "Measurement",
    "Report",
    "ResolvedEntry",
    "ResolvedFrame",
    "StatsCache",
    "WatchConfig",
    "Watcher",
    "agree_on_detection",
    "measure",
    "resolve_config",
    "world_size_and_rank",
]
