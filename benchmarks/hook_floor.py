"""The floor under issue 21's hot-path target: what the cheapest forward hooks cost on its dispatch-bound step.

Issue 21 asks that watching the dispatch-bound training step (1,000 `Linear(4, 4)` + `Tanh` pairs, batch 2, plain
SGD) cost at most 1.3x the unwatched step and 10 us per module call. This benchmark runs that step with hand-written
hooks that do less and less of what watching needs, beside nanwatch's own `watch()`, in paired rounds (every variant
once per round, in an order that rotates; each attached for one untimed step, then one timed), and prints each one's
step time, its ratio to the unwatched step (the median of the per-round ratios) and the time it adds per module call:

- `none, shortcut on`: no hook on the model, while its classes carry nanwatch's shortcut past torch's hook dispatch
  (core/dispatch.py) because another module of each class is hooked: what an unwatched module pays for it;
- `noop hook`: a forward hook that returns at once: what torch's hook dispatch alone costs (`_call_impl` leaves its
  fast path as soon as a module has a hook);
- `noop, shortcut`: the same hook added the way nanwatch adds its own (`HookSet.add_forward`), which puts the
  shortcut past torch's hook dispatch on the modules' classes (core/dispatch.py): what the dispatch costs nanwatch;
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

Nothing here is asserted: the figures are what the machine does (issue 21's closing note quotes them).
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
from torch import nn

import nanwatch
from nanwatch.adapters import _handles
from nanwatch.core.hooks import HookSet

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import HookStash  # noqa: E402  (the same stash the overhead benchmark shares its model with)

PAIRS, BATCH = 1000, 2
CALLS = 2 * PAIRS + 1  # every Linear and Tanh, and the Sequential around them


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


class _ThroughHookSet(Variant):
    """A variant whose hooks nanwatch's `HookSet` adds (so the classes carry the shortcut past torch's hook dispatch,
    core/dispatch.py), all taken off again after its step."""

    def hooked(self, model: nn.Sequential) -> list[nn.Module]:
        raise NotImplementedError

    def attach(self, model: nn.Sequential, optimizer: torch.optim.Optimizer) -> None:
        self.hooks = HookSet()
        for module in self.hooked(model):
            self.hooks.add_forward(module, self.hook, with_kwargs=True)

    def detach(self) -> None:
        self.hooks.remove_all()


class UnhookedShortcutClasses(_ThroughHookSet):
    """No hook on the model, while its classes carry the shortcut (another module of each class is hooked): what a
    module nanwatch does not watch pays for the shortcut on its class (an EMA copy, modules `include_modules` left
    out)."""

    name = "none, shortcut on"

    def hooked(self, model: nn.Sequential) -> list[nn.Module]:
        return [nn.Linear(1, 1), nn.Tanh(), nn.Sequential()]  # the model's classes, hooked elsewhere


class NoopHookShortcut(_ThroughHookSet):
    """The same hook that returns at once, added as nanwatch adds its own: through the shortcut."""

    name = "noop, shortcut"

    def hooked(self, model: nn.Sequential) -> list[nn.Module]:
        return list(model.modules())


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
            _handles.let_go(self.handle)  # the other variants' steps must not close it as a handle left behind
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


VARIANTS: list[Callable[[], Variant]] = [
    NoHooks,
    UnhookedShortcutClasses,
    NoopHook,
    NoopHookShortcut,
    KeepReference,
    CopyOutput,
    Watch,
]


def dispatch_step() -> tuple[nn.Sequential, torch.Tensor, torch.optim.Optimizer]:
    """Issue 21's step: the model, its batch and its optimizer (also benchmarks/step_parts.py's)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(PAIRS):
        layers += [nn.Linear(4, 4), nn.Tanh()]
    model = nn.Sequential(*layers)
    inputs = torch.randn(BATCH, 4)
    return model, inputs, torch.optim.SGD(model.parameters(), lr=1e-5, foreach=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="paired rounds (every variant once per round)")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each variant before timing")
    parser.add_argument("--threads", type=int, default=2)
    names = [make.name for make in VARIANTS]
    parser.add_argument(
        "--only",
        nargs="+",
        choices=names,
        metavar="VARIANT",
        help=f"time only these variants, `none` always among them (one of: {', '.join(map(repr, names))})",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        parser.error(f"--rounds must be positive and --warmup not negative, got {args.rounds}, {args.warmup}")
    torch.set_num_threads(args.threads)
    model, inputs, optimizer = dispatch_step()
    chosen = set(args.only or names) | {NoHooks.name}
    variants = [make() for make in VARIANTS if make.name in chosen]

    def step(variant: Variant) -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(inputs).square().mean().backward()
        optimizer.step()
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
