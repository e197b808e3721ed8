"""Sentinel mode's replay: a kept micro-batch run again as it first ran, and what the report says of the result.

Apart from the feature because it runs only after a detection, on the slow path: it restores the buffers, the
generators (global and the model's own) and the modules' plain attributes, gives the model parameters of its own so
that the backward computes each weight's gradient without touching the user's `.grad` or firing a hook the run put on
a parameter (DDP's all-reduce), drives that backward from the kept gradients, and puts everything back.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from nanwatch.core.events import EngineContext
from nanwatch.core.features.sentinel import generators as own_generators
from nanwatch.core.features.sentinel.kept import MicroBatch
from nanwatch.core.features.sentinel.outputs import float_leaves
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.runstate import autocast_as, capture_rng_states, determinism_flags, restore_rng_states

__all__ = [
    "Replayed",
    "born_in_the_loss",
    "not_replayable",
    "not_reproduced",
    "not_restored",
    "unreplayed",
    "replay_window",
    "reproduced",
    "same_numbers",
]

# What every replay restores, as the report lists it.
RESTORED = (
    "the inputs (copied, or unchanged since by their version counters), the weights (the step never ran), the "
    "buffers, the random generators (Python's, numpy's, torch's on the CPU and every CUDA device, and those the "
    "model's modules hold), the autocast and grad modes, and the modules' plain Python attributes"
)


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
    restore_attributes = _keep_attributes(ctx.model)
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


# Values a forward may change in a module's plain Python attributes (a call counter, a cache list) that a replay puts
# back. Other objects a module holds (a cache object, a config) get their own attributes put back, one level deep;
# modules, tensors, classes, functions and Python modules are left as they are.
_PLAIN = (bool, int, float, complex, str, bytes, tuple, frozenset, type(None))
_NOT_STATE = (torch.nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType, types.ModuleType)
_MISSING = object()


def _keep_attributes(model: torch.nn.Module) -> Callable[[], None]:
    """The modules' public attributes as they are now (plain values; lists, dicts and sets by their contents; other
    objects by their own attributes), and a function that puts them back: a replay runs the live model, and must not
    advance the user's state (a call counter, a list the forward appends to) as if the run had taken one more step."""
    values: list[tuple[dict[str, Any], str, Any]] = []
    containers: list[tuple[Any, Any]] = []
    objects: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for module in model.modules():
        attributes = vars(module)
        for name, value in attributes.items():
            if name.startswith("_"):
                continue
            values.append((attributes, name, value))
            if type(value) in (list, dict, set):
                containers.append((value, value.copy()))
            elif not isinstance(value, _PLAIN + _NOT_STATE) and isinstance(getattr(value, "__dict__", None), dict):
                objects.append((vars(value), dict(vars(value))))

    def restore() -> None:
        for attributes, name, value in values:
            attributes[name] = value
        for container, contents in containers:
            container.clear()  # the same object, as the user's code may hold it
            if isinstance(container, list):
                container.extend(contents)
            else:
                container.update(contents)
        for state, saved in objects:
            for key in [key for key in state if key not in saved]:
                del state[key]
            for key, value in saved.items():
                if state.get(key, _MISSING) is not value:
                    state[key] = value

    return restore


def _detached(value: Any) -> Any:
    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else tensor

    return tree_map_only(torch.Tensor, cut, value)


def reproduced(found: Report, original: Report, micro: MicroBatch, *, backward: bool, second: bool = False) -> Report:
    """The replay's own report (`found`), with how it was replayed and what the sentinel first saw. `second`: only the
    second replay went non-finite, the first stayed finite (so the numbers differ between runs)."""
    line = (
        f"reproduced by replaying micro-batch {micro.batch_number} with every module watched (the same inputs, "
        "random generator states, autocast state and buffers; the same weights, since the step never ran)"
    )
    if backward:
        line += (
            "; its backward was driven by the gradient w.r.t. the model's output kept from the first run, into "
            "parameters of the replay's own (the run's .grad and its hooks untouched); the grad weight lines are "
            "their gradients summed over the window so far, as .grad holds them"
        )
    if second:
        line += (
            ". The first replay of the same micro-batch stayed finite and this second one did not: the same "
            f"computation gives different numbers from run to run (a non-deterministic kernel; {_pinning()})"
        )
    data = {"reproduced": True, "verdict": "reproduced", "replays": 2 if second else 1}
    report = found.with_section(ReportSection("replay", 30, (line,), data))
    for key in ("sentinel", "gradients"):
        section = original.section(key)
        if section is not None:
            report = report.with_section(section)
    return report


def born_in_the_loss(report: Report, micro: MicroBatch, label: str) -> Report:
    """The detection's report, saying that the gradient w.r.t. the model's output was already non-finite when the
    backward entered the model: the loss made it, computed outside the model from a finite output."""
    line = (
        f"born in the loss: the gradient w.r.t. the model's {label} in micro-batch {micro.batch_number}, kept from "
        "the run, was already inf/nan when the backward entered the model, whose output was finite; so the loss, "
        "computed outside the model, made it (look at a log, sqrt, division or exp of the output, or a torch.where "
        "whose other branch is inf/nan: its gradient is nan even where it is not chosen). Nothing was replayed, and "
        "nothing here points at the hardware."
    )
    report = dataclasses.replace(report, module_name="(loss)")
    data = {"reproduced": None, "verdict": "born_in_the_loss", "micro_batch": micro.batch_number, "output": label}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def not_reproduced(report: Report, window: Sequence[MicroBatch], world_size: int, *, replays_agree: bool) -> Report:
    """The detection's report, saying that replaying `window` twice gave finite numbers, everything restored, and
    what that points at: two replays that disagree, a non-deterministic computation; that agree, a transient fault."""
    batches = ", ".join(str(micro.batch_number) for micro in window)
    plural = "es" if len(window) > 1 else ""
    line = f"not reproduced: micro-batch{plural} {batches} replayed twice with everything restored ({RESTORED}) "
    if replays_agree:
        line += (
            "gave finite numbers, the same bits both times, where the run had inf/nan. A computation that repeats "
            "itself exactly but went non-finite once points at a transient fault of that run: the device (run its "
            "memory and compute checks; look for the same device failing again), or a race (another stream or "
            "thread writing these tensors while the step ran)."
        )
        cause = "transient_fault"
    else:
        line += (
            "gave finite numbers that differ from one replay to the other: the same computation gives different "
            f"numbers from run to run, which points at a non-deterministic kernel ({_pinning()})"
        )
        line += "."
        cause = "non_deterministic"
    if report.section("sentinel") is not None:  # seen at the model's output: no module's frame holds it
        report = dataclasses.replace(report, module_name=None)
    elif world_size > 1:  # seen only in the gradients, which the all-reduce averaged over every rank's micro-batch
        line += (
            " With several ranks, the gradients are averaged over all of them: the nan may have come from another "
            "rank's micro-batch (run with mode='full' and watch_gradients=True to see where)."
        )
    data = {"reproduced": False, "verdict": "not_reproduced", "cause": cause, "replays": 2}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def not_replayable(report: Report, changed: Sequence[str]) -> Report:
    """The detection's report, saying the micro-batch could not be run again as it ran, and what changed since."""
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    line = (
        f"not replayable: {shown} changed since the micro-batch ran (in place, by the forward itself or by the loop "
        "refilling a preallocated tensor; or another tensor put in its place), so a replay would run other "
        "values; sentinel mode keeps inputs larger than sentinel_copy_inputs allows, and most buffers, by "
        "reference. Nothing here points at the hardware. To see where inf/nan began, run with "
        "sentinel_copy_inputs='always', with mode='full', or with capture_on_detect=True and replay the file."
    )
    if report.section("sentinel") is not None:  # seen at the model's output: no module's frame holds it
        report = dataclasses.replace(report, module_name=None)
    data = {"reproduced": None, "verdict": "not_replayable", "changed": list(changed)}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def not_restored(report: Report, unsaved: Sequence[str]) -> Report:
    """The detection's report, saying two replays disagreed while state they depend on could not be restored."""
    line = (
        f"not replayable: two replays gave numbers that differ from each other, and {', '.join(unsaved)} could not "
        "be put back as it was when the micro-batch ran, so the replays did not run what failed. Nothing here points "
        "at the hardware. Create it before watching begins (its state is then kept with every call), or run with "
        "mode='full'."
    )
    if report.section("sentinel") is not None:
        report = dataclasses.replace(report, module_name=None)
    data = {"reproduced": None, "verdict": "not_replayable", "not_restored": list(unsaved)}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def unreplayed(report: Report, line: str, **more: Any) -> Report:
    """The detection's report with why it was not replayed at all (a verdict of its own: never "not reproduced")."""
    data = {"reproduced": None, "verdict": "not_replayable", **more}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def _pinning() -> str:
    """The settings that would make the computation repeat itself, those not already set."""
    flags = determinism_flags()
    wanted = []
    if not flags["deterministic_algorithms"] or flags["warn_only"]:
        wanted.append("torch.use_deterministic_algorithms(True)")
    if torch.cuda.is_available():
        wanted.append("CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
        if not flags["cudnn_deterministic"]:
            wanted.append("torch.backends.cudnn.deterministic = True")
        if flags["cudnn_benchmark"]:
            wanted.append("torch.backends.cudnn.benchmark = False")
    if not wanted:
        return "deterministic algorithms are already on: a kernel without a deterministic variant, or a race"
    return "to pin it, set " + ", ".join(wanted)
