"""core/log.py: the "nanwatch" logger prints to stderr by default, and a level the user set is theirs to keep.

Each test runs a fresh interpreter: the logger is process-wide, and what matters is its state before nanwatch first
touches it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Watches a model for one batch, then asks for the summary, which nanwatch logs at INFO.
_RUN = """
import logging
import torch
{before}
import nanwatch

model = torch.nn.Linear(2, 2)
with nanwatch.watch(model) as handle:
    model(torch.ones(1, 2))
    handle.step()
    handle.summary()
    logging.getLogger("nanwatch").warning("a warning still shows")
print(logging.getLevelName(logging.getLogger("nanwatch").level))
"""


def _run(before: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-c", _RUN.format(before=before)], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.slow
def test_a_level_set_before_nanwatch_first_logs_is_kept() -> None:
    # Before: get_logger() set INFO over it the first time, and the summary was printed anyway.
    result = _run('logging.getLogger("nanwatch").setLevel(logging.WARNING)')
    assert result.stdout.strip() == "WARNING"
    assert "nanwatch summary of batch_number=0" not in result.stderr
    assert "a warning still shows" in result.stderr  # nanwatch's stderr handler is there all the same


@pytest.mark.slow
def test_with_no_level_set_info_lines_are_shown_on_stderr() -> None:
    # The other side of the test above: the same run with no level of the user's prints the summary.
    result = _run("")
    assert result.stdout.strip() == "INFO"
    assert "nanwatch summary of batch_number=0: largest abs max" in result.stderr
    assert "a warning still shows" in result.stderr
