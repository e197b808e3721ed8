"""The launch and read counter of benchmarks/device_ops.py, run on a small GPT-2: what watching adds per step in
device ops (each a kernel launch on a GPU) and in host reads that would block one. Counts, not timings: the same on
any machine. The figures are printed (pytest -s, or the failure message) and held to the design's targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Full mode on the small GPT-2, the CPU's path: 3.16 ops per module call (two per tensor measured as it is seen, which
# is what the CPU runs fastest; a CPU op launches nothing). This bound keeps it from growing.
FULL_OPS_PER_CALL_ON_THE_CPU = 3.2


def test_watching_adds_few_device_ops_and_no_blocking_read_in_sentinel_mode_with_a_fused_adamw(tmp_path: Path) -> None:
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
        assert figures[variant]["ops_added_per_module_call"] <= FULL_OPS_PER_CALL_ON_THE_CPU, run.stdout
        # What a GPU launches: the accelerator's path (multi-tensor kernels, activations pooled), run on the CPU.
        assert figures[f"{variant}@accelerator"]["ops_added_per_module_call"] <= 2.0, run.stdout
    for variant in ("sentinel", "sentinel+fused"):  # the same targets on the accelerator's path
        accelerated = figures[f"{variant}@accelerator"]
        assert accelerated["ops_added_per_step"] <= 12, run.stdout
        assert accelerated["blocking_reads_added_per_step"] <= figures[variant]["blocking_reads_added_per_step"]
