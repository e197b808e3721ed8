"""The public surface: exactly the intended names, nothing leaked, no optional framework imported."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import nanwatch
import nanwatch.core

TOP_LEVEL = {
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
}

CORE = {
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
}

OPTIONAL_FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "transformers")


def _public_namespace(module: types.ModuleType) -> set[str]:
    """Names a user sees with `dir()` (the lazily imported ones included), less submodules bound as attributes."""
    return {
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    }


def test_top_level_exports_are_exactly_the_intended_ones() -> None:
    assert len(nanwatch.__all__) == len(set(nanwatch.__all__))
    assert set(nanwatch.__all__) == TOP_LEVEL
    assert _public_namespace(nanwatch) == TOP_LEVEL - {"__version__"}
    for name in nanwatch.__all__:
        assert getattr(nanwatch, name) is not None
    assert isinstance(nanwatch.__version__, str)


def test_core_exports_are_exactly_the_intended_ones() -> None:
    assert len(nanwatch.core.__all__) == len(set(nanwatch.core.__all__))
    assert set(nanwatch.core.__all__) == CORE
    assert _public_namespace(nanwatch.core) == CORE


def test_top_level_and_core_export_the_same_objects() -> None:
    for name in TOP_LEVEL & CORE:
        assert getattr(nanwatch, name) is getattr(nanwatch.core, name)


def test_every_core_module_declares_what_it_exports() -> None:
    for info in pkgutil.walk_packages(nanwatch.core.__path__, "nanwatch.core."):
        module = importlib.import_module(info.name)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{info.name} has no __all__"
        missing = [name for name in exported if not hasattr(module, name)]
        assert not missing, f"{info.name}.__all__ names {missing}, which it does not define"


def test_package_ships_py_typed() -> None:
    assert (Path(nanwatch.__file__).parent / "py.typed").is_file()


@pytest.mark.slow
def test_import_nanwatch_imports_no_optional_framework() -> None:
    code = (
        "import sys\n"
        "import nanwatch, nanwatch.core, nanwatch.adapters, nanwatch.adapters.plain\n"
        f"loaded = sorted(m for m in {OPTIONAL_FRAMEWORKS!r} if m in sys.modules)\n"
        "print(','.join(loaded))\n"
        "assert 'torch' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"import nanwatch imported {result.stdout.strip()}"


@pytest.mark.slow
def test_import_nanwatch_imports_no_torch_until_a_name_needs_it() -> None:
    code = (
        "import sys\n"
        "import nanwatch, nanwatch.core, nanwatch.cli\n"
        "assert 'torch' not in sys.modules, 'import nanwatch imported torch'\n"
        "nanwatch.WatchConfig()\n"
        "assert 'torch' not in sys.modules, 'WatchConfig imported torch'\n"
        "nanwatch.watch\n"
        "assert 'torch' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'wach'"):
        nanwatch.wach  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'Wacher'"):
        nanwatch.core.Wacher  # noqa: B018
