"""The guard: before each optimizer step, are the gradients about to be applied finite?

One fused reduction over them (`MagnitudePlan`, made once per list of parameters: the largest magnitude of each, inf
or nan as soon as one value is; one `_foreach_norm` on an accelerator, stacks of same-shaped gradients on the CPU),
launched when the step is about to run, and read with the check's single host read. The gradients are read from the
optimizer's param groups at step time, so a parameter unfrozen after watching began is guarded too.
Under a `GradScaler`, a step the scaler skips never reaches the guard (a plain optimizer is not called; a fused one
is called with `found_inf` set, and the guard leaves it alone).

In a distributed run this is also where ranks meet without a collective of nanwatch's own: DDP (and FSDP) reduce
the gradients across ranks before the step, so a nan that appears on any rank makes every rank's gradients
non-finite, and every rank's guard sees it at the same step (core/distributed/ranks.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import is_
from typing import Any

import torch

from nanwatch.core.feature_api import EngineContext, Feature, OptimizerStage
from nanwatch.core.frames import Frame
from nanwatch.core.optimizers import gradients_to_apply, skips_this_step, takes_device_flag
from nanwatch.core.readouts import GRADIENT_MAXIMUM, Readout
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.stats.grouped import MagnitudePlan, as_vector
from nanwatch.core.stats.readback import Screened
from nanwatch.core.stats.sharded import local_shards
from nanwatch.core.torch_glue.hooks import clean_name

__all__ = ["GradientGuard", "MAX_NAMED", "backward_note"]

# Parameters named in a report; the others are counted.
MAX_NAMED = 5


class GradientGuard(Feature):
    name = "guard"
    detects = True

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        # Launched at the step, read by the next check: the parameters, and their gradients' largest magnitudes as
        # (indices into the parameters, one device vector) pairs.
        self._launched: _Launched | None = None
        self._screened: _Launched | None = None  # the magnitudes of this check (the readout), if it launched any
        self._under_review: _Launched | None = None  # the last magnitudes launched, until a check reviews them
        self._plans = _Plans()
        self._loss_batch: tuple[str, int] | None = None  # the micro-batch whose loss was handed to watch_loss last

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        named = ctx.model.named_parameters(remove_duplicate=False)
        self._names = {id(param): clean_name(name) for name, param in named}  # no FSDP1 `_fsdp_wrapped_module.`

    def close(self, ctx: EngineContext) -> None:
        # They hold the parameters: a closed watcher lets the model go.
        self._launched = self._screened = self._under_review = None
        self._plans = _Plans()

    def on_loss(self, ctx: EngineContext, loss: torch.Tensor) -> None:
        self._loss_batch = (ctx.counters.phase, ctx.counters.current_batch)

    def on_optimizer_step(
        self, ctx: EngineContext, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None
    ) -> None:
        if stage != "before" or optimizer is None or ctx.disabled_reason is not None or skips_this_step(optimizer):
            return
        params, grads = gradients_to_apply(optimizer)
        if params:
            # An optimizer told by the check itself to skip needs the exact magnitudes; the host's check can make do
            # with bounds that it confirms, gradient by gradient, in the rare step where one is not finite.
            exact = takes_device_flag(optimizer)
            self._launched = _Launched(params, self._plans.launch(params, grads, exact=exact), exact)

    def screen(
        self, ctx: EngineContext, pending: Sequence[Frame], maxima: Mapping[tuple[Any, Any], torch.Tensor]
    ) -> Sequence[Screened]:
        launched, self._launched = self._launched, None
        self._screened = launched
        if launched is None:
            return []
        self._under_review = launched  # until reviewed, or replaced: a check decided on the device is read a step late
        return [values for _, values in launched.groups]  # the check folds them with the rest: no op of the guard's

    def readouts(self) -> Mapping[Readout[Any], Callable[[], Any]]:
        return {GRADIENT_MAXIMUM: self._largest}

    def _largest(self) -> torch.Tensor | None:
        """The largest magnitude among the gradients of the step being checked (device, no sync), or None."""
        screened = self._screened
        if screened is None or not screened.groups:
            return None
        if not screened.exact:  # bounds: the largest magnitudes taken now, from the gradients about to be applied
            grads = local_shards([param.grad for param in screened.params if param.grad is not None])
            return torch.stack([_magnitude(grad).float() for grad in grads]).amax()
        return torch.stack([as_vector(values).float().amax() for _, values in screened.groups]).amax()

    def review(self, ctx: EngineContext, pending: Sequence[Frame]) -> Report | None:
        screened, self._under_review = self._under_review, None
        if screened is None:
            return None
        params, groups = screened.params, screened.groups
        values = [0.0] * len(params)
        for indices, found in groups:  # the slow path: a few transfers, once a flag tripped
            for index, value in zip(indices, as_vector(found).tolist(), strict=True):
                values[index] = float(value)
        if not screened.exact:  # a bound that is not finite: the gradient's own largest magnitude says whether it is
            for index, value in enumerate(values):
                grad = params[index].grad
                if not math.isfinite(value) and grad is not None:
                    values[index] = float(_magnitude(local_shards([grad])[0]))
        named = [
            (self._name(param, index), value) for index, (param, value) in enumerate(zip(params, values, strict=True))
        ]
        bad = [(name, value) for name, value in named if not math.isfinite(value)]
        if not bad:
            return None
        shown = ", ".join(f"{name} {_word(value)}" for name, value in bad[:MAX_NAMED])
        more = f" and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
        line = (
            f"non-finite gradients about to be applied by optimizer step {ctx.counters.optimizer_step}: {shown}{more} "
            f"({len(bad)} of {len(params)} parameters); the step did not run"
        )
        data = {
            "parameters": [{"name": name, "value": _word(value)} for name, value in bad[:MAX_NAMED]],
            "non_finite": len(bad),
            "of": len(params),
        }
        lines = [line]
        headline = f" in the gradients about to be applied (first: {bad[0][0]!r})"
        if ctx.frames_finite and ctx.config.mode == "full":  # no frame of this check holds inf/nan
            # The loss is one of the values recorded when this micro-batch's loss was handed to watch_loss (its frame
            # was in this check or an earlier one of the micro-batch, finite either way).
            loss_recorded = self._loss_batch == (ctx.counters.phase, ctx.counters.last_batch)
            note = backward_note(ctx.config.watch_gradients, loss_recorded=loss_recorded)
            lines.append(note[0].upper() + note[1:] + ".")
            headline += f"; {note}"
        # The module owning the first non-finite gradient in the optimizer's order: where it is, not where it began.
        owner = bad[0][0].rpartition(".")[0]
        return ctx.detection_report(ReportSection("gradients", 5, tuple(lines), data, bad, headline), owner)

    def _name(self, param: torch.Tensor, index: int) -> str:
        return self._names.get(id(param), f"(parameter {index} of the optimizer, outside the watched model)")


def backward_note(watch_gradients: bool, *, loss_recorded: bool = True) -> str:
    """Where inf/nan that only the gradients about to be applied hold came from, when every frame recorded (full
    mode) was finite; and, without `watch_gradients`, the option that shows where. `loss_recorded`: the micro-batch's
    loss was handed to `watch_loss` (so it is among the finite values); otherwise a loss computed outside the watched
    modules was never looked at, and may be where the inf/nan was born."""
    show_backward = "watch_gradients=True records the backward too, and names the module where it first appeared"
    if not watch_gradients and not loss_recorded:
        return (
            "every forward value recorded was finite, and no loss was handed to watch_loss: the inf/nan may have been "
            "born in a loss computed outside the watched modules (never recorded) or in backward. "
            f"handle.watch_loss(loss) before loss.backward() records such a loss; {show_backward}"
        )
    if not watch_gradients:
        return (
            "every forward value recorded, the loss handed to watch_loss included, was finite: the inf/nan appeared "
            f"in backward. {show_backward}"
        )
    return (
        "every value recorded, forward and backward, was finite: the inf/nan appeared in the gradients after the "
        "backward (a change to .grad before the step, such as gradient clipping), or in parameters of modules that "
        "are not watched"
    )


_Groups = list[tuple[list[int], Screened]]


@dataclass(frozen=True, slots=True)
class _Launched:
    """The parameters of a step and what was launched over their gradients: each group's indices into `params` and
    its values. `exact`: the values are the largest magnitudes; otherwise bounds that are finite when the gradient
    is, and may overflow when it is huge (confirmed gradient by gradient before anything is said)."""

    params: list[torch.Tensor]
    groups: _Groups
    exact: bool


class _Plans:
    """The reduction plan of the dense gradients of one list of parameters, made again when the list changes (a
    parameter unfrozen, a group added) or a gradient no longer fits it."""

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []  # the parameters planned for (a copy: the optimizer's list can change)
        self._dense: list[int] = []  # the gradients the plan reduces, by index
        self._others: list[int] = []  # the others
        self._plan: MagnitudePlan | None = None
        # Whether a planned gradient was a tensor subclass (FSDP2's DTensor): then each launch reads the local shards
        # again, since a DTensor reduced as it is runs collectives of its own.
        self._subclassed = False

    def launch(self, params: list[torch.Tensor], grads: list[torch.Tensor], *, exact: bool = True) -> _Groups:
        """The largest magnitude of each gradient (a DTensor's over this rank's shard: no collective); with `exact`
        False, where that costs more (the CPU), a bound finite exactly when the gradient is, short of overflow."""
        planned = self._params
        # The same parameters as planned for, compared by identity in C (no Python step, no object per parameter).
        # A plain parameter's gradient is plain: the planned (dense) ones need no `local_shards` then; an FSDP2
        # parameter's gradient is a DTensor at every step, and is read through its local shard at every step.
        same = len(params) == len(planned) and all(map(is_, params, planned))
        given = grads
        if self._subclassed or self._others or not same:
            grads = local_shards(grads)
        try:
            if not same or self._plan is None:
                raise RuntimeError("new parameters")
            found = self._plan.launch(grads if not self._others else [grads[i] for i in self._dense], exact=exact)
        except RuntimeError:  # new parameters, or a gradient that changed shape, dtype or kind: a new plan
            self._params = []
            self._subclassed = any(type(grad) is not torch.Tensor for grad in given)
            grads = local_shards(given)
            # The infinity norm of an empty tensor (a rank's empty shard of a small parameter) is an error.
            self._dense = [i for i, grad in enumerate(grads) if _dense(grad)]
            self._others = sorted(set(range(len(grads))) - set(self._dense))
            self._plan = MagnitudePlan([grads[i] for i in self._dense])
            found = self._plan.launch([grads[i] for i in self._dense], exact=exact)
            self._params = list(params)
        dense = self._dense
        # The plan's indices count the dense gradients; made the parameters' own where others were left out.
        groups = [([dense[k] for k in indices], vector) for indices, vector in found] if self._others else list(found)
        for index in self._others:  # sparse, empty, or a tensor subclass: reduced on its own
            groups.append(([index], [_magnitude(grads[index])]))
        return groups


def _magnitude(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's largest magnitude (0-d, on its device): of the values stored, for a sparse one; 0 when empty."""
    data = grad.coalesce().values() if grad.is_sparse else grad
    return data.abs().amax() if data.numel() else torch.zeros((), device=grad.device, dtype=grad.dtype)


def _dense(grad: torch.Tensor) -> bool:
    return grad.layout is torch.strided and type(grad) is torch.Tensor and grad.numel() > 0


def _word(value: float) -> str:
    return "nan" if math.isnan(value) else "inf"
