"""Instructions per step on the dispatch-bound step, counted by Valgrind: a figure that does not move with the
machine's load, for changes too small for the timings' noise (a few hundredths of a ratio).

Each variant runs in a process of its own under `valgrind --tool=cachegrind`, once for `--short` steps and once for
`--long` steps after the same start (imports, model, warm-up); the difference divided by the extra steps is what one
steady-state step executes. Variants: `none` (no hook), `hook` (a hook that returns at once on every module: torch's
hook dispatch alone) and `watch` (`nanwatch.watch(model, optimizer=optimizer)`).

With `--parts`, one process under `valgrind --tool=callgrind` instead counts where a watched step's instructions go:
`--steps` steps unwatched, then as many watched (after a few of warm-up), each phase of a step (forward, backward,
optimizer step and check) apart, and inside it each of the engine's parts listed in PARTS (wrapped while counting;
a part called inside another is counted once, as itself). PARTS names nanwatch's internal functions, which is what
this option is for: a part that is no longer where PARTS says is left out, and named. Needs a C compiler and
valgrind's headers (the counts are cut from Python through callgrind's client requests).

    python benchmarks/instructions.py            # needs valgrind; about ten minutes on two cores
    python benchmarks/instructions.py --run watch --steps 5    # one run, what valgrind is given
    python benchmarks/instructions.py --parts    # where the watched step's instructions go; about two minutes

Instructions are not time: a cache miss costs many, and the timings (benchmarks/overhead.py) stay the measure of
what a user sees. A benchmark, not a test: it prints what this machine's Python and torch execute.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _shared import dispatch_step

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


# ------------------------------------------------------------------------------------ --parts: callgrind, by part

_HELPER = """
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; }
void zero(void) { CALLGRIND_ZERO_STATS; }
void dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
# (module, owner within it or "", function): the parts counted apart. nanwatch's internals, on purpose (what is
# counted is where its own work goes); one that moved is left out and named in the output.
PARTS = [
    ("nanwatch.core.stats.cache", "StatsCache", "_measure_tracked"),
    ("nanwatch.core.stats.grouped", "StackPlan", "measure_whole"),
    ("nanwatch.core.stats.cache", "", "_pointers"),
    ("nanwatch.core.engine.recording.deferral", "Deferral", "settle"),
    ("nanwatch.core.engine.recording.deferral", "Deferral", "_check_parameters"),
    ("nanwatch.core.engine.recording.deferred_frames", "DeferredOutputs", "changed"),
    ("nanwatch.core.engine.recording.deferred_frames", "DeferredOutputs", "measure"),
    ("nanwatch.core.features.guard", "GradientGuard", "on_optimizer_step"),
    ("nanwatch.core.features.guard", "", "gradients_to_apply"),
    ("nanwatch.core.features.guard", "_Plans", "launch"),
    ("nanwatch.core.stats.grouped", "MagnitudePlan", "launch"),
    ("nanwatch.core.engine.checker", "Checker", "check"),
    ("nanwatch.core.engine.checker", "Checker", "screen"),
    ("nanwatch.core.engine.checker", "", "stack_maxima"),
    ("nanwatch.core.engine.checker", "Checker", "_commit"),
    ("nanwatch.core.features.summary", "SummaryFeature", "on_commit"),
    ("torch.optim.sgd", "SGD", "_init_group"),
    ("torch.optim.sgd", "", "_multi_tensor_sgd"),
]
PHASES = ("forward", "backward", "optimizer")  # the last: the optimizer step and the check (`handle.step()`)
_SHOWN = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step and check"}
_LABEL = re.compile(r"^desc: Trigger: Client Request: (\S+)$", re.M)  # labels hold no space
_TOTAL = re.compile(r"^(?:totals|summary): (\d+)", re.M)
_MISSING = "parts not found: "  # the counted process's last line, when some part of PARTS is not where it says


class Counter:
    """Cuts callgrind's count at each change of phase or part; the labels say `variant|phase|part`."""

    def __init__(self, library: str) -> None:
        self._lib = ctypes.CDLL(library)
        self.variant, self.phase, self.on = "none", PHASES[0], False
        self._inside: list[str] = []

    def start(self) -> None:
        self._lib.start()

    def begin_step(self) -> None:
        self.on = True
        self._lib.zero()

    def end_phase(self, next_phase: str | None) -> None:
        self._lib.dump(f"{self.variant}|{self.phase}|-".encode())
        if next_phase is None:
            self.on = False
        else:
            self.phase = next_phase

    def wrap(self, owner: Any, name: str) -> Callable[[], None]:
        """Count `owner.name` apart while counting; returns the undo."""
        original = getattr(owner, name)
        part = f"{getattr(owner, '__name__', '').split('.')[-1]}.{name}"

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            self._lib.dump((self._inside[-1] if self._inside else f"{self.variant}|{self.phase}|-").encode())
            self._inside.append(f"{self.variant}|{self.phase}|{part}")
            try:
                return original(*args, **kwargs)
            finally:
                self._lib.dump(self._inside.pop().encode())

        setattr(owner, name, counted)
        return lambda: setattr(owner, name, original)


def run_parts(library: str, steps: int) -> None:
    """`--parts`' counted process: `steps` steps unwatched, then as many watched."""
    import nanwatch

    torch.set_num_threads(1)  # valgrind serialises threads anyway
    model, inputs, optimizer = dispatch_step()
    counter = Counter(library)
    undo, missing = [], []
    for module_name, owner_name, name in PARTS:
        try:
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            getattr(owner, name)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}:{owner_name + '.' if owner_name else ''}{name}")
            continue
        undo.append(counter.wrap(owner, name))
    losses: list[torch.Tensor] = []

    def step(handle: nanwatch.WatchHandle | None, counted: bool) -> None:
        optimizer.zero_grad(set_to_none=True)
        if counted:
            counter.begin_step()
        loss = model(inputs).square().mean()
        losses[:] = [loss]  # the last step's graph goes here, in the forward, as in a loop that rebinds `loss`
        if counted:
            counter.end_phase(PHASES[1])
        loss.backward()
        if counted:
            counter.end_phase(PHASES[2])
        optimizer.step()
        if handle is not None:
            handle.step()
        if counted:
            counter.end_phase(None)
            counter.phase = PHASES[0]

    for _ in range(3):
        step(None, False)
    counter.start()
    for _ in range(steps):
        step(None, True)
    with nanwatch.watch(model, optimizer=optimizer) as handle:
        counter.variant = "watch"
        for _ in range(5):
            step(handle, False)
        for _ in range(steps):
            step(handle, True)
    for restore in undo:
        restore()
    if missing:
        print(_MISSING + ", ".join(missing), flush=True)


def build_helper(folder: Path) -> Path:
    """The client-request helper, compiled for this machine."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("a C compiler (cc) is needed to build the callgrind helper")
    source, library = folder / "callgrind_helper.c", folder / "callgrind_helper.so"
    source.write_text(_HELPER)
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"could not build the callgrind helper (valgrind's headers?):\n{done.stderr.decode()}")
    return library


def part_counts(folder: Path, steps: int) -> dict[str, float]:
    """Instructions per step by `variant|phase|part`, from callgrind's dumps in `folder`."""
    found: dict[str, float] = defaultdict(float)
    for dump in folder.glob("callgrind.out*"):
        text = dump.read_text(errors="replace")
        label, total = _LABEL.search(text), _TOTAL.search(text)
        if label is not None and total is not None:
            found[label.group(1)] += int(total.group(1)) / steps
    return found


def show_parts(found: dict[str, float]) -> None:
    print(f"{'phase / part (M instructions per step, own)':<52} {'none':>8} {'watch':>8} {'added':>8}")
    total = {"none": 0.0, "watch": 0.0}
    for phase in PHASES:
        keys = sorted({key.split("|", 1)[1] for key in found if key.split("|")[1] == phase})
        for key in keys:
            none, watch = found.get(f"none|{key}", 0.0), found.get(f"watch|{key}", 0.0)
            part = key.split("|")[1]
            label = f"  {part}" if part != "-" else "  (the rest of the phase)"
            print(f"{label:<52} {none / 1e6:8.2f} {watch / 1e6:8.2f} {(watch - none) / 1e6:8.2f}")
        sums = {variant: sum(v for k, v in found.items() if k.startswith(f"{variant}|{phase}|")) for variant in total}
        for variant in total:
            total[variant] += sums[variant]
        added = sums["watch"] - sums["none"]
        print(f"{_SHOWN[phase]:<52} {sums['none'] / 1e6:8.2f} {sums['watch'] / 1e6:8.2f} {added / 1e6:8.2f}")
    added = total["watch"] - total["none"]
    print(f"{'step':<52} {total['none'] / 1e6:8.2f} {total['watch'] / 1e6:8.2f} {added / 1e6:8.2f}", end="")
    print(f"  ({total['watch'] / total['none']:.3f} x none)")


def parts(steps: int) -> None:
    """`--parts`: one callgrind run of `run_parts`, its counts by phase and part."""
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        library = build_helper(folder)
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/callgrind.out"]
        command += [sys.executable, __file__, "--parts-run", str(library), "--steps", str(steps)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the valgrind run failed:\n{done.stderr[-2000:]}")
        found = part_counts(folder, steps)
    model, _, _ = dispatch_step()
    calls = sum(1 for _ in model.modules())
    print(f"dispatch-bound step ({calls:,} module calls), {steps} steps of each; torch {torch.__version__}")
    show_parts(found)
    missing = [line for line in done.stdout.splitlines() if line.startswith(_MISSING)]
    if missing:
        print(f"{missing[-1]} (moved or renamed: update PARTS)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", choices=VARIANTS, help="run one variant (what valgrind is given)")
    parser.add_argument("--steps", type=int, default=5, help="with --run: steps after the warm-up; with --parts: "
                        "steps counted of each of none and watch")  # fmt: skip
    parser.add_argument("--short", type=int, default=5, help="steps of the shorter run")
    parser.add_argument("--long", type=int, default=25, help="steps of the longer run")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    parser.add_argument("--parts", action="store_true", help="count where a watched step's instructions go, by part")
    parser.add_argument("--parts-run", metavar="LIBRARY", help=argparse.SUPPRESS)  # --parts' counted process
    args = parser.parse_args()
    if args.run is not None:
        run(args.run, args.steps)
        return
    if args.parts_run is not None:
        run_parts(args.parts_run, args.steps)
        return
    if args.parts:
        if args.steps < 1:
            parser.error(f"--steps must be positive, got {args.steps}")
        if shutil.which("valgrind") is None:
            raise SystemExit("valgrind is not installed: this benchmark counts instructions with it")
        parts(args.steps)
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
