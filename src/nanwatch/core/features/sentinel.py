"""Sentinel mode (`mode="sentinel"`): cheap enough to leave on, and the exact report when it is needed.

No per-module hook. Hooks on the model the loop calls (or on its `torch.compile` wrapper, outside the compiled
graph; or, for a LightningModule, whose `training_step` is the loop's call, on its direct children) see each
outermost forward call. For a training call, a pre-hook keeps references (no copies) to its args and kwargs, the
generator states, the autocast state and the grad mode, and, once per micro-batch, copies of the buffers a forward
changes (BatchNorm's running stats; the others are referenced). The forward hook reads each float output once on
the device, no host sync (its min and max: either is inf or nan as soon as a value is, and neither overflows from
finite values; an evaluation output is summed and kept until its check, `_look_at`), and puts a tensor hook on it
that keeps a reference to the gradient w.r.t. it. They join the check's one host read, with the guard's gradients
and the loss. Nothing more is kept, and only for the current accumulation window (until the optimizer step; with no
optimizer guarded, until the micro-batch ends).

When one is inf/nan, that micro-batch is run again (`EngineContext.rerun`) on the unwrapped model, with every
module watched: the same inputs, generator states, autocast state and buffers, and the same weights (the step never
ran). When only the gradients about to be applied are non-finite, the window's micro-batches are replayed in order
with their backward too, driven by the kept gradient w.r.t. each output (through `torch.autograd.grad`: nothing is
accumulated into `.grad`, and no hook of a DDP wrapper fires), until one reproduces. The report is then that
replay's full report. A replay that stays finite is a finding of its own, and the report says so. The buffers and
the generators end as they were; a replay that fails adds its error to the report and never replaces it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from nanwatch.core.events import EngineContext, Feature, OptimizerStage, Phase
from nanwatch.core.frames import Frame, Role
from nanwatch.core.hooks import reshards_after_forward
from nanwatch.core.log import warn
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.runstate import autocast_as, autocast_state, capture_rng_states, restore_rng_states
from nanwatch.core.walk import walk

__all__ = ["SentinelFeature", "MAX_WINDOW"]

# Micro-batches kept at most (a loop that never steps an optimizer would otherwise keep every one).
MAX_WINDOW = 64
# Evaluation outputs of these dtypes are summed (float16/bfloat16 sums need a float32 pass, slower than aminmax).
_SUMMED = frozenset((torch.float32, torch.float64))


@dataclass
class _Call:
    """One outermost forward call of a training micro-batch: references to its inputs, and the state it began in."""

    module: torch.nn.Module  # what runs it again (the unwrapped model when the call went through a wrapper)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: dict[str, Any]
    autocast: dict[str, str]
    grad_enabled: bool
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # by output label, kept in backward


@dataclass
class _MicroBatch:
    """What running one training micro-batch again needs: its calls, and the buffers it changes, as it began."""

    batch_number: int
    buffers: dict[str, torch.Tensor]
    calls: list[_Call] = field(default_factory=list)


@dataclass
class _Seen:
    """What was seen of one output: 0-d device tensors, any of them inf/nan when a value is; and what it is of."""

    values: tuple[torch.Tensor, ...]
    what: str
    batch_number: int
    phase: Phase
    output: torch.Tensor | None = None  # kept until the check when `values` is a sum, which can overflow


class SentinelFeature(Feature):
    name = "sentinel"
    detects = True

    def __init__(self) -> None:
        self._ctx: EngineContext | None = None
        self._active = False
        self._depth = 0  # forward calls open among the hooked modules: only the outermost one is kept
        self._window: list[_MicroBatch] = []
        self._seen: list[_Seen] = []
        self._screened: list[_Seen] = []
        self._buffers: list[tuple[str, torch.Tensor]] = []
        self._sharded = False  # FSDP: a forward on one rank alone would run collectives no other rank runs
        self._changing: set[str] | None = None  # the buffers a forward changes, once one micro-batch showed which
        self._as_first_began: dict[str, torch.Tensor] | None = None  # the buffers before the first micro-batch
        self._said_unreadable = False  # an output with no floating-point tensor in it was warned about

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        self._ctx = ctx
        self._active = True
        self._buffers = list(ctx.model.named_buffers())
        self._sharded = any(_shards_parameters(module) for module in ctx.model.modules())
        if ctx.entry is not ctx.model:  # a wrapper (DDP, torch.compile): hooked outside it, replayed on the model
            hooked = [(ctx.entry, ctx.model)]
        elif any(module is ctx.model for _, module in modules):  # the model the loop calls
            hooked = [(ctx.model, ctx.model)]
        else:  # a root left out of the watch (a LightningModule): its training_step calls its children, or its own
            # forward, which calls them; each outermost call among them is kept, and replayed on its own
            hooked = [(child, child) for child in ctx.model.children()]
        for module, runner in hooked:
            ctx.hooks.add_handle(module.register_forward_pre_hook(self._before(runner), with_kwargs=True))
            ctx.hooks.add_handle(module.register_forward_hook(self._after, always_call=True))

    def detach(self, ctx: EngineContext) -> None:
        self._active = False

    def held_bytes(self) -> int:
        """Memory this feature keeps alive that the run would otherwise free: the copies of changing buffers and the
        gradients w.r.t. the model's output, over the window (inputs are references to the caller's tensors)."""
        total = 0
        for micro in self._window:
            own = {name: buffer for name, buffer in self._buffers}
            total += sum(copy.nbytes for name, copy in micro.buffers.items() if copy is not own.get(name))
            total += sum(grad.nbytes for call in micro.calls for grad in call.output_grads.values())
        return total

    def close(self, ctx: EngineContext) -> None:
        self._window, self._seen, self._screened, self._buffers = [], [], [], []
        self._as_first_began = None

    # --------------------------------------------------------------------------------------------- keeping

    def _before(self, runner: torch.nn.Module) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._depth += 1
            ctx = self._ctx
            if self._depth > 1 or ctx is None or not self._active or not module.training or not ctx.recording:
                return
            try:
                _refuse_what_the_forward_consumes(args, kwargs)
            except TypeError:
                self._depth -= 1  # this forward never runs
                raise
            micro = self._micro_batch(ctx.batch_number)
            micro.calls.append(
                _Call(
                    runner, tuple(args), dict(kwargs), capture_rng_states(), autocast_state(), torch.is_grad_enabled()
                )
            )

        return hook

    def _micro_batch(self, batch_number: int) -> _MicroBatch:
        if self._window and self._window[-1].batch_number == batch_number:
            return self._window[-1]
        if self._changing is None and self._as_first_began is not None:
            # One micro-batch has run: the buffers it changed are copied from now on, the others only referenced.
            first, self._as_first_began = self._as_first_began, None
            self._changing = {name for name, buffer in self._buffers if not torch.equal(buffer, first[name])}
        changing = self._changing
        with torch.no_grad():  # copies of the buffers a forward changes (BatchNorm's running stats), references else
            buffers = {
                name: buffer.detach().clone() if changing is None or name in changing else buffer
                for name, buffer in self._buffers
            }
        if changing is None:
            self._as_first_began = buffers
        self._window.append(_MicroBatch(batch_number, buffers))
        del self._window[:-MAX_WINDOW]
        return self._window[-1]

    def _after(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        ctx = self._ctx
        if self._depth or ctx is None or not self._active or not ctx.recording:
            return
        training = module.training
        call = self._window[-1].calls[-1] if training and self._window and self._window[-1].calls else None
        batch = ctx.batch_number if training else ctx.current_batch
        leaves = list(_float_leaves(output))
        # An always-called hook also runs when the forward raised (with output None): that is no unreadable output,
        # and the user's own exception is what they must see.
        forward_raised = output is None and sys.exc_info()[1] is not None
        if not leaves and not forward_raised and not self._said_unreadable:
            self._said_unreadable = True
            warn(_unreadable(module, output, guarded=ctx.guarded))
        for label, leaf in leaves:
            if leaf.numel():  # an empty output holds no inf/nan (and has no min)
                self._seen.append(_look_at(leaf.detach(), f"{label} of the model", batch, training))
            if call is not None and leaf.requires_grad:
                leaf.register_hook(self._keep_gradient(call, label))  # type: ignore[no-untyped-call]

    def _keep_gradient(self, call: _Call, label: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self._active:
                call.output_grads[label] = grad  # read only on a replay

        return hook

    def on_optimizer_step(
        self, ctx: EngineContext, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None
    ) -> None:
        if stage == "after":  # the window's gradients were applied: a new one begins
            self._window = []

    def on_batch_end(self, ctx: EngineContext, phase: Phase, batch_number: int) -> None:
        self._screened = []  # checked: the evaluation outputs kept for it go
        # With no optimizer guarded, no step will look at this micro-batch's gradients again: it is done with.
        if phase == "train" and not ctx.guarded:
            self._window = []

    # ------------------------------------------------------------------------------------------- checking

    def screen(
        self, ctx: EngineContext, pending: Sequence[Frame], maxima: Mapping[tuple[Any, Any], torch.Tensor]
    ) -> list[torch.Tensor]:
        seen, self._seen = self._seen, []
        self._screened = seen
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for item in seen:
            groups.setdefault((item.values[0].device, item.values[0].dtype), []).extend(item.values)
        return [torch.isfinite(torch.stack(values)).all() for values in groups.values()]

    def review(self, ctx: EngineContext, pending: Sequence[Frame]) -> Report | None:
        screened, self._screened = self._screened, []
        tripped = [item for item in screened if _holds_non_finite(item)]
        if not tripped:
            return None
        seen = list(dict.fromkeys(item.what for item in tripped))
        first = tripped[0]  # the micro-batch it was seen in: the one to replay
        line = f"the sentinel saw inf/nan in {', '.join(seen)}"
        section = ReportSection("sentinel", 4, (line,), {"seen": seen}, first.batch_number)
        report = ctx.detection_report(section, "")
        return dataclasses.replace(report, batch_number=first.batch_number, phase=first.phase)

    # -------------------------------------------------------------------------------------------- replay

    def judge(self, ctx: EngineContext, report: Report, checked: Sequence[Frame]) -> Report | None:
        if not self._active or report.section("replay") is not None:
            return report
        if report.phase != "train":
            note = "an evaluation forward is checked, not replayed (its inputs are not kept)"
            return report.with_section(ReportSection("replay", 30, (note,), {"reproduced": None}))
        seen = report.section("sentinel")
        loss_first = any(
            entry.role is Role.LOSS and entry.non_finite for frame in report.frames for entry in frame.entries
        )
        if loss_first and seen is None:  # the model's output was finite: there is nothing inside it to replay
            note = "not replayed: the inf/nan first appeared in the loss, computed outside the model from its output"
            return report.with_section(ReportSection("replay", 30, (note,), {"reproduced": None}))
        if self._sharded:
            note = (
                "not replayed: the model's parameters are sharded (FSDP), and a forward on this rank alone would "
                "gather them through collectives no other rank runs; run with mode='full' to see every module"
            )
            return report.with_section(ReportSection("replay", 30, (note,), {"reproduced": None}))
        if seen is not None:  # seen at the output of a known micro-batch: that one is replayed
            window = [micro for micro in self._window if micro.batch_number == seen.payload]
        else:  # seen in the gradients the step would apply: any micro-batch of the window may have put it there
            window = [micro for micro in self._window if micro.batch_number <= report.batch_number]
        if not window:
            note = "no micro-batch was kept to replay (watching began after its forward)"
            return report.with_section(ReportSection("replay", 30, (note,), {"reproduced": None}))
        # inf/nan in the model's output: its forward is where it began. Only in the gradients: the backward is
        # replayed too, driven by the gradient w.r.t. the output kept from the first run, when that one was finite
        # (a non-finite one came in from the loss, and running the model's backward from it would prove nothing).
        backward = seen is None and report.section("gradients") is not None
        try:
            for micro in window:
                found = ctx.rerun(
                    lambda micro=micro: self._run_again(ctx, micro, backward=backward),  # type: ignore[misc]
                    batch_number=micro.batch_number,
                    phase="train",
                    gradients=backward,
                )
                if found is not None:
                    return _reproduced(found, report, micro, backward=backward)
        except Exception as error:  # the replay's own failure never replaces the detection
            line = f"the replay of this micro-batch failed: {error!r}; the detection above is what the sentinel saw"
            return report.with_section(ReportSection("replay", 30, (line,), {"reproduced": None, "error": repr(error)}))
        return _not_reproduced(report, window, ctx.world_size)

    def _run_again(self, ctx: EngineContext, micro: _MicroBatch, *, backward: bool) -> None:
        """The micro-batch's calls (and backward) as they first ran; the buffers and generators end as they were."""
        buffers = dict(ctx.model.named_buffers())
        with torch.no_grad():
            now = {name: buffer.detach().clone() for name, buffer in buffers.items()}
        callers_rng = capture_rng_states()
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
                        for label, leaf in _float_leaves(output)
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


def _unreadable(module: torch.nn.Module, output: Any, *, guarded: bool) -> str:
    """What to say of an output that holds no floating-point tensor: what was returned, what is still checked."""
    if output is None or isinstance(output, (bool, int, float)):
        returned = repr(output) if output is None else f"a {type(output).__name__} ({output!r})"
    elif isinstance(output, torch.Tensor):
        returned = f"a {str(output.dtype).removeprefix('torch.')} tensor"
    else:
        returned = f"a {type(output).__name__} with no floating-point tensor in it"
    checked = (
        "only the gradients are checked, before each optimizer step (and a loss recorded with watch_loss)"
        if guarded
        else "with no optimizer guarded, nothing else is either (but a loss recorded with watch_loss)"
    )
    return (
        f"nanwatch sentinel mode: the forward of {type(module).__name__} returned {returned}, so its output is not "
        f"checked; {checked}. Return the output (or the loss) as a floating-point tensor, record the loss with "
        "watch_loss(loss), pass the optimizer (optimizer=) so the gradients are checked before each step, or watch "
        "with mode='full'. (Said once.)"
    )


def _shards_parameters(module: torch.nn.Module) -> bool:
    # FSDP2 (`fully_shard`) and FSDP1 wrappers; nanwatch imports neither (core/hooks.py checks FSDP2 the same way).
    return reshards_after_forward(module) or type(module).__name__ == "FullyShardedDataParallel"


def _detached(value: Any) -> Any:
    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else tensor

    return tree_map_only(torch.Tensor, cut, value)


def _reproduced(found: Report, original: Report, micro: _MicroBatch, *, backward: bool) -> Report:
    line = (
        f"reproduced by replaying micro-batch {micro.batch_number} with every module watched (the same inputs, "
        "random generator states, autocast state and buffers; the same weights, since the step never ran)"
    )
    if backward:
        line += (
            "; its backward was driven by the gradient w.r.t. the model's output kept from the first run, through "
            "torch.autograd.grad, so the parameters' .grad lines are not recorded (the gradients above list them)"
        )
    report = found.with_section(ReportSection("replay", 30, (line,), {"reproduced": True}))
    for key in ("sentinel", "gradients"):
        section = original.section(key)
        if section is not None:
            report = report.with_section(section)
    return report


def _not_reproduced(report: Report, window: Sequence[_MicroBatch], world_size: int) -> Report:
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
    return report.with_section(ReportSection("replay", 30, (line,), {"reproduced": False}))


def _float_leaves(value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield "output", value
        return
    for label, leaf in walk(value, "output"):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            yield label, leaf


def _look_at(output: torch.Tensor, what: str, batch_number: int, training: bool) -> _Seen:
    """One read-only pass over `output`, no host sync. In training its min and max: exact (neither overflows from
    finite values), and nothing is kept, since the check comes at the optimizer step. In evaluation, checked as the
    batch ends, a float32/float64 output is summed (the cheapest pass there is) and kept until then, so a sum that
    overflowed from finite values is told from an inf/nan by looking at the output itself."""
    if not training and output.dtype in _SUMMED:
        return _Seen((output.sum(),), what, batch_number, "eval", output)
    return _Seen(tuple(torch.aminmax(output)), what, batch_number, "train" if training else "eval")


def _holds_non_finite(item: _Seen) -> bool:
    """The slow path, for the few items whose flag tripped: read their numbers (and look at a kept output)."""
    if all(_finite(float(value)) for value in item.values):
        return False
    return item.output is None or not bool(torch.isfinite(item.output).all())


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def _refuse_what_the_forward_consumes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Iterator) and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"nanwatch sentinel mode keeps a forward's inputs by reference to replay it, and a "
                f"{type(value).__name__} is used up by the forward: pass a list, a tuple or tensors, or watch with "
                "mode='full'"
            )
