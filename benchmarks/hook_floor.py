"""The floor under the hot path: what the cheapest forward hooks cost on the dispatch-bound step.

The dispatch-bound training step (1,000 `Linear(4, 4)` + `Tanh` pairs, batch 2, plain SGD) is where a watcher's
per-call cost shows most. This benchmark runs that step with hand-written
hooks that do less and less of what watching needs, beside nanwatch's own `watch()`, in paired rounds (every variant
once per round, in an order that rotates; each attached for one untimed step, then one timed), and prints each one's
step time, its ratio to the unwatched step (the median of the per-round ratios) and the time it adds per module call:

- `noop hook`: a forward hook that returns at once: what torch's hook dispatch alone costs (`_call_impl` leaves its
  fast path as soon as a module has a hook);
- `keep reference`: the hook appends `(output, output._version)` to a list, and the step ends with one bulk
  finiteness check (the outputs stacked by shape, one reduction each, one host read): the least a watcher that
  detects inf/nan in module outputs can do. No parameters, no labels, no frames, and wrong after an in-place change
  (`ReLU(inplace=True)`), which the version only detects;
- `copy output`: the hook copies each output into a row of a preallocated buffer (autograd off around it), reduced in
  bulk at the end: what in-place safety costs on top;
- `nanwatch watch`: `nanwatch.watch(model, optimizer=optimizer)` and `handle.step()`: one watcher for the whole run,
  its hooks taken off while the others step (`HookStash`, as benchmarks/overhead.py shares its model), so its steps
  are a long run's steady state.

    python benchmarks/hook_floor.py --rounds 40
    python benchmarks/hook_floor.py --rounds 40 --only "nanwatch watch"   # none and watch alone, nothing between
    python benchmarks/hook_floor.py --rounds 60 --warmup 20 --processes 10   # each in a process of its own

Variants sharing one process share its heap and its caches; `--processes N` instead runs `none`
and `watch` each alone in a fresh process, as a user's run has it (a watcher from the first step to the last, nothing
else hooked), N pairs of processes in alternating order, each timing `--rounds` steps after `--warmup`: the ratio
of each pair's median steps, and the median over the pairs.

No figure is asserted: they are what the machine does. What is checked is the harness: no variant changes the
model's classes (the stash refuses a watcher that does), so every variant runs through torch's own `Module.__call__`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from _shared import BATCH, CALLS, PAIRS, HookStash, dispatch_step, shares_its_model
from torch import nn

import nanwatch


class Variant:
    """One way of hooking the model: `attach` puts its hooks on, `end_step` runs its end-of-step work."""

    name = ""

    def attach(self, model: nn.Sequential, optimizer: torch.optim.Optimizer) -> None:
        self.handles = [module.register_forward_hook(self.hook, with_kwargs=True) for module in model.modules()]

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        return None

    def end_step(self) -> None:
        return None

    def detach(self) -> None:
        for handle in getattr(self, "handles", []):
            handle.remove()

    def close(self) -> None:
        """After the last round."""


class NoHooks(Variant):
    name = "none"

    def attach(self, model: nn.Sequential, optimizer: torch.optim.Optimizer) -> None:
        self.handles = []


class NoopHook(Variant):
    name = "noop hook"


def _finite_in_bulk(tensors: list[torch.Tensor]) -> bool:
    """One reduction per shape, one host read: are all of `tensors` finite?"""
    by_shape: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_shape.setdefault((tensor.shape, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        maxima = [torch.stack(group).abs().amax().reshape(1) for group in by_shape.values()]
        return bool(torch.isfinite(torch.cat(maxima)).all()) if maxima else True


class KeepReference(Variant):
    name = "keep reference"

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, int]] = []

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self.seen.append((output, output._version))

    def end_step(self) -> None:
        if any(output._version != version for output, version in self.seen):
            raise RuntimeError("an output changed in place after its call: what this hook kept is wrong")
        if not _finite_in_bulk([output for output, _ in self.seen]):
            raise FloatingPointError("inf/nan")
        self.seen.clear()


class CopyOutput(Variant):
    name = "copy output"

    def __init__(self) -> None:
        self.rows = torch.empty(CALLS, BATCH, 4).unbind(0)
        self.count = 0

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        torch._C._set_grad_enabled(False)
        self.rows[self.count].copy_(output)
        torch._C._set_grad_enabled(True)
        self.count += 1

    def end_step(self) -> None:
        if not _finite_in_bulk(list(self.rows[: self.count])):
            raise FloatingPointError("inf/nan")
        self.count = 0


class Watch(Variant):
    """One `watch()` for the whole run, as a training run has: its hooks (and its optimizer hooks) taken off while the
    other variants step and put back for its own, so its steps are the steady state (deferred recording included),
    not a fresh watcher's first batches."""

    name = "nanwatch watch"

    def __init__(self) -> None:
        self.handle: nanwatch.WatchHandle | None = None
        self.stash: HookStash | None = None

    def attach(self, model: nn.Sequential, optimizer: torch.optim.Optimizer) -> None:
        if self.stash is None:
            self.stash = HookStash(model, optimizer)
            self.handle = self.stash.capture(lambda: nanwatch.watch(model, optimizer=optimizer))
            shares_its_model(self.handle)  # the other variants' steps must not close it as a handle left behind
        else:
            self.stash.put_back()

    def end_step(self) -> None:
        assert self.handle is not None
        self.handle.step()

    def detach(self) -> None:
        assert self.stash is not None
        self.stash.take_off()

    def close(self) -> None:
        if self.stash is not None and self.handle is not None:
            self.stash.put_back()
            self.handle.close()


VARIANTS: list[type[Variant]] = [
    NoHooks,
    NoopHook,
    KeepReference,
    CopyOutput,
    Watch,
]


def train_step(model: nn.Sequential, inputs: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(inputs).square().mean().backward()
    optimizer.step()


def solo(variant: str, steps: int, warmup: int) -> list[float]:
    """`--processes`' child: `variant` (`none` or `watch`) alone in this process, for its whole run; the seconds of
    each of `steps` steps after `warmup`."""
    model, inputs, optimizer = dispatch_step()
    handle = nanwatch.watch(model, optimizer=optimizer) if variant == Watch.name else None
    times = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        train_step(model, inputs, optimizer)
        if handle is not None:
            handle.step()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    if handle is not None:
        handle.close()
    return times


def in_processes(pairs: int, steps: int, warmup: int, threads: int) -> None:
    """`--processes`: `none` and `watch` each alone in a process of its own, `pairs` times, in alternating order."""
    medians: dict[str, list[float]] = {NoHooks.name: [], Watch.name: []}
    print(
        f"dispatch-bound step: {PAIRS:,} x (Linear(4, 4), Tanh), {CALLS:,} module calls, batch {BATCH}, SGD(foreach); "
        f"torch {torch.__version__}, {threads} threads; {pairs} pairs of processes, {steps} steps each after {warmup}"
    )
    print(f"{'pair':<5} {'none ms':>8} {'watch ms':>9} {'x none':>7} {'us/call':>8}")
    for pair in range(pairs):
        order = [NoHooks.name, Watch.name] if pair % 2 == 0 else [Watch.name, NoHooks.name]
        for variant in order:
            command = [sys.executable, __file__, "--solo", variant, "--rounds", str(steps), "--warmup", str(warmup)]
            child = subprocess.run([*command, "--threads", str(threads)], capture_output=True, text=True)
            if child.returncode != 0:  # what the child said, not only that it failed
                raise RuntimeError(f"the {variant!r} process failed ({child.returncode}):\n{child.stderr}")
            medians[variant].append(statistics.median(json.loads(child.stdout.splitlines()[-1])))
        none, watch = medians[NoHooks.name][-1], medians[Watch.name][-1]
        per_call = (watch - none) / CALLS * 1e6
        print(f"{pair + 1:<5} {none * 1e3:8.1f} {watch * 1e3:9.1f} {watch / none:7.3f} {per_call:8.1f}")
    pairs_seen = list(zip(medians[Watch.name], medians[NoHooks.name], strict=True))
    ratio = statistics.median(watch / none for watch, none in pairs_seen)
    added = statistics.median(watch - none for watch, none in pairs_seen) / CALLS * 1e6
    print(f"median over the pairs: {ratio:.3f} x none, {added:.1f} us a call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="paired rounds (every variant once per round)")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each variant before timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        metavar="N",
        help="time `none` and `watch` each alone in a process of its own, N pairs of processes (--rounds steps each)",
    )
    parser.add_argument("--solo", choices=[NoHooks.name, Watch.name], help=argparse.SUPPRESS)  # --processes' child
    names = [make.name for make in VARIANTS]
    parser.add_argument(
        "--only",
        nargs="+",
        choices=names,
        metavar="VARIANT",
        help=f"time only these variants, `none` always among them (one of: {', '.join(map(repr, names))})",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.threads < 1 or args.warmup < 0 or args.processes < 0:
        parser.error(
            f"--rounds and --threads must be positive and --warmup, --processes not negative, got {args.rounds}, "
            f"{args.threads}, {args.warmup}, {args.processes}"
        )
    if args.processes and args.only:
        parser.error("--processes times none and watch only: leave out --only")
    torch.set_num_threads(args.threads)
    if args.solo is not None:
        print(json.dumps(solo(args.solo, args.rounds, args.warmup)))
        return
    if args.processes:
        in_processes(args.processes, args.rounds, args.warmup, args.threads)
        return
    model, inputs, optimizer = dispatch_step()
    chosen = set(args.only or names) | {NoHooks.name}
    variants = [make() for make in VARIANTS if make.name in chosen]

    def step(variant: Variant) -> float:
        start = time.perf_counter()
        train_step(model, inputs, optimizer)
        variant.end_step()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {variant.name: [] for variant in variants}
    for round_index in range(args.warmup + args.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            variant.attach(model, optimizer)
            try:
                step(variant)  # untimed: the first step after attaching sets things up
                seconds = step(variant)
            finally:
                variant.detach()
            if round_index >= args.warmup:
                times[variant.name].append(seconds)
    for variant in variants:
        variant.close()

    none = times[NoHooks.name]
    print(
        f"dispatch-bound step: {PAIRS:,} x (Linear(4, 4), Tanh), {CALLS:,} module calls, batch {BATCH}, SGD(foreach); "
        f"torch {torch.__version__}, {args.threads} threads; {args.rounds} paired rounds"
    )
    print(f"{'variant':<16} {'ms/step':>8} {'x none':>7} {'us/call':>8}")
    for variant in variants:
        mine = times[variant.name]
        ratio = statistics.median(a / b for a, b in zip(mine, none, strict=True))
        added = statistics.median(a - b for a, b in zip(mine, none, strict=True)) / CALLS * 1e6
        print(f"{variant.name:<16} {statistics.median(mine) * 1e3:8.1f} {ratio:7.3f} {added:8.1f}")


if __name__ == "__main__":
    main()
