"""`nanwatch --help`, `show`, `diff` and `plot` never import torch: reading a report must not pay for loading torch.

Each command runs in a fresh interpreter (this one has torch loaded already) on files written by a real watched run,
and that interpreter asserts, after `nanwatch.cli.main` returns, that torch is not in `sys.modules`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests.trace_models import run_amp_net, trace_path

# Runs `main(argv)` and exits with its status; a torch import fails the assertion (exit 1, traceback on stderr).
PROBE = """\
import sys
from nanwatch.cli import main
argv = {argv!r}
try:
    status = main(argv)
except SystemExit as stop:  # argparse exits after printing --help
    status = stop.code
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
assert not loaded, f"nanwatch {{' '.join(argv)}} imported torch ({{len(loaded)}} modules: {{loaded[:3]}})"
sys.exit(status)
"""


def _probe(*argv: str) -> subprocess.CompletedProcess[str]:
    code = PROBE.format(argv=list(argv))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace of batches 0-2 and the report of batch 2, where AmpNet's float16 output overflows."""
    report_dir = tmp_path_factory.mktemp("amp_net")
    run_amp_net(report_dir, overflow_at=2, batches=3)
    return report_dir


def test_help_does_not_import_torch() -> None:
    result = _probe("--help")
    assert (result.returncode, result.stderr) == (0, "")
    for command in ("demo", "doctor", "replay", "show", "diff", "plot"):
        assert command in result.stdout


def test_show_does_not_import_torch(run_dir: Path) -> None:
    for stem in ("nanwatch-trace-rank0", "nanwatch-report-rank0-batch2"):
        result = _probe("show", str(run_dir / f"{stem}.jsonl"))
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout == (run_dir / f"{stem}.txt").read_text(encoding="utf-8")


def test_diff_does_not_import_torch(run_dir: Path) -> None:
    trace = trace_path(run_dir)
    result = _probe("diff", f"{trace}:1", f"{trace}:2")
    assert (result.returncode, result.stderr) == (1, "")  # 1: they diverge, at amp's overflow
    assert "first divergence at line 8 of 14: 'amp' (Amplify) output" in result.stdout


def test_plot_does_not_import_torch(run_dir: Path, tmp_path: Path) -> None:
    png = tmp_path / "x.png"
    result = _probe("plot", str(trace_path(run_dir)), "-o", str(png))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith(f"wrote {png} (")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_the_probe_sees_a_command_that_imports_torch() -> None:
    # `demo` trains a model: it must import torch, and the probe must say so.
    result = _probe("demo", "--steps", "0")
    assert result.returncode == 1
    assert "AssertionError: nanwatch demo --steps 0 imported torch" in result.stderr
