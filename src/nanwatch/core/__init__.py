"""nanwatch's framework-neutral core: the engine, its features, statistics, frames, reports, formats, config.

Layers, each importing only those below it (enforced by import-linter, see pyproject.toml): errors -> leaves (config,
log, walk, torch_glue/, scope) -> distributed/ -> stats -> frames -> report -> feature_api -> formats -> engine/ and
features/ -> watcher. The names below are imported when first used, so reading reports (`nanwatch show`) never
imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanwatch._lazy import lazy_exports

if TYPE_CHECKING:
    from nanwatch.core.config import WatchConfig, resolve_config
    from nanwatch.core.distributed.board import DetectionBoard
    from nanwatch.core.distributed.ranks import Detection, world_size_and_rank
    from nanwatch.core.feature_api import EngineContext, Feature
    from nanwatch.core.frames import (
        Direction,
        Entry,
        Frame,
        FrameRing,
        RecordedFrame,
        ResolvedEntry,
        ResolvedFrame,
        Role,
    )
    from nanwatch.core.report import Report
    from nanwatch.core.stats.cache import StatsCache
    from nanwatch.core.stats.measure import Measurement, measure
    from nanwatch.core.watcher import Watcher
    from nanwatch.errors import ConfigError

__all__ = [
    "ConfigError",
    "Direction",
    "EngineContext",
    "Entry",
    "Feature",
    "Frame",
    "FrameRing",
    "RecordedFrame",
    "Detection",
    "DetectionBoard",
    "Measurement",
    "Report",
    "ResolvedEntry",
    "ResolvedFrame",
    "Role",
    "StatsCache",
    "WatchConfig",
    "Watcher",
    "measure",
    "resolve_config",
    "world_size_and_rank",
]

_HOMES = {
    "ConfigError": "nanwatch.errors",
    "WatchConfig": "nanwatch.core.config",
    "resolve_config": "nanwatch.core.config",
    "EngineContext": "nanwatch.core.feature_api",
    "Feature": "nanwatch.core.feature_api",
    "Direction": "nanwatch.core.frames",
    "Entry": "nanwatch.core.frames",
    "Frame": "nanwatch.core.frames",
    "FrameRing": "nanwatch.core.frames",
    "RecordedFrame": "nanwatch.core.frames",
    "ResolvedEntry": "nanwatch.core.frames",
    "ResolvedFrame": "nanwatch.core.frames",
    "Role": "nanwatch.core.frames",
    "Detection": "nanwatch.core.distributed.ranks",
    "DetectionBoard": "nanwatch.core.distributed.board",
    "world_size_and_rank": "nanwatch.core.distributed.ranks",
    "Report": "nanwatch.core.report",
    "Measurement": "nanwatch.core.stats.measure",
    "StatsCache": "nanwatch.core.stats.cache",
    "measure": "nanwatch.core.stats.measure",
    "Watcher": "nanwatch.core.watcher",
}


__getattr__ = lazy_exports(__name__, _HOMES, globals())


def __dir__() -> list[str]:
    return sorted(__all__)
