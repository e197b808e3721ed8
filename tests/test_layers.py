"""The layers of ../shared/DESIGN.md hold: every import points down (import-linter's contracts in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    # The same check as `nox -s lint`; import-linter counts TYPE_CHECKING imports and imports inside functions.
    script = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(script), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = (REPO / "pyproject.toml").read_text(encoding="utf-8").count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {contracts} kept, 0 broken." in result.stdout  # every contract ran, the cli's included
