"""How long `nanwatch` takes to answer commands that should answer at once, and what `python -c pass` costs.

Each command runs as a fresh process (the installed console script, as a user runs it), `--runs` times; the median
and the slowest wall time are printed. No threshold is asserted: this prints figures (tests/cli/test_main.py checks
the cause, that `--help` and `--version` import no command module, no pydantic and no torch).

    .venv/bin/python benchmarks/cli_startup.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = [
    ["--help"],
    ["--version"],
    ["config"],
    ["show", "--help"],
    ["plot", "--help"],
    ["demo", "--help"],
]


def _time(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per command (default: 7)")
    args = parser.parse_args()
    script = shutil.which("nanwatch", path=str(Path(sys.executable).parent)) or shutil.which("nanwatch")
    if script is None:
        sys.exit("no nanwatch console script next to this Python or on PATH: pip install -e . first")
    print(f"{'command':<28} {'median s':>9} {'slowest s':>10}   ({args.runs} runs each, {script})")
    rows = [([sys.executable, "-c", "pass"], "python -c pass")]
    rows += [([script, *argv], "nanwatch " + " ".join(argv)) for argv in COMMANDS]
    for argv, name in rows:
        times = _time(argv, args.runs)
        print(f"{name:<28} {statistics.median(times):>9.3f} {max(times):>10.3f}")


if __name__ == "__main__":
    main()
