"""The first culprit: which module made the first inf/nan, as opposed to the modules that only passed it on.

Frames are recorded in the order module calls *return*, so a child's frame comes before its parent's. The first frame
of a batch that holds any inf/nan is where the trail starts:

- a non-finite parameter there: the weights were already broken before this forward ran (an optimizer step);
- finite inputs and weights, a non-finite output: that module produced it (its parent, which returns later with the
  same inf, only passed it on);
- a non-finite input: no watched module returned it earlier, so it was made by the code of an enclosing module
  outside its submodules (the deepest enclosing call whose own inputs were finite), or it entered through the inputs
  of the top-level model.

Enclosing calls are found by name (`a.b` encloses `a.b.c`) among the frames that return later in the same batch.
Inputs are positional (`input[0]`) and keyword tensors (`input.pixel_values`) alike, so bad data passed as
`model(**batch)` is traced to the keyword that brought it. A loss given to `watch_loss` (its own frame) that is the
first non-finite value was made by the loss code from finite outputs.

What each line is comes from its typed role and its frame's direction, never from the text of its label.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nanwatch.core.feature_api import EngineContext, Feature
from nanwatch.core.frames import ResolvedEntry, ResolvedFrame, Role
from nanwatch.core.report import Report, ReportSection

__all__ = ["Culprit", "CulpritKind", "CulpritFeature", "culprit_section", "find_culprit"]

CulpritKind = Literal["produced", "weight", "model_input", "loss", "unknown"]


@dataclass(frozen=True)
class Culprit:
    """Where the first inf/nan of a batch came from.

    Attributes:
        kind: "produced" (a module's forward made it from finite inputs and weights), "weight" (a parameter was
            already non-finite when the forward ran), "model_input" (it came in through the top-level model's inputs),
            "loss" (the loss code made it from finite outputs), or "unknown" (first seen in an input no recorded call
            accounts for).
        module_name: the module held responsible ("" is the top-level model), or None when unknown.
        class_name: its class.
        labels: the lines that show it: the non-finite outputs, parameters or inputs.
        values: "inf", "nan" or "inf/nan": what those lines hold.
        inputs_abs_max: the largest abs max over the module's floating-point inputs, when they were finite.
        weights_abs_max: the largest abs max over its parameters, when it has any and they were finite.
        own_code: for "produced": the module's own code made it, outside its watched submodules.
        seen_in: for "produced" in own code and "unknown": the module whose input first showed it, and that input.
        message: one line saying all this, as the report prints it.
    """

    kind: CulpritKind
    module_name: str | None
    class_name: str | None
    batch_number: int
    phase: str
    labels: tuple[str, ...]
    values: str
    message: str
    inputs_abs_max: float | None = None
    weights_abs_max: float | None = None
    own_code: bool = False
    seen_in: tuple[str, str] | None = None
    backward: bool = False  # drawn from a backward frame: a gradient, not a forward value

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "module": self.module_name,
            "class": self.class_name,
            "batch_number": self.batch_number,
            "phase": self.phase,
            "labels": list(self.labels),
            "values": self.values,
            "inputs_abs_max": self.inputs_abs_max,
            "weights_abs_max": self.weights_abs_max,
            "own_code": self.own_code,
            "seen_in": None if self.seen_in is None else {"module": self.seen_in[0], "label": self.seen_in[1]},
            "message": self.message,
        }


def find_culprit(frames: Sequence[ResolvedFrame], first: int) -> Culprit:
    """Name the first culprit, given the resolved frames of a check and the index of the first non-finite one.

    Args:
        frames: resolved frames in the order their calls returned; those after `first` that belong to the same batch
            and phase are searched for the calls that enclosed it.
        first: the index in `frames` of the first frame holding inf/nan.
    """
    frame = frames[first]
    if frame.is_backward:
        return _backward(frame, frames[:first])

    def same_forward(other: ResolvedFrame) -> bool:
        return other.batch_number == frame.batch_number and other.phase == frame.phase and not other.is_backward

    later = [f for f in frames[first + 1 :] if same_forward(f)]
    earlier = [f for f in frames[:first] if same_forward(f)]
    by_role = _split(frame)
    broken_loss = [e for e in by_role[Role.LOSS] if e.non_finite]
    if broken_loss:
        return _loss(frame, broken_loss)
    broken_weights = [e for e in by_role[Role.PARAMETER] if e.non_finite]
    if broken_weights:
        return _weight(frame, broken_weights)
    broken_inputs = [e for e in by_role[Role.INPUT] if e.non_finite]
    broken_outputs = [e for e in by_role[Role.OUTPUT] if e.non_finite]
    if not broken_inputs and broken_outputs:
        # Its children (if any) returned finite outputs before it, else one of them would be the first frame.
        own_code = any(_encloses(frame.module_name, f.module_name) for f in earlier)
        return _produced(frame, broken_outputs, own_code=own_code, seen_in=None)
    if broken_inputs:
        return _from_outside(frame, broken_inputs, later)
    broken = [e for e in frame.entries if e.non_finite]
    return _unknown(frame, broken, "first seen in")


# ------------------------------------------------------------------------------------------------- helpers


def _split(frame: ResolvedFrame) -> dict[Role, list[ResolvedEntry]]:
    roles: dict[Role, list[ResolvedEntry]] = {role: [] for role in Role}
    for entry in frame.entries:
        roles[entry.role].append(entry)
    return roles


def _encloses(outer: str, inner: str) -> bool:
    """True when module `outer` contains module `inner` by qualified name ("" contains every other module)."""
    if outer == inner:
        return False
    return outer == "" or inner.startswith(outer + ".")


def _depth(name: str) -> int:
    return 0 if name == "" else name.count(".") + 1


def _where(name: str, class_name: str) -> str:
    return f"the top-level model ({class_name})" if name == "" else f"{name} ({class_name})"


def _value_kind(entries: Sequence[ResolvedEntry]) -> str:
    kinds = {"nan" if isinstance(e.abs_max, float) and math.isnan(e.abs_max) else "inf" for e in entries}
    return "inf/nan" if len(kinds) > 1 else kinds.pop()


def _describe(entries: Sequence[ResolvedEntry]) -> str:
    """`output inf`, `output[0] nan, output[1] inf`: each line with what it holds (and its dtype, once)."""
    parts = [f"{e.label} {_value_kind([e])}" for e in entries]
    dtypes = {e.dtype for e in entries if e.dtype is not None}
    suffix = f" ({dtypes.pop()})" if len(dtypes) == 1 else ""
    return ", ".join(parts) + suffix


def _float_abs_max(entries: Sequence[ResolvedEntry]) -> float | None:
    values = [float(e.abs_max) for e in entries if isinstance(e.abs_max, float)]
    return max(values) if values else None


def _finite_inputs_text(frame: ResolvedFrame) -> tuple[str, float | None, float | None]:
    roles = _split(frame)
    inputs_max = _float_abs_max(roles[Role.INPUT])
    weights_max = _float_abs_max(roles[Role.PARAMETER])
    if inputs_max is not None:
        text = f"inputs finite (abs max {inputs_max:.2e})"
    elif roles[Role.INPUT]:
        text = "inputs finite (none floating point)"
    else:
        text = "no tensor inputs"
    if weights_max is not None:
        text += f", weights finite (abs max {weights_max:.2e})"
    return text, inputs_max, weights_max


def _produced(
    frame: ResolvedFrame,
    outputs: Sequence[ResolvedEntry],
    *,
    own_code: bool,
    seen_in: tuple[str, str] | None,
    values: str | None = None,
) -> Culprit:
    inputs_text, inputs_max, weights_max = _finite_inputs_text(frame)
    where = _where(frame.module_name, frame.class_name)
    values = values or _value_kind(outputs)
    if seen_in is not None:
        # Its code handed the value to a submodule before anything returned it.
        message = (
            f"first non-finite value produced by {where} in its own code, outside its watched submodules: "
            f"{inputs_text}; {values} first seen in {seen_in[1]} of {seen_in[0] or 'the top-level model'}"
        )
    else:
        own = " in its own code (its submodules returned finite values)" if own_code else ""
        message = f"first non-finite value produced by {where}{own}: {inputs_text}, {_describe(outputs)}"
    return Culprit(
        kind="produced",
        module_name=frame.module_name,
        class_name=frame.class_name,
        batch_number=frame.batch_number,
        phase=frame.phase,
        labels=tuple(e.label for e in outputs),
        values=values,
        message=message,
        inputs_abs_max=inputs_max,
        weights_abs_max=weights_max,
        own_code=own_code or seen_in is not None,
        seen_in=seen_in,
    )


def _weight(frame: ResolvedFrame, weights: Sequence[ResolvedEntry]) -> Culprit:
    labels = tuple(e.label for e in weights)
    verb = "was" if len(labels) == 1 else "were"
    message = (
        f"{' and '.join(labels)} of {_where(frame.module_name, frame.class_name)} {verb} already non-finite when this "
        f"forward ran: {_describe(weights)}"
    )
    return Culprit(
        kind="weight",
        module_name=frame.module_name,
        class_name=frame.class_name,
        batch_number=frame.batch_number,
        phase=frame.phase,
        labels=labels,
        values=_value_kind(weights),
        message=message,
    )


def _loss(frame: ResolvedFrame, losses: Sequence[ResolvedEntry]) -> Culprit:
    values = _value_kind(losses)
    return Culprit(
        kind="loss",
        module_name=frame.module_name,
        class_name=frame.class_name,
        batch_number=frame.batch_number,
        phase=frame.phase,
        labels=tuple(e.label for e in losses),
        values=values,
        message=(
            f"first non-finite value produced by the loss, computed outside the watched modules from their outputs, "
            f"which were finite: {_describe(losses)}"
        ),
    )


def _from_outside(frame: ResolvedFrame, inputs: Sequence[ResolvedEntry], later: Sequence[ResolvedFrame]) -> Culprit:
    """The first frame's input was already non-finite: find the enclosing call that made it, or the model input."""
    # The call that enclosed this one is the first later frame of each enclosing module (a module called twice in a
    # batch returns once per call; the first return after this frame is the call that was open).
    enclosing: dict[str, ResolvedFrame] = {}
    for candidate in later:
        if _encloses(candidate.module_name, frame.module_name) and candidate.module_name not in enclosing:
            enclosing[candidate.module_name] = candidate
    seen_in = (frame.module_name, inputs[0].label)
    outermost: tuple[ResolvedFrame, list[ResolvedEntry]] | None = None
    for name in sorted(enclosing, key=_depth, reverse=True):  # innermost first
        outer = enclosing[name]
        roles = _split(outer)
        weights = [e for e in roles[Role.PARAMETER] if e.non_finite]
        if weights:
            return _weight(outer, weights)
        outer_inputs = [e for e in roles[Role.INPUT] if e.non_finite]
        if not outer_inputs:
            outputs = [e for e in roles[Role.OUTPUT] if e.non_finite]
            return _produced(outer, outputs, own_code=True, seen_in=seen_in, values=_value_kind(inputs))
        outermost = (outer, outer_inputs)
    if outermost is None:
        return _unknown(frame, inputs, "first seen in")
    outer, outer_inputs = outermost
    values = _value_kind(outer_inputs)
    labels = tuple(e.label for e in outer_inputs)
    if outer.module_name == "":
        message = f"{values} entered through {', '.join(labels)} of the top-level model ({outer.class_name})"
        kind: CulpritKind = "model_input"
    else:
        # The top-level model's call was not recorded (not watched, or not returned yet when this check ran).
        message = (
            f"{values} entered through {', '.join(labels)} of {_where(outer.module_name, outer.class_name)}, "
            "the outermost recorded call"
        )
        kind = "unknown"
    return Culprit(
        kind=kind,
        module_name=outer.module_name,
        class_name=outer.class_name,
        batch_number=outer.batch_number,
        phase=outer.phase,
        labels=labels,
        values=values,
        message=message,
        seen_in=seen_in,
    )


def _backward(frame: ResolvedFrame, earlier: Sequence[ResolvedFrame]) -> Culprit:
    """A backward frame: `grad output` flows in; `grad input[i]` and the parameter gradients are what it produced."""
    # The gradient w.r.t. the module's output flows in; those w.r.t. its inputs and parameters are what it produced.
    incoming = [e for e in frame.entries if e.role is Role.OUTPUT]
    produced = [e for e in frame.entries if e.role is not Role.OUTPUT]
    if not incoming:
        # The gradient w.r.t. its output may have come in a frame of its own, just before (core/features/gradients.py).
        for other in reversed(earlier):
            if other.module_name == frame.module_name and other.is_backward:
                incoming = [e for e in other.entries if e.role is Role.OUTPUT]
                if incoming:
                    break
    broken_in = [e for e in incoming if e.non_finite]
    broken_out = [e for e in produced if e.non_finite]
    name = frame.class_name
    where = _where(frame.module_name, name)
    if broken_in or not broken_out:
        entries = broken_in or [e for e in frame.entries if e.non_finite]
        return _unknown(frame, entries, "first seen in", backward=True)
    incoming_max = _float_abs_max(incoming)
    received = f"gradient in finite (abs max {incoming_max:.2e})" if incoming_max is not None else "no gradient in"
    return Culprit(
        kind="produced",
        module_name=frame.module_name,
        class_name=name,
        batch_number=frame.batch_number,
        phase=frame.phase,
        labels=tuple(e.label for e in broken_out),
        values=_value_kind(broken_out),
        message=f"first non-finite gradient produced by the backward of {where}: {received}, {_describe(broken_out)}",
        inputs_abs_max=incoming_max,
        backward=True,
    )


def _unknown(frame: ResolvedFrame, entries: Sequence[ResolvedEntry], how: str, *, backward: bool = False) -> Culprit:
    labels = tuple(e.label for e in entries)
    values = _value_kind(entries) if entries else "inf/nan"
    if backward:
        why = "it flowed in from the loss or from code outside the watched modules"
    else:
        why = "made by code outside the watched modules"
    message = (
        f"{values} {how} {', '.join(labels)} of {_where(frame.module_name, frame.class_name)}; no recorded call "
        f"accounts for it ({why})"
    )
    return Culprit(
        kind="unknown",
        module_name=None,
        class_name=None,
        batch_number=frame.batch_number,
        phase=frame.phase,
        labels=labels,
        values=values,
        message=message,
        seen_in=(frame.module_name, labels[0]) if labels else None,
        backward=backward,
    )


class CulpritFeature(Feature):
    """Ends every report with the culprit line (the `culprit` section)."""

    name = "culprit"

    def annotate(self, ctx: EngineContext, report: Report, resolved: Sequence[ResolvedFrame], first: int) -> Report:
        try:
            culprit = find_culprit(resolved, first)
        except Exception as error:  # the report matters more than its last line
            ctx.logger.warning(f"nanwatch could not name the first culprit: {error!r}")
            return report
        return report.with_section(culprit_section(culprit))


def culprit_section(culprit: Culprit) -> ReportSection:
    """The report's culprit section: its one line, its JSON, the `Culprit` itself."""
    return ReportSection("culprit", 10, (culprit.message,), culprit.to_dict(), culprit)
