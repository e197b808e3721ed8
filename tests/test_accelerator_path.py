"""The accelerator's way of measuring (core/stats/paths.py: multi-tensor kernels, a pool of activations measured at
the check), run on this machine's CPU tensors: the quick tiers of the differential tests against transformers'
`DebugUnderflowOverflow`, the do-no-harm twins, the core suites and the plain loop's, with `--accelerator-path`
(tests/conftest.py).
A GPU run measures this way; the numbers must be the same to the last digit, and a frame must still show what the
call returned or say it cannot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITES = [
    "tests/core",
    "tests/twins",
    "tests/adapters/test_plain.py",
    "tests/adapters/test_let_go.py",  # a closed watcher holds nothing of the model: nor does what its pool kept
    "tests/adapters/test_skip.py",
    "tests/test_watch_differential.py",
    "tests/test_watch_differential_users.py",
    "tests/test_dropin_differential.py",
]


@pytest.mark.slow
def test_the_core_suites_and_the_differential_tests_pass_on_the_accelerators_path() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--accelerator-path",
            "-m",
            "not slow",
            *SUITES,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = run.stdout.splitlines()[-1]
    assert " passed" in summary, run.stdout[-500:]
    assert " failed" not in summary, run.stdout[-500:]
