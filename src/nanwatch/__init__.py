"""nanwatch: find where a PyTorch run goes inf/nan, and show the numbers that led there.

Entry points: `nanwatch.watch(model)` for a plain loop, `nanwatch.DebugUnderflowOverflow` as a drop-in for
transformers' class, and the adapters in `nanwatch.adapters` (Lightning, Accelerate, HF Trainer), all configured by
one `WatchConfig`.
"""

from nanwatch._version import __version__
from nanwatch.adapters.plain import WatchHandle, watch
from nanwatch.core.config import ConfigError, WatchConfig
from nanwatch.core.report import Report
from nanwatch.dropin import DebugUnderflowOverflow, detect_overflow
from nanwatch.errors import BatchLimitReached, LossScaleBelowFloor, NanwatchError, NanwatchWarning, NonFiniteError
from nanwatch.repro import enable_full_determinism, main_process_first, set_seed

__all__ = [
    "BatchLimitReached",
    "ConfigError",
    "DebugUnderflowOverflow",
    "LossScaleBelowFloor",
    "NanwatchError",
    "NanwatchWarning",
    "NonFiniteError",
    "Report",
    "WatchConfig",
    "WatchHandle",
    "__version__",
    "detect_overflow",
    "enable_full_determinism",
    "main_process_first",
    "set_seed",
    "watch",
]
