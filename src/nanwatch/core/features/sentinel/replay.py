"""Sentinel mode's replay: a kept micro-batch run again as it first ran, and what the report says of the result.

Apart from the feature because it runs only after a detection, on the slow path: it restores the buffers and the
generators, drives the backward from the kept gradients when the nan was only in them, and puts everything back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from nanwatch.core.events import EngineContext
from nanwatch.core.features.sentinel.kept import MicroBatch
from nanwatch.core.features.sentinel.outputs import float_leaves
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.runstate import autocast_as, capture_rng_states, restore_rng_states

__all__ = ["not_replayable", "not_reproduced", "reproduced", "run_again"]


def run_again(ctx: EngineContext, micro: MicroBatch, *, backward: bool) -> None:
    """The micro-batch's calls (and backward) as they first ran; the buffers and generators end as they were."""
    buffers = dict(ctx.model.named_buffers())
    with torch.no_grad():
        now = {name: buffer.detach().clone() for name, buffer in buffers.items()}
    callers_rng = capture_rng_states(numpy=True)
    restore_attributes = _keep_attributes(ctx.model)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for name, saved in micro.buffers.items():
                if name in buffers and buffers[name] is not saved:
                    buffers[name].copy_(saved)
        for call in micro.calls:
            restore_rng_states(call.rng)
            # Inputs cut from the first run's graph (freed by its backward): each call's backward is driven by
            # the gradient kept for its own output, and stops at its inputs.
            args, kwargs = _detached((call.args, call.kwargs))
            with torch.set_grad_enabled(call.grad_enabled and backward), autocast_as(call.autocast):
                output = call.module(*args, **kwargs)
            if backward:
                pairs += [
                    (leaf, call.output_grads[label])
                    for label, leaf in float_leaves(output)
                    if label in call.output_grads
                    and leaf.requires_grad
                    and bool(torch.isfinite(call.output_grads[label]).all())  # the slow path: reads allowed
                ]
        params = [param for param in ctx.model.parameters() if param.requires_grad]
        if pairs and params:  # into no `.grad`: the gradients the step would apply stay as they are
            torch.autograd.grad(
                [leaf for leaf, _ in pairs], params, grad_outputs=[grad for _, grad in pairs], allow_unused=True
            )
    finally:
        with torch.no_grad():
            for name, value in now.items():
                buffers[name].copy_(value)
        restore_rng_states(callers_rng)
        restore_attributes()


# Values a forward may change in a module's plain Python attributes (a call counter, a cache list) that a replay puts
# back; any other object is left as it is.
_PLAIN = (bool, int, float, complex, str, bytes, tuple, frozenset, type(None))


def _keep_attributes(model: torch.nn.Module) -> Callable[[], None]:
    """The modules' public plain attributes (numbers, strings, tuples; lists, dicts and sets by their contents) as they
    are now, and a function that puts them back: a replay runs the live model, and must not advance the user's state
    (a call counter, a list the forward appends to) as if the run had taken one more step."""
    values: list[tuple[dict[str, Any], str, Any]] = []
    containers: list[tuple[dict[str, Any], str, Any, Any]] = []
    for module in model.modules():
        attributes = vars(module)
        for name, value in attributes.items():
            if name.startswith("_"):
                continue
            if isinstance(value, _PLAIN):
                values.append((attributes, name, value))
            elif type(value) in (list, dict, set):
                containers.append((attributes, name, value, value.copy()))

    def restore() -> None:
        for attributes, name, value in values:
            attributes[name] = value
        for attributes, name, container, contents in containers:
            container.clear()  # the same object, as the user's code may hold it
            if isinstance(container, list):
                container.extend(contents)
            else:
                container.update(contents)
            attributes[name] = container

    return restore


def _detached(value: Any) -> Any:
    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else tensor

    return tree_map_only(torch.Tensor, cut, value)


def reproduced(found: Report, original: Report, micro: MicroBatch, *, backward: bool) -> Report:
    """The replay's own report (`found`), with how it was replayed and what the sentinel first saw."""
    line = (
        f"reproduced by replaying micro-batch {micro.batch_number} with every module watched (the same inputs, "
        "random generator states, autocast state and buffers; the same weights, since the step never ran)"
    )
    if backward:
        line += (
            "; its backward was driven by the gradient w.r.t. the model's output kept from the first run, through "
            "torch.autograd.grad, so the parameters' .grad lines are not recorded (the gradients above list them)"
        )
    report = found.with_section(ReportSection("replay", 30, (line,), {"reproduced": True, "verdict": "reproduced"}))
    for key in ("sentinel", "gradients"):
        section = original.section(key)
        if section is not None:
            report = report.with_section(section)
    return report


def not_reproduced(report: Report, window: Sequence[MicroBatch], world_size: int) -> Report:
    """The detection's report, saying that replaying `window` gave finite numbers, and where to look instead."""
    batches = ", ".join(str(micro.batch_number) for micro in window)
    line = (
        f"not reproduced: replaying micro-batch{'es' if len(window) > 1 else ''} {batches} with the same inputs, "
        "weights, random generator states, autocast state and buffers gave finite numbers. The same computation "
        "gave different numbers: look for a non-deterministic kernel (run with "
        "torch.use_deterministic_algorithms(True)), a race (another stream or thread writing these tensors), or a "
        "hardware fault (the same device failing again)."
    )
    if report.section("sentinel") is not None:  # seen at the model's output: no module's frame holds it
        report = dataclasses.replace(report, module_name=None)
    elif world_size > 1:  # seen only in the gradients, which the all-reduce averaged over every rank's micro-batch
        line += (
            " With several ranks, the gradients are averaged over all of them: the nan may have come from another "
            "rank's micro-batch (run with mode='full' and watch_gradients=True to see where)."
        )
    return report.with_section(ReportSection("replay", 30, (line,), {"reproduced": False, "verdict": "not_reproduced"}))


def not_replayable(report: Report, changed: Sequence[str]) -> Report:
    """The detection's report, saying the micro-batch could not be run again as it ran, and what changed since."""
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    line = (
        f"not replayable: {shown} changed in place since the micro-batch ran (by the forward itself, or by the loop "
        "refilling a preallocated tensor), so a replay would run other values; sentinel mode keeps inputs and most "
        "buffers by reference. Nothing here points at the hardware. To see where inf/nan began, run with "
        "mode='full', or with capture_on_detect=True and replay the file."
    )
    if report.section("sentinel") is not None:  # seen at the model's output: no module's frame holds it
        report = dataclasses.replace(report, module_name=None)
    data = {"reproduced": None, "verdict": "not_replayable", "changed": list(changed)}
    return report.with_section(ReportSection("replay", 30, (line,), data))
