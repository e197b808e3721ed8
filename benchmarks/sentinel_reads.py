"""What the checks of sentinel mode and the guard read, timed alone: the floor under their overhead.

On the GPT-2 of benchmarks/overhead.py (after one backward): the guard's reduction of the 5.3M gradients
(`MagnitudePlan`, against `torch._foreach_norm(inf)`, which is one kernel per tensor on the CPU), and the one read of
the 8 x 128 x 8192 logits (the sentinel's min and max in training, its sum in evaluation, against `amax`, the
cheapest full read there is). Milliseconds, median of --repeat runs.

    python benchmarks/sentinel_reads.py
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import build_model  # noqa: E402

from nanwatch.core.stats.stacking import MagnitudePlan  # noqa: E402


def _median_ms(action: Callable[[], object], repeat: int) -> float:
    action()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(8192, 128, 0)
    ids = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(0))
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    logits = output.logits.detach()
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    plan = MagnitudePlan(grads)
    rows = [
        (f"guard: MagnitudePlan over {len(grads)} gradients ({sum(g.nbytes for g in grads) / 2**20:.0f} MB)",
         lambda: plan.launch(grads)),
        ("guard: torch._foreach_norm(inf) over the same", lambda: torch._foreach_norm(grads, math.inf)),
        (f"sentinel, training: aminmax of the logits ({logits.nbytes / 2**20:.0f} MB)", lambda: torch.aminmax(logits)),
        ("sentinel, evaluation: sum of the logits", lambda: logits.sum()),
        ("the cheapest full read: amax of the logits", lambda: logits.amax()),
    ]  # fmt: skip
    for label, action in rows:
        print(f"{label:<62}{_median_ms(action, args.repeat):8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
