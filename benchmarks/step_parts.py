"""Where a watched step's time goes, on issue 21's dispatch-bound step (1,000 `Linear(4, 4)` + `Tanh` pairs, batch 2,
plain SGD): each part of a steady-state step timed on its own.

One model and optimizer; first `--steps` steps with nothing watching (`none`), then as many with
`nanwatch.watch(model, optimizer=optimizer)` after a few steps of warm-up (so the calls are deferred, as in a long
run). For each, the median per step of: the forward, the backward, and the optimizer step with `handle.step()`
(where the check runs). Inside the watched steps, the engine's parts are timed by wrapping them: the parameters'
batch measurement, measuring the deferred calls' outputs (`Deferral.settle`), the check's screen and its commit to the
ring, the guard's gradient reduction, and the whole check. The wrappers themselves add a little.

    python benchmarks/step_parts.py --steps 60

A benchmark, not a test: it prints what this machine does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nanwatch
from nanwatch.core.engine.checker import Checker
from nanwatch.core.engine.deferral import Deferral
from nanwatch.core.features.guard import GradientGuard
from nanwatch.core.stats.cache import StatsCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hook_floor import BATCH, PAIRS, dispatch_step  # noqa: E402  (the same step)

PARTS: list[tuple[type, str, str]] = [
    (StatsCache, "_measure_tracked", "parameters' batch measurement"),
    (Deferral, "settle", "deferred outputs measured (settle)"),
    (Checker, "screen", "the check's screen (one host read)"),
    (Checker, "_commit", "clean frames into the ring"),
    (GradientGuard, "on_optimizer_step", "the guard's gradient reduction"),
    (Checker, "check_safely", "the whole check (settle and screen included)"),
]


def timed(spent: dict[str, float], owner: type, name: str, label: str) -> Callable[[], None]:
    """Wrap `owner.name` so its time adds up in `spent[label]`; returns the undo."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each (after 10 of warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be positive, got {args.steps}")
    torch.set_num_threads(args.threads)
    model, inputs, optimizer = dispatch_step()

    def run(handle: nanwatch.WatchHandle | None, spent: dict[str, float]) -> dict[str, float]:
        phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer step and check": []}
        for step in range(10 + args.steps):
            if step == 10:
                spent.clear()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = model(inputs).square().mean()
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            optimizer.step()
            if handle is not None:
                handle.step()
            end = time.perf_counter()
            if step >= 10:
                for phase, seconds in zip(phases, (forward - start, backward - forward, end - backward), strict=True):
                    phases[phase].append(seconds)
        return {phase: statistics.median(values) * 1e3 for phase, values in phases.items()}

    none = run(None, {})
    spent: dict[str, float] = {}
    undo = [timed(spent, owner, name, label) for owner, name, label in PARTS]
    try:
        with nanwatch.watch(model, optimizer=optimizer) as handle:
            watched = run(handle, spent)
    finally:
        for restore in undo:
            restore()
    print(f"dispatch-bound step: {PAIRS:,} x (Linear(4, 4), Tanh), batch {BATCH}, SGD; {args.steps} steps each")
    print(f"{'phase (median ms per step)':<48} {'none':>7} {'watch':>7} {'added':>7}")
    for phase in none:
        print(f"{phase:<48} {none[phase]:7.2f} {watched[phase]:7.2f} {watched[phase] - none[phase]:7.2f}")
    print(f"{'part of the watched step (mean ms per step)':<48}")
    for _, _, label in PARTS:
        print(f"  {label:<46} {spent.get(label, 0.0) / args.steps * 1e3:7.2f}")


if __name__ == "__main__":
    main()
