"""Instructions of each part of a watched step, on issue 21's dispatch-bound step, counted by Valgrind (callgrind):
where nanwatch's added work goes, in a figure that does not move with the machine's load.

One process under `valgrind --tool=callgrind --instr-atstart=no`: the imports and the warm-up run uninstrumented, then
`--steps` steps unwatched and as many watched (`nanwatch.watch(model, optimizer=optimizer)`, after a few steps of
warm-up so the calls are deferred, as in a long run). Each phase of a step (forward, backward, optimizer step and
check) is counted apart, and inside it each named engine part (wrapped while counting): instructions per step, each
part's own (a part called inside another is counted once, as itself). The counts are cut from Python through callgrind's
client requests, in a few lines of C compiled at run time (a C compiler and valgrind's headers are needed).

    python benchmarks/instruction_parts.py          # about two minutes on two cores

Instructions are not time (benchmarks/overhead.py and benchmarks/step_parts.py time the same step); the torch functions
named here (the optimizer's) are counted in both variants, to show what a watched step moves out of them. A benchmark,
not a test: it prints what this machine's Python and torch execute.
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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hook_floor import dispatch_step  # noqa: E402  (the same step)

_HELPER = """
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; }
void zero(void) { CALLGRIND_ZERO_STATS; }
void dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
# (module, owner within it or "", function): the parts counted apart.
PARTS = [
    ("nanwatch.core.stats.cache", "StatsCache", "_measure_tracked"),
    ("nanwatch.core.stats.stacking", "StackPlan", "measure_whole"),
    ("nanwatch.core.stats.cache", "", "_pointers"),
    ("nanwatch.core.engine.deferral", "Deferral", "settle"),
    ("nanwatch.core.engine.deferral", "Deferral", "_check_parameters"),
    ("nanwatch.core.engine.deferred_frames", "DeferredOutputs", "changed"),
    ("nanwatch.core.engine.deferred_frames", "DeferredOutputs", "measure"),
    ("nanwatch.core.features.guard", "GradientGuard", "on_optimizer_step"),
    ("nanwatch.core.features.guard", "", "gradients_to_apply"),
    ("nanwatch.core.features.guard", "_Plans", "launch"),
    ("nanwatch.core.stats.stacking", "MagnitudePlan", "launch"),
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


def run(library: str, steps: int) -> None:
    """The counted process: `steps` steps unwatched, then as many watched."""
    import nanwatch

    torch.set_num_threads(1)  # valgrind serialises threads anyway
    model, inputs, optimizer = dispatch_step()
    counter = Counter(library)
    undo = []
    for module_name, owner_name, name in PARTS:
        module = importlib.import_module(module_name)
        undo.append(counter.wrap(getattr(module, owner_name) if owner_name else module, name))
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


def counts(folder: Path, steps: int) -> dict[str, float]:
    """Instructions per step by `variant|phase|part`, from callgrind's dumps in `folder`."""
    found: dict[str, float] = defaultdict(float)
    for dump in folder.glob("callgrind.out*"):
        text = dump.read_text(errors="replace")
        label, total = _LABEL.search(text), _TOTAL.search(text)
        if label is not None and total is not None:
            found[label.group(1)] += int(total.group(1)) / steps
    return found


def show(found: dict[str, float]) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps counted of each variant")
    parser.add_argument("--run", metavar="LIBRARY", help="the counted process (what valgrind is given)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be positive, got {args.steps}")
    if args.run is not None:
        run(args.run, args.steps)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: this benchmark counts instructions with it")
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        library = build_helper(folder)
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/callgrind.out"]
        command += [sys.executable, __file__, "--run", str(library), "--steps", str(args.steps)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the valgrind run failed:\n{done.stderr[-2000:]}")
        found = counts(folder, args.steps)
    model, _, _ = dispatch_step()
    calls = sum(1 for _ in model.modules())
    print(f"dispatch-bound step ({calls:,} module calls), {args.steps} steps of each; torch {torch.__version__}")
    show(found)


if __name__ == "__main__":
    main()
