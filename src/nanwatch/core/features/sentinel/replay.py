"""Sentinel mode's replay: a kept micro-batch run again as it first ran (what the report then says: verdicts.py).

Apart from the feature because it runs only after a detection, on the slow path: it restores the buffers, the
generators (global and the model's own) and the modules' plain attributes, gives the model parameters of its own so
that the backward computes each weight's gradient without touching the user's `.grad` or firing a hook the run put on
a parameter (DDP's all-reduce), drives that backward from the kept gradients, and puts everything back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from nanwatch.core.feature_api import EngineContext
from nanwatch.core.features.sentinel.kept import MicroBatch
from nanwatch.core.features.sentinel.outputs import float_leaves
from nanwatch.core.model_state import generators as own_generators
from nanwatch.core.model_state.attributes import keep_attributes
from nanwatch.core.report import Report
from nanwatch.core.runstate import autocast_as, capture_rng_states, restore_rng_states

__all__ = ["Replayed", "parameters_of_its_own", "replay_window", "run_again", "same_numbers"]


@dataclass
class Replayed:
    """One replay of a window: the report of the micro-batch that went non-finite (None when all stayed finite), and
    fingerprints of what it computed (the outputs, and each parameter's gradient when the backward ran)."""

    found: Report | None = None
    micro: MicroBatch | None = None
    computed: list[tuple[int, float] | None] = field(default_factory=list)


def replay_window(
    ctx: EngineContext,
    window: Sequence[MicroBatch],
    *,
    backward: bool,
    generators: Sequence[own_generators.OwnGenerator],
) -> Replayed:
    """Run the window's micro-batches again in order, each under a full watch of its own, until one goes non-finite.
    The parameters' gradients add up over the window as `.grad` does, so a sum that overflows is found too."""
    replayed = Replayed()
    with parameters_of_its_own(ctx.model) as parameters:
        for micro in window:

            def run(micro: MicroBatch = micro) -> None:
                computed = run_again(ctx, micro, backward=backward, parameters=parameters, generators=generators)
                replayed.computed += [fingerprint(value) for value in computed]

            found = ctx.rerun(run, batch_number=micro.batch_number, phase="train", gradients=backward)
            if found is not None:
                return dataclasses.replace(replayed, found=found, micro=micro)
        replayed.computed += [fingerprint(param.grad) for param in parameters if param.grad is not None]
    return replayed


@contextmanager
def parameters_of_its_own(model: torch.nn.Module) -> Iterator[list[torch.nn.Parameter]]:
    """Each parameter swapped, for the replay, for a leaf that shares its storage (no copy; tied parameters stay
    tied). The replay's backward accumulates into their `.grad` only (`inputs=` them), which fires the rerun's own
    gradient hooks as in full mode, while the user's `.grad`, DDP's hooks and the user's own never see it."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    own: dict[int, torch.nn.Parameter] = {}
    try:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                stand_in = own.get(id(param))
                if stand_in is None:
                    stand_in = own[id(param)] = torch.nn.Parameter(param.detach(), requires_grad=param.requires_grad)
                swapped.append((module, name, param))
                module._parameters[name] = stand_in
        yield [param for param in own.values() if param.requires_grad]
    finally:
        for module, name, param in reversed(swapped):
            module._parameters[name] = param


def run_again(
    ctx: EngineContext,
    micro: MicroBatch,
    *,
    backward: bool,
    parameters: Sequence[torch.nn.Parameter],
    generators: Sequence[own_generators.OwnGenerator],
) -> list[torch.Tensor]:
    """The micro-batch's calls (and backward) as they first ran; what they output. The buffers, the generators and
    the modules' plain attributes end as they were."""
    buffers = dict(ctx.model.named_buffers())
    with torch.no_grad():
        now = {name: buffer.detach().clone() for name, buffer in buffers.items()}
    callers_rng = capture_rng_states(numpy=True)
    callers_own = own_generators.capture(generators)
    restore_attributes = keep_attributes(ctx.model)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    outputs: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for name, saved in micro.buffers.items():
                if name in buffers and buffers[name] is not saved:
                    buffers[name].copy_(saved)
        for call in micro.calls:
            restore_rng_states(call.rng)
            own_generators.restore(generators, call.own_rng)
            # Inputs cut from the first run's graph (freed by its backward): each call's backward is driven by
            # the gradient kept for its own output, and stops at its inputs.
            args, kwargs = _detached((call.args, call.kwargs))
            with torch.set_grad_enabled(call.grad_enabled and backward), autocast_as(call.autocast):
                output = call.module(*args, **kwargs)
            for label, leaf in float_leaves(output):
                outputs.append(leaf.detach())
                if backward and label in call.output_grads and leaf.requires_grad:
                    pairs.append((leaf, call.output_grads[label]))
        if pairs and parameters:
            torch.autograd.backward(
                [leaf for leaf, _ in pairs], grad_tensors=[grad for _, grad in pairs], inputs=list(parameters)
            )
    finally:
        with torch.no_grad():
            for name, value in now.items():
                buffers[name].copy_(value)
        restore_rng_states(callers_rng)
        own_generators.restore(generators, callers_own)
        restore_attributes()
    return outputs


def fingerprint(tensor: torch.Tensor) -> tuple[int, float] | None:
    """A value that changes when any bit of `tensor` does (with near certainty), without copying it: the sum of its
    bit patterns as integers, and its sum. None for a layout that has no plain storage to read."""
    try:
        flat = tensor.detach().contiguous()
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        with torch.no_grad():
            pattern = int(torch.sum(flat.view(bits), dtype=torch.int64))
            total = float(flat.double().sum()) if flat.numel() <= 1 << 24 else float(flat.float().sum())
        return pattern, total
    except (RuntimeError, NotImplementedError, KeyError, TypeError):
        return None


def same_numbers(first: Replayed, second: Replayed) -> bool:
    """Whether two replays computed the same bits (as far as their fingerprints tell)."""
    return len(first.computed) == len(second.computed) and all(
        a is None or b is None or (a[0] == b[0] and (a[1] == b[1] or (a[1] != a[1] and b[1] != b[1])))
        for a, b in zip(first.computed, second.computed, strict=True)
    )


def _detached(value: Any) -> Any:
    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else tensor

    return tree_map_only(torch.Tensor, cut, value)
