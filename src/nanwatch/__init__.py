"""nanwatch: find where a PyTorch run goes inf/nan, and show the numbers that led there.

Entry points: `nanwatch.watch(model)` for a plain loop, `nanwatch.DebugUnderflowOverflow` as a drop-in for
transformers' class, and the adapters in `nanwatch.adapters` (Lightning, Accelerate, HF Trainer), all configured by
one `WatchConfig`.

The names below are imported when first used (PEP 562), so `import nanwatch` alone, and the command-line tools that
only read files (`nanwatch --help`, `show`, `diff`, `plot`), never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanwatch._lazy import lazy_exports
from nanwatch._version import __version__

if TYPE_CHECKING:
    from nanwatch.adapters.plain import WatchHandle, watch
    from nanwatch.core.config import WatchConfig
    from nanwatch.core.features.checkpoint_load import verify_checkpoint
    from nanwatch.core.report import Report
    from nanwatch.dropin import DebugUnderflowOverflow, detect_overflow
    from nanwatch.errors import (
        BatchLimitReached,
        ConfigError,
        LossScaleBelowFloor,
        NanwatchError,
        NanwatchWarning,
        NonFiniteCheckpoint,
        NonFiniteError,
        StepsSkippedInARow,
    )
    from nanwatch.repro import enable_full_determinism, main_process_first, set_seed

__all__ = [
    "BatchLimitReached",
    "ConfigError",
    "DebugUnderflowOverflow",
    "LossScaleBelowFloor",
    "NanwatchError",
    "NanwatchWarning",
    "NonFiniteCheckpoint",
    "NonFiniteError",
    "Report",
    "StepsSkippedInARow",
    "WatchConfig",
    "WatchHandle",
    "__version__",
    "detect_overflow",
    "enable_full_determinism",
    "main_process_first",
    "set_seed",
    "verify_checkpoint",
    "watch",
]

# Where each public name lives.
_HOMES = {
    "BatchLimitReached": "nanwatch.errors",
    "ConfigError": "nanwatch.errors",
    "LossScaleBelowFloor": "nanwatch.errors",
    "NanwatchError": "nanwatch.errors",
    "NanwatchWarning": "nanwatch.errors",
    "NonFiniteError": "nanwatch.errors",
    "NonFiniteCheckpoint": "nanwatch.errors",
    "StepsSkippedInARow": "nanwatch.errors",
    "WatchConfig": "nanwatch.core.config",
    "Report": "nanwatch.core.report",
    "WatchHandle": "nanwatch.adapters.plain",
    "watch": "nanwatch.adapters.plain",
    "DebugUnderflowOverflow": "nanwatch.dropin",
    "detect_overflow": "nanwatch.dropin",
    "enable_full_determinism": "nanwatch.repro",
    "main_process_first": "nanwatch.repro",
    "set_seed": "nanwatch.repro",
    "verify_checkpoint": "nanwatch.core.features.checkpoint_load",
}


__getattr__ = lazy_exports(__name__, _HOMES, globals())


def __dir__() -> list[str]:
    return sorted(__all__)
