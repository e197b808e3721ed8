"""Device ops and blocking reads per training step, per mode: what watching costs a GPU, counted on any machine.

On a GPU every op torch dispatches is a kernel launch (5-10 us of host time each), and every host read of a value the
step just computed drains the queue: the host waits for the GPU, then the GPU waits for the host. Timing a CPU shows
neither; counting does. This script runs steady training steps of one model under a counting `TorchDispatchMode`
(every ATen op dispatched: the model's, the optimizer's and nanwatch's) and a `TorchFunctionMode` (every host read:
`.item()`, `.tolist()`, `.numpy()`, `bool()`, `float()`, `int()`), unwatched and watched, and prints what watching
adds per step and per module call.

A host read is *blocking* when the value it reads was written by an op of the step in progress (a step runs from
one `zero_grad` to the next): on a GPU the host would wait for that op to finish before it could queue the next
one. A read of a value written in an earlier step is not counted: the GPU finished it long ago, while the host
queued this step (a flag copied to the host, read once the next step is queued).

Variants, each on its own copy of the model (same seed), steps counted after `--warmup` steps:

    none, full, sentinel        AdamW(foreach=True): an optimizer that takes no device-side flag
    none+fused, sentinel+fused  AdamW(fused=True): takes nanwatch's flag as `found_inf` and skips on the device
    full+fused
    <watched>@accelerator       the same, nanwatch measuring the accelerator's way (core/stats/paths.py): what a
                                GPU launches. The CPU's own way measures each tensor as it is seen (two ops), which
                                costs a CPU nothing to launch and is what runs fastest there.

A multi-tensor op (`_foreach_*`) counts once: on a GPU it is one launch per few hundred 64K-element chunks of its
tensors (`_foreach_max` adds a second, small kernel), so a step's launches are close to its ops.

The model is the GPT-2 of `overhead.py` (4 layers, width 256, vocabulary 8192, batch 8 x sequence 128) unless
`--small` (2 layers, width 32, vocabulary 64, batch 2 x 8: the same module calls, for a quick run).

    python benchmarks/device_ops.py                      # about a minute on 2 cores
    python benchmarks/device_ops.py --small --json out.json

Targets (issue: leave it on where users train): full adds at most 2.0 device ops per module call on the
accelerator's path; sentinel at most 12 per step, at most 1 blocking read with AdamW(foreach) and none with
AdamW(fused), on either path. `--check` exits 1 when a target is missed (the figures are printed either way).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from _shared import module_calls
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import nanwatch
from nanwatch.core.stats.paths import cpu_as_accelerator

# Design targets, per variant: (device ops added per module call, per step, blocking reads added per step).
MAX_FULL_OPS_PER_CALL = 2.0
MAX_SENTINEL_OPS_PER_STEP = 12
MAX_READS = {"sentinel": 1, "sentinel+fused": 0}

# Host reads of a tensor's values, as the torch function a tensor method or conversion is seen as.
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}
# Ops dispatched that only describe a tensor or view it: no kernel on a device.
_NOT_LAUNCHED = {"aten::detach", "aten::view", "aten::_unsafe_view", "aten::alias", "aten::t", "aten::expand",
                 "aten::as_strided", "aten::unsqueeze", "aten::squeeze", "aten::reshape", "aten::permute",
                 "aten::transpose", "aten::slice", "aten::select", "aten::split", "aten::unbind", "aten::lift_fresh",
                 "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::_local_scalar_dense",
                 "aten::split_with_sizes", "aten::view_as_real", "aten::set_", "aten::_reshape_alias"}  # fmt: skip


@dataclass
class StepCounts:
    """What one step dispatched: device ops (by op), host reads, and the reads that would block a GPU."""

    ops: Counter[str] = field(default_factory=Counter)
    reads: int = 0
    blocking_reads: int = 0
    blocking_where: list[str] = field(default_factory=list)


class Counting(TorchDispatchMode):
    """Counts the ops dispatched and tags each storage they write with the step that wrote it."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.counts = StepCounts()
        self.written: dict[int, int] = {}  # storage data pointer -> the step whose op last wrote it
        self.where: Counter[str] | None = None  # with --where: ops by the nanwatch line that launched them

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if name == "aten::_local_scalar_dense" and not _in_counted_read:  # a read made in C++ (torch.equal, ...)
            self.read(args[0], name)
        out = func(*args, **kwargs)
        if name not in _NOT_LAUNCHED:
            self.counts.ops[name] += 1
            if self.where is not None:
                self.where[f"{name.removeprefix('aten::')} <- {_nanwatch_caller()}"] += 1
            for argument, value in zip(func._schema.arguments, args, strict=False):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    self._tag(value)
            for argument in func._schema.arguments[len(args) :]:
                if argument.alias_info is not None and argument.alias_info.is_write and argument.name in kwargs:
                    self._tag(kwargs[argument.name])
            self._tag(out)
        return out

    def _tag(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.layout is torch.strided and value.device.type != "meta":
                self.written[value.untyped_storage().data_ptr()] = self.step
        elif isinstance(value, (list, tuple)):
            for item in value:
                self._tag(item)

    def read(self, tensor: torch.Tensor, how: str) -> None:
        self.counts.reads += 1
        if tensor.layout is torch.strided and self.written.get(tensor.untyped_storage().data_ptr()) == self.step:
            self.counts.blocking_reads += 1
            self.counts.blocking_where.append(f"{how} {tuple(tensor.shape)} {tensor.dtype}: {_caller()}")

    def next_step(self) -> StepCounts:
        done, self.counts = self.counts, StepCounts()
        self.step += 1
        return done


_in_counted_read = False


class Reads(TorchFunctionMode):
    """Sends every host read of a tensor's values to `counting`."""

    def __init__(self, counting: Counting) -> None:
        super().__init__()
        self.counting = counting

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        global _in_counted_read
        if func in _READS and args and isinstance(args[0], torch.Tensor):
            self.counting.read(args[0], func.__name__)
            _in_counted_read = True
            try:
                return func(*args, **(kwargs or {}))
            finally:
                _in_counted_read = False
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The first frame outside torch and this script: who read."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "torch/" not in name and not name.endswith("device_ops.py"):
            return f"{name.rsplit('src/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _nanwatch_caller() -> str:
    """The innermost nanwatch frame on the stack (or "model" when none is)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/nanwatch/" in name:
            return f"{name.rsplit('nanwatch/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "model"


def build(small: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    if small:
        config = GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                            eos_token_id=0)  # fmt: skip
        shape = (2, 8)
    else:
        config = GPT2Config(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=4, bos_token_id=0,
                            eos_token_id=0)  # fmt: skip
        shape = (8, 128)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    return model, ids


@dataclass
class Figures:
    variant: str
    ops_per_step: float
    reads_per_step: float
    blocking_reads_per_step: float
    ops_added_per_step: float = 0.0
    ops_added_per_module_call: float = 0.0
    blocking_reads_added_per_step: float = 0.0
    ops_by_kind: dict[str, float] = field(default_factory=dict)
    blocking_where: list[str] = field(default_factory=list)
    ops_by_line: dict[str, float] = field(default_factory=dict)


def run_variant(
    name: str, base: torch.nn.Module, ids: torch.Tensor, warmup: int, steps: int, *, where: bool = False
) -> Figures:
    if name.endswith(ACCELERATOR):  # nanwatch's accelerator path, run on these CPU tensors
        with cpu_as_accelerator():
            figures = run_variant(name.removesuffix(ACCELERATOR), base, ids, warmup, steps, where=where)
        figures.variant = name
        return figures
    model = copy.deepcopy(base).train()
    fused = name.endswith("+fused")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if fused else {"foreach": True}))
    mode = name.split("+")[0]
    handle = None if mode == "none" else nanwatch.watch(model, mode=mode, optimizer=optimizer, report_dir=None)
    counting = Counting()
    counted: list[StepCounts] = []
    try:
        with counting, Reads(counting):
            for index in range(warmup + steps):
                counts = counting.next_step()
                if index > warmup:
                    counted.append(counts)
                if index == warmup and where:
                    counting.where = Counter()
                optimizer.zero_grad(set_to_none=True)
                loss = model(ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                if handle is not None:
                    handle.step()
            counted.append(counting.next_step())
    finally:
        if handle is not None:
            if handle.watcher.disabled_reason is not None:
                raise RuntimeError(f"{name}: nanwatch stopped watching: {handle.watcher.disabled_reason}")
            handle.close()
    total = Counter[str]()
    for counts in counted:
        total.update(counts.ops)
    return Figures(
        variant=name,
        ops_per_step=sum(total.values()) / len(counted),
        reads_per_step=sum(c.reads for c in counted) / len(counted),
        blocking_reads_per_step=sum(c.blocking_reads for c in counted) / len(counted),
        ops_by_kind={op: n / len(counted) for op, n in total.most_common()},
        blocking_where=sorted({where for c in counted for where in c.blocking_where}),
        ops_by_line={
            line: n / len(counted)
            for line, n in (counting.where or Counter()).most_common()
            if not line.endswith("model")
        },
    )


ACCELERATOR = "@accelerator"
WATCHED = ("full", "sentinel", "full+fused", "sentinel+fused")
VARIANTS = ("none", "full", "sentinel", "none+fused", "full+fused", "sentinel+fused",
            *(f"{watched}{ACCELERATOR}" for watched in WATCHED))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 2-layer, width-32 GPT-2 (the same module calls)")
    parser.add_argument("--warmup", type=int, default=4, help="steps before counting (default 4)")
    parser.add_argument("--steps", type=int, default=4, help="steps counted (default 4)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--by-op", action="store_true", help="also print the ops each watched variant adds, by op")
    parser.add_argument("--where", action="store_true", help="also print the ops nanwatch launches, by its line")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    base, ids = build(args.small)
    calls = module_calls(base, lambda: base(ids))
    wanted = [v for v in args.variants.split(",") if v]
    figures = {name: run_variant(name, base, ids, args.warmup, args.steps, where=args.where) for name in wanted}
    for name, figure in figures.items():
        baseline = figures.get("none+fused" if "+fused" in name else "none")
        if baseline is None or baseline is figure:
            continue
        figure.ops_added_per_step = figure.ops_per_step - baseline.ops_per_step
        figure.ops_added_per_module_call = figure.ops_added_per_step / calls
        figure.blocking_reads_added_per_step = figure.blocking_reads_per_step - baseline.blocking_reads_per_step
    print(f"torch {torch.__version__}, nanwatch {nanwatch.__version__}; GPT-2 {'small' if args.small else 'benchmark'}"
          f" shape, {calls} module calls per forward; {args.steps} steps counted after {args.warmup}")  # fmt: skip
    print(f"{'variant':<28}{'ops/step':>10}{'added':>9}{'added/call':>12}{'reads':>8}{'blocking':>10}{'added':>8}")
    for figure in figures.values():
        print(f"{figure.variant:<28}{figure.ops_per_step:>10.1f}{figure.ops_added_per_step:>9.1f}"
              f"{figure.ops_added_per_module_call:>12.2f}{figure.reads_per_step:>8.1f}"
              f"{figure.blocking_reads_per_step:>10.1f}{figure.blocking_reads_added_per_step:>8.1f}")  # fmt: skip
    for figure in figures.values():
        for where in figure.blocking_where:
            print(f"  {figure.variant}: blocking read {where}")
    if args.by_op:
        for name, figure in figures.items():
            baseline = figures.get("none+fused" if "+fused" in name else "none")
            if baseline is None or baseline is figure:
                continue
            added = {op: n - baseline.ops_by_kind.get(op, 0.0) for op, n in figure.ops_by_kind.items()}
            shown = ", ".join(f"{op.removeprefix('aten::')} {n:g}" for op, n in sorted(added.items(),
                              key=lambda item: -item[1]) if n)  # fmt: skip
            print(f"  {name} adds: {shown}")
    if args.where:
        for name, figure in figures.items():
            for line, n in figure.ops_by_line.items():
                print(f"  {name}: {n:g} x {line}")
    missed = []
    for name, figure in figures.items():
        if (
            name.startswith("full")
            and name.endswith(ACCELERATOR)
            and figure.ops_added_per_module_call > MAX_FULL_OPS_PER_CALL
        ):
            missed.append(f"{name}: {figure.ops_added_per_module_call:.2f} ops per call > {MAX_FULL_OPS_PER_CALL}")
        if name.startswith("sentinel") and figure.ops_added_per_step > MAX_SENTINEL_OPS_PER_STEP:
            missed.append(f"{name}: {figure.ops_added_per_step:.1f} ops per step > {MAX_SENTINEL_OPS_PER_STEP}")
        allowed = MAX_READS.get(name.removesuffix(ACCELERATOR))
        if allowed is not None and figure.blocking_reads_added_per_step > allowed:
            missed.append(f"{name}: {figure.blocking_reads_added_per_step:g} blocking reads > {allowed}")
    for line in missed:
        print(f"target missed: {line}")
    if args.json:
        payload = {"module_calls": calls, "small": args.small, "figures": [asdict(f) for f in figures.values()],
                   "missed": missed}  # fmt: skip
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(payload, file, indent=1)
    return 1 if missed and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
