"""Run a script under torchrun with two CPU processes, bounded by a timeout, and read torchrun's failure summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent

# torchrun's summary lists each failed worker as "rank : R (local_rank: L)" followed by "exitcode : C".
_FAILED_WORKER = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def run_torchrun(
    script: str, *args: str, timeout: float = 150, launcher_args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node 2 [launcher_args] SCRIPTS/script args...` (a free rendezvous port, gloo
    on the CPU)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *launcher_args,
        str(SCRIPTS / script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPTS)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def failed_workers(stderr: str) -> dict[int, int]:
    """Rank -> exit code of every worker torchrun reports as failed."""
    return {int(rank): int(code) for rank, code in _FAILED_WORKER.findall(stderr)}
