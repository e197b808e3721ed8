"""Instructions per step on issue 21's dispatch-bound step, counted by Valgrind (cachegrind): a figure that does not
move with the machine's load, for changes too small for the timings' noise (a few hundredths of a ratio).

Each variant runs in a process of its own under `valgrind --tool=cachegrind`, once for `--short` steps and once for
`--long` steps after the same start (imports, model, warm-up); the difference divided by the extra steps is what one
steady-state step executes. Variants: `none` (no hook), `hook` (a hook that returns at once on every module: torch's
hook dispatch alone) and `watch` (`nanwatch.watch(model, optimizer=optimizer)`).

    python benchmarks/instructions.py            # needs valgrind; about ten minutes on two cores
    python benchmarks/instructions.py --run watch --steps 5    # one run, what valgrind is given

Instructions are not time: a cache miss costs many, and the timings (benchmarks/overhead.py) stay the measure of
what a user sees. A benchmark, not a test: it prints what this machine's Python and torch execute.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hook_floor import dispatch_step  # noqa: E402  (the same step)

VARIANTS = ("none", "hook", "watch")
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def run(variant: str, steps: int) -> None:
    """`steps` steady-state steps of `variant` (after five of warm-up, which every run shares)."""
    torch.set_num_threads(1)  # one thread: valgrind serialises threads anyway
    model, inputs, optimizer = dispatch_step()
    handle = None
    if variant == "watch":
        import nanwatch

        handle = nanwatch.watch(model, optimizer=optimizer)
    elif variant == "hook":

        def returns_at_once(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            return None

        for module in model.modules():
            module.register_forward_hook(returns_at_once, with_kwargs=True)
    for _ in range(5 + steps):
        optimizer.zero_grad(set_to_none=True)
        model(inputs).square().mean().backward()
        optimizer.step()
        if handle is not None:
            handle.step()


def counted(variant: str, steps: int) -> int:
    """Instructions valgrind counted for one run of `variant`."""
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    command += [sys.executable, __file__, "--run", variant, "--steps", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = _REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run of {variant!r} ({steps} steps) failed:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", choices=VARIANTS, help="run one variant (what valgrind is given)")
    parser.add_argument("--steps", type=int, default=5, help="with --run: steps after the warm-up")
    parser.add_argument("--short", type=int, default=5, help="steps of the shorter run")
    parser.add_argument("--long", type=int, default=25, help="steps of the longer run")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    args = parser.parse_args()
    if args.run is not None:
        run(args.run, args.steps)
        return
    if not 0 <= args.short < args.long or args.jobs < 1:
        parser.error(f"need 0 <= --short < --long and --jobs >= 1, got {args.short}, {args.long}, {args.jobs}")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: this benchmark counts instructions with it")
    runs = [(variant, steps) for variant in VARIANTS for steps in (args.short, args.long)]
    with ThreadPoolExecutor(args.jobs) as pool:
        counts = dict(zip(runs, pool.map(lambda r: counted(*r), runs), strict=True))
    extra = args.long - args.short
    per_step = {v: (counts[v, args.long] - counts[v, args.short]) / extra for v in VARIANTS}
    model, _, _ = dispatch_step()
    calls = sum(1 for _ in model.modules())
    print(f"dispatch-bound step ({calls:,} module calls), {extra} steps counted; torch {torch.__version__}")
    print(f"{'variant':<8} {'M instructions/step':>20} {'x none':>7} {'added per module call':>22}")
    for variant in VARIANTS:
        added = (per_step[variant] - per_step["none"]) / calls
        ratio = per_step[variant] / per_step["none"]
        print(f"{variant:<8} {per_step[variant] / 1e6:20.1f} {ratio:7.3f} {added:18,.0f} instr")
    own = (per_step["watch"] - per_step["hook"]) / calls
    print(f"nanwatch's own (watch - hook): {(per_step['watch'] - per_step['hook']) / 1e6:.1f} M/step, {own:,.0f}/call")


if __name__ == "__main__":
    main()
