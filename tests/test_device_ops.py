"""The launch and read counter of benchmarks/device_ops.py, run on a small GPT-2: what watching adds per step in
device ops (each a kernel launch on a GPU) and in host reads that would block one. Counts, not timings: the same on
any machine. The figures are printed (pytest -s, or the failure message) and held to the design's targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Full mode on the small GPT-2 adds 3.65 ops per module call today; the design's target is 2.0 (not met yet: the
# per-call statistics are not batched into multi-tensor kernels). This bound keeps it from growing meanwhile.
FULL_OPS_PER_CALL_NOW = 3.7


def test_sentinel_mode_adds_at_most_12_ops_and_no_blocking_read_with_a_fused_adamw(tmp_path: Path) -> None:
    output = tmp_path / "ops.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device_ops.py"), "--small", "--json", str(output)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    figures = {figure["variant"]: figure for figure in json.loads(output.read_text())["figures"]}
    assert figures["none"]["ops_per_step"] > 100  # the counter sees the model's own ops
    assert figures["sentinel"]["ops_added_per_step"] <= 12, run.stdout
    assert figures["sentinel+fused"]["ops_added_per_step"] <= 12, run.stdout
    assert figures["sentinel"]["blocking_reads_added_per_step"] <= 1, run.stdout
    assert figures["sentinel+fused"]["blocking_reads_added_per_step"] == 0, run.stdout
    assert figures["sentinel+fused"]["reads_per_step"] >= 1  # the verdict is read: a step late, not never
    for variant in ("full", "full+fused"):
        assert figures[variant]["ops_added_per_module_call"] <= FULL_OPS_PER_CALL_NOW, run.stdout
