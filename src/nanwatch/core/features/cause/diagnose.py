"""From a detection's culprit to its cause: which test applies, what it found, and the line that says so.

Every test runs here, on a detection only. A test that cannot run says why, and the cause stays "unknown".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from nanwatch.core.features.cause.precision import Inconclusive, precision_test
from nanwatch.core.features.cause.records import Cause, CompileInfo, CulpritCall, KeptCall
from nanwatch.core.features.cause.rerun import NotRerun, eager_module, rerun_culprit
from nanwatch.core.torch_glue.hooks import HookSet

__all__ = ["Diagnosis", "StepHistory", "diagnose", "non_finite_inputs", "weights_cause"]

# Positions of non-finite values named per input, at most.
MAX_POSITIONS = 5


@dataclass(frozen=True)
class StepHistory:
    """What the run knows of its optimizer steps, for a cause in the weights."""

    last_applied: int | None  # the last step applied since watching began, as reports count it; None: none yet
    learning_rates: tuple[float, ...]  # that step's optimizer's learning rates (one per parameter group), if known


@dataclass(frozen=True)
class Diagnosis:
    """A cause, and the culprit's captured call when one was captured (what a repro capsule holds)."""

    cause: Cause
    call: CulpritCall | None


def diagnose(
    culprit: Any,
    *,
    calls: list[KeptCall],
    model: torch.nn.Module,
    hooks: HookSet,
    compiled: CompileInfo | None,
    steps: StepHistory,
    weights_changed: bool,
) -> Diagnosis:
    """The cause of the detection `culprit` (a `core/features/culprit.py` `Culprit`) names.

    Args:
        calls: the micro-batch's kept forward calls (references), to run it again.
        model: the watched model (the culprit is found in it by name).
        hooks: nanwatch's hooks, taken out of the way while the micro-batch runs again.
        compiled: how the model was compiled, or None when it ran eagerly.
        steps: the optimizer steps applied so far (a cause in the weights names the one that broke them).
        weights_changed: a weight changed since the forward measured it (a rerun would run other weights).
    """
    kind = getattr(culprit, "kind", "unknown")
    name: str | None = getattr(culprit, "module_name", None)
    if getattr(culprit, "backward", False):
        return Diagnosis(
            Cause("unknown", "the first non-finite value is a gradient, made in the backward: no test applies", name),
            None,
        )
    if kind == "loss":
        return Diagnosis(
            Cause("loss", "born outside the model: every watched module's outputs were finite, the loss was not"),
            None,
        )
    if kind in ("model_input", "unknown"):
        # In the micro-batch's inputs as the model's called modules received them (a LightningModule's children),
        # or else nowhere a test can reach.
        found = _data(culprit, calls)
        if found is not None:
            return Diagnosis(found, None)
    if kind == "weight":
        return Diagnosis(weights_cause(culprit, steps), None)
    if kind != "produced" or name is None:
        return Diagnosis(
            Cause(
                "unknown", "no test applies: the first non-finite value is not accounted for by a module's call", name
            ),
            None,
        )
    try:
        module = eager_module(model).get_submodule(name) if name else eager_module(model)
    except AttributeError:
        return Diagnosis(Cause("unknown", f"the culprit {name!r} is not a submodule of the model", name), None)
    try:
        call = rerun_culprit(calls, module, hooks, weights_changed=weights_changed)
    except NotRerun as reason:
        return Diagnosis(Cause("unknown", f"the culprit could not be run again: {reason}", name), None)
    if call.output_finite:
        if compiled is not None:
            return Diagnosis(_compiler(name, call, compiled), call)
        return Diagnosis(
            Cause(
                "unknown",
                "the culprit's micro-batch run again on the same inputs and weights came out finite "
                "(a non-deterministic kernel, a race, or state the rerun could not restore)",
                name,
            ),
            call,
        )
    return Diagnosis(_precision(name, call), call)


def _compiler(name: str, call: CulpritCall, compiled: CompileInfo) -> Cause:
    dtype = _dtype_name(call.output_dtype)
    magnitude = "" if call.output_abs_max is None else f" (abs max {call.output_abs_max:.2e})"
    mode = "" if compiled.mode is None else f", mode={compiled.mode!r}"
    return Cause(
        "compiler",
        f"the culprit's micro-batch run eagerly in the same dtype ({dtype}) gives a finite output{magnitude}; "
        f"the compiled run (torch.compile backend={compiled.backend!r}{mode}) did not",
        name,
        details={
            "backend": compiled.backend,
            "mode": compiled.mode,
            "dtype": dtype,
            "eager_abs_max": call.output_abs_max,
        },
    )


def _precision(name: str, call: CulpritCall) -> Cause:
    try:
        found = precision_test(call)
    except Inconclusive as reason:
        return Cause("unknown", f"the precision test cannot tell: {reason}", name)
    except (RuntimeError, MemoryError, TypeError, ValueError) as error:
        return Cause("unknown", f"the culprit could not be recomputed in a wider dtype: {error!r}", name)
    narrow, wide = _dtype_name(found.narrow), _dtype_name(found.wide)
    if not found.wide_finite:
        return Cause(
            "unknown",
            f"recomputed in {wide} from the same inputs and weights the culprit is non-finite too: not a matter of "
            f"{narrow}'s range",
            name,
            details={"dtype": narrow, "recomputed_in": wide},
        )
    needed = "" if found.wide_abs_max is None else f" (abs max {found.wide_abs_max:.2e})"
    magnitude = found.first_op_needed if found.first_op_needed is not None else found.wide_abs_max
    past_range = magnitude is not None and magnitude > found.narrow_max
    if found.first_op is not None and found.first_op_needed is not None:
        op = f"first op non-finite in {narrow}: {found.first_op}, {found.first_op_needed:.2e} in {wide}"
    else:
        op = f"no single op could be told apart in {narrow}"
    if past_range:
        why = f"{narrow}'s range overflowed: it holds at most {found.narrow_max:.2e}; {op}"
    else:
        why = (
            f"{narrow}'s rounding made it non-finite, not its range (every value in {wide} is within "
            f"{narrow}'s max {found.narrow_max:.2e}); {op}"
        )
    return Cause(
        "precision",
        f"recomputed in {wide} from the same finite inputs and weights the culprit is finite{needed}: {why}",
        name,
        details={
            "dtype": narrow,
            "dtype_max": found.narrow_max,
            "recomputed_in": wide,
            "needed_abs_max": found.wide_abs_max,
            "range_overflowed": past_range,
            "first_op": found.first_op,
            "first_op_needed": found.first_op_needed,
        },
    )


def weights_cause(culprit: Any, steps: StepHistory) -> Cause:
    """A parameter held inf/nan when the forward began: the cause, with the step that broke it where one ran."""
    labels = ", ".join(getattr(culprit, "labels", ()))
    name = getattr(culprit, "module_name", None)
    class_name = getattr(culprit, "class_name", None)
    module = f"{name} ({class_name})" if name and class_name else (name or "the top-level model")
    where = f"{labels} of {module}"
    if steps.last_applied is None:
        return Cause(
            "weights",
            f"{where} held inf/nan when the forward began, and this watcher saw no optimizer step before it: "
            "non-finite since before watching began (a checkpoint, an initialisation), or broken outside a step",
            name,
        )
    rates = ", ".join(f"{rate:.2e}" for rate in steps.learning_rates)
    lr = f" (learning rate {rates})" if rates else ""
    return Cause(
        "weights",
        f"{where} held inf/nan when the forward began: born in optimizer step {steps.last_applied}{lr}, whose "
        "gradients were checked finite before it applied them: the update itself overflowed",
        name,
        born_in_step=steps.last_applied,
        details={"parameters": list(getattr(culprit, "labels", ())), "learning_rates": list(steps.learning_rates)},
    )


def _data(culprit: Any, calls: list[KeptCall]) -> Cause | None:
    """A cause in the data, where the culprit says so (its kind "model_input") or the kept inputs show it; else
    None."""
    labels = list(getattr(culprit, "labels", ()))
    shown = ", ".join(labels) or "an input"
    said = getattr(culprit, "kind", None) == "model_input"
    where = "the non-finite value arrived in the micro-batch's inputs"
    if any(call.changed() for call in calls):
        if not said:
            return None
        # The inputs are not what the call was given: the forward (or the loop) changed one in place, so whether it
        # arrived non-finite or was made so in place cannot be told.
        return Cause(
            "unknown",
            f"first seen in {shown} of the model, but an input was changed in place after the call began (by the "
            "forward or the loop): whether it arrived non-finite cannot be told",
            "",
        )
    for call in calls:
        found = non_finite_inputs(call)
        if found:
            parts = [f"{entry.label} holds {entry.count} non-finite at {entry.positions_text}" for entry in found]
            module = _called_name(call)
            called = "" if module is None else f" of {module}"
            return Cause(
                "data",
                f"{where}{called}: " + "; ".join(parts),
                "",
                details={"inputs": [{"label": e.label, "count": e.count, "positions": e.positions} for e in found]},
            )
    return Cause("data", f"{where}: {shown}", "") if said else None


def _called_name(call: KeptCall) -> str | None:
    """How the report names the module a kept call called, where it is not the model itself."""
    return call.name


@dataclass(frozen=True)
class NonFiniteInput:
    """An input tensor of a kept call that holds inf/nan: its label, how many values, and where the first are."""

    label: str
    count: int
    positions: list[list[int]]

    @property
    def positions_text(self) -> str:
        shown = ", ".join(str(tuple(position)) for position in self.positions)
        more = ", ..." if self.count > len(self.positions) else ""
        return f"{shown}{more}"


def non_finite_inputs(call: KeptCall) -> list[NonFiniteInput]:
    """The floating-point input tensors of `call` that hold inf/nan (labelled as report lines label inputs)."""
    found = []
    leaves, _ = tree_flatten_with_path((call.args, call.kwargs))
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point() or leaf.numel() == 0:
            continue
        bad = ~torch.isfinite(leaf.detach())
        count = int(bad.sum())
        if count:
            positions = bad.nonzero()[:MAX_POSITIONS].tolist()
            found.append(NonFiniteInput(_label(path), count, positions))
    return found


def _label(path: Any) -> str:
    """`input[0]`, `input.pixel_values`, `input[0]['x']`: a kept input's place, as report lines name inputs."""
    text = keystr(path)  # "[0][1]" for args, "[1]['name']" for kwargs
    if text.startswith("[0]"):
        rest = text[3:]
        head, _, tail = rest.partition("]")
        return f"input{head}]{tail}" if head else "input"
    rest = text[3:]  # kwargs: "['name']..."
    if rest.startswith("['"):
        key, _, tail = rest[2:].partition("']")
        return f"input.{key}{tail}"
    return f"input{rest}"


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "unknown dtype" if dtype is None else str(dtype).removeprefix("torch.")
