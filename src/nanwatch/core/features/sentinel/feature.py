"""The sentinel feature itself: root hooks that keep each training micro-batch and look at the model's output, the
check of what they saw, and the decision to replay (or to say why not).

What sentinel mode is: the package's docstring (core/features/sentinel/__init__.py).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nanwatch.core.feature_api import EngineContext, Feature, OptimizerStage, Phase
from nanwatch.core.features.sentinel.kept import (
    MAX_WINDOW,
    Call,
    MicroBatch,
    kept_inputs,
    refuse_what_the_forward_consumes,
)
from nanwatch.core.features.sentinel.outputs import Seen, float_leaves, holds_non_finite, look_at, unreadable
from nanwatch.core.features.sentinel.replay import replay_window, same_numbers
from nanwatch.core.features.sentinel.spike_replay import KEPT_FOR_SPIKES, replay_levels
from nanwatch.core.features.sentinel.verdicts import (
    born_in_the_loss,
    not_replayable,
    not_reproduced,
    not_restored,
    reproduced,
    unreplayed,
)
from nanwatch.core.frames import Frame, Role
from nanwatch.core.log import warn
from nanwatch.core.model_state import generators as own_generators
from nanwatch.core.readouts import SPIKE_REPLAY, Readout, ReplayedLevels
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.runstate import autocast_state, capture_rng_states
from nanwatch.core.stats.readback import Screened
from nanwatch.core.torch_glue.hooks import reshards_after_forward

__all__ = ["SentinelFeature"]


class SentinelFeature(Feature):
    name = "sentinel"
    detects = True

    def __init__(self) -> None:
        self._ctx: EngineContext | None = None
        self._active = False
        self._depth = 0  # forward calls open among the hooked modules: only the outermost one is kept
        self._window: list[MicroBatch] = []
        # The window of the last step, whose check its optimizer decided on the device: kept until the host reads it.
        self._awaiting: list[MicroBatch] = []
        # With spike_window: the last micro-batches whose step was applied, for a spike's replay (spike_replay.py).
        self._recent: deque[MicroBatch] = deque(maxlen=KEPT_FOR_SPIKES)
        self._keep_recent = False
        self._seen: list[Seen] = []
        self._screened: list[Seen] = []
        self._buffers: list[tuple[str, torch.Tensor]] = []
        self._sharded = False  # FSDP: a forward on one rank alone would run collectives no other rank runs
        self._changing: set[str] | None = None  # the buffers a forward changes, once one micro-batch showed which
        self._as_first_began: dict[str, torch.Tensor] | None = None  # the buffers before the first micro-batch
        self._referenced: dict[str, int] = {}  # the version counters of the buffers kept by reference, last seen
        self._saidunreadable = False  # an output with no floating-point tensor in it was warned about
        self._generators: list[own_generators.OwnGenerator] = []  # those the model holds, kept with every call

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        self._ctx = ctx
        self._active = True
        self._buffers = list(ctx.model.named_buffers())
        self._sharded = any(_shards_parameters(module) for module in ctx.model.modules())
        self._generators = own_generators.held_by(ctx.model)
        self._keep_recent = ctx.config.spike_window is not None
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
        """Memory this feature keeps alive that the run would otherwise free, over the window (and the micro-batches
        kept for a spike's replay): the copies of changing buffers and of small inputs (sentinel_copy_inputs), and
        the gradients w.r.t. the model's output."""
        own = {name: buffer for name, buffer in self._buffers}
        total = 0
        for micro in [*self._recent, *self._awaiting, *self._window]:
            total += sum(copy.nbytes for name, copy in micro.buffers.items() if copy is not own.get(name))
            for call in micro.calls:
                total += sum(grad.nbytes for grad in call.output_grads.values())
                if call.copied:
                    total += sum(leaf.nbytes for leaf in tree_leaves((call.args, call.kwargs)) if _is_tensor(leaf))
        return total

    def close(self, ctx: EngineContext) -> None:
        self._window, self._awaiting, self._seen, self._screened, self._buffers = [], [], [], [], []
        self._recent.clear()
        self._as_first_began, self._referenced = None, {}

    # --------------------------------------------------------------------------------------------- keeping

    def _before(self, runner: torch.nn.Module) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._depth += 1
            ctx = self._ctx
            if self._depth > 1 or ctx is None or not self._active or not module.training or not ctx.recording:
                return
            try:
                refuse_what_the_forward_consumes(args, kwargs)
            except TypeError:
                self._depth -= 1  # this forward never runs
                raise
            try:
                micro = self._micro_batch(ctx.counters.batch_number)
                state = capture_rng_states(numpy=True), autocast_state(), torch.is_grad_enabled()
                kept = kept_inputs(args, kwargs, ctx.config.sentinel_copy_inputs)
                own_rng = own_generators.capture(self._generators)
                micro.calls.append(
                    Call(runner, kept.args, kept.kwargs, *state, {}, kept.versions, kept.copied, own_rng, kept.fed)
                )
            except Exception as error:  # a bug of ours: never raised in the user's forward, watching stops instead
                ctx.disable(f"sentinel mode could not keep the inputs of {type(module).__name__}: {error!r}")

        return hook

    def _micro_batch(self, batch_number: int) -> MicroBatch:
        if self._window and self._window[-1].batch_number == batch_number:
            return self._window[-1]
        if self._changing is None and self._as_first_began is not None:
            # One micro-batch has run: the buffers it changed are copied from now on, the others only referenced.
            first, self._as_first_began = self._as_first_began, None
            self._changing = {name for name, buffer in self._buffers if not torch.equal(buffer, first[name])}
        changing = self._changing
        if changing is not None:  # a buffer that starts changing later (a warm-up) is copied from then on
            changing.update(
                name
                for name, buffer in self._buffers
                if name not in changing and self._referenced.get(name, buffer._version) != buffer._version
            )
        with torch.no_grad():  # copies of the buffers a forward changes (BatchNorm's running stats), references else
            buffers = {
                name: buffer.detach().clone() if changing is None or name in changing else buffer
                for name, buffer in self._buffers
            }
        if changing is None:
            self._as_first_began = buffers
        self._referenced = {
            name: buffer._version for name, buffer in buffers.items() if changing is not None and name not in changing
        }
        self._window.append(MicroBatch(batch_number, buffers, buffer_versions=dict(self._referenced)))
        del self._window[:-MAX_WINDOW]
        return self._window[-1]

    def _after(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        ctx = self._ctx
        if self._depth or ctx is None or not self._active or not ctx.recording:
            return
        try:
            self._look(ctx, module, output)
        except Exception as error:  # a bug of ours: never raised in the user's forward, watching stops instead
            ctx.disable(f"sentinel mode could not read the output of {type(module).__name__}: {error!r}")

    def _look(self, ctx: EngineContext, module: torch.nn.Module, output: Any) -> None:
        training = module.training
        call = self._window[-1].calls[-1] if training and self._window and self._window[-1].calls else None
        batch = ctx.counters.batch_number if training else ctx.counters.current_batch
        leaves = list(float_leaves(output))
        # An always-called hook also runs when the forward raised (with output None): that is no unreadable output,
        # and the user's own exception is what they must see.
        forward_raised = output is None and sys.exc_info()[1] is not None
        if not leaves and not forward_raised and not self._saidunreadable:
            self._saidunreadable = True
            warn(unreadable(module, output, guarded=ctx.guarded))
        for label, leaf in leaves:
            if leaf.is_nested or leaf.numel():  # an empty output holds no inf/nan (and has no min)
                seen = look_at(leaf.detach(), f"{label} of the model", batch, training)
                if seen is not None:
                    self._seen.append(seen)
                elif not self._saidunreadable:
                    self._saidunreadable = True
                    warn(unreadable(module, leaf, guarded=ctx.guarded))
            if call is not None and leaf.requires_grad:
                leaf.register_hook(self._keep_gradient(call, label))

    def _keep_gradient(self, call: Call, label: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self._active:  # read only on a replay; summed over every backward through this output (two losses)
                kept = call.output_grads.get(label)
                call.output_grads[label] = grad if kept is None else kept + grad

        return hook

    def on_optimizer_step(
        self, ctx: EngineContext, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None
    ) -> None:
        if stage == "after":  # the window's gradients were applied: a new one begins
            awaited, self._awaiting = self._awaiting, []
            if ctx.decided_on_device:  # its check is read at the next step: the window waits for it
                self._awaiting, self._window = self._window, []
            else:
                self._retire(self._window)
                self._window = []
            self._retire(awaited)

    def on_batch_end(self, ctx: EngineContext, phase: Phase, batch_number: int) -> None:
        if not ctx.decided_on_device:  # checked: the evaluation outputs kept for it go
            self._screened = []
        # With no optimizer guarded, no step will look at this micro-batch's gradients again: it is done with.
        if phase == "train" and not ctx.guarded:
            self._retire(self._window)
            self._window = []

    def _retire(self, window: list[MicroBatch]) -> None:
        """`window` is done with; with spike_window its last micro-batches stay (`_recent`) for a spike's replay,
        without the gradients kept for their outputs (only a replay of inf/nan in a window still open reads them)."""
        if self._keep_recent:
            for micro in window:
                for call in micro.calls:
                    call.output_grads = {}
            self._recent.extend(window)

    # ------------------------------------------------------------------------------------------ spikes

    def readouts(self) -> Mapping[Readout[Any], Callable[[], Any]]:
        return {SPIKE_REPLAY: lambda: self._replay_levels}

    def _replay_levels(self, batch_number: int) -> ReplayedLevels:
        ctx = self._ctx
        if ctx is None or not self._active:
            return ReplayedLevels(batch_number, why_not="not replayed: sentinel mode is not watching")
        kept = [*self._recent, *self._awaiting, *self._window]
        return replay_levels(ctx, kept, batch_number, sharded=self._sharded, generators=self._generators)

    # ------------------------------------------------------------------------------------------- checking

    def screen(
        self, ctx: EngineContext, pending: Sequence[Frame], maxima: Mapping[tuple[Any, Any], torch.Tensor]
    ) -> Sequence[Screened]:
        seen, self._seen = self._seen, []
        if not seen:  # what was screened last stays for its review (a check decided on the device is read late)
            return []
        self._screened = seen
        return [list(item.values) for item in seen]  # folded by the check with every other part: no op here

    def review(self, ctx: EngineContext, pending: Sequence[Frame]) -> Report | None:
        screened, self._screened = self._screened, []
        tripped = [item for item in screened if holds_non_finite(item)]
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
        refused = self._refusal(report)
        if refused is not None:
            return unreplayed(report, refused)
        seen = report.section("sentinel")
        open_window = [*self._awaiting, *self._window]  # (a step decided on the device is judged a step late)
        if seen is not None:  # seen at the output of a known micro-batch: that one is replayed
            window = [micro for micro in open_window if micro.batch_number == seen.payload]
        else:  # seen in the gradients the step would apply: any micro-batch of the window may have put it there
            window = [micro for micro in open_window if micro.batch_number <= report.batch_number]
        if not window:
            return unreplayed(report, "no micro-batch was kept to replay (watching began after its forward)")
        # inf/nan in the model's output: its forward is where it began. Only in the gradients: the backward is
        # replayed too, driven by the gradient w.r.t. the output kept from the first run; a kept gradient that is
        # itself non-finite came in from the loss, and that is the finding.
        backward = seen is None and report.section("gradients") is not None
        if backward:
            from_loss = _non_finite_output_gradient(window)
            if from_loss is not None:
                return born_in_the_loss(report, *from_loss)
        changed = [what for micro in window for what in micro.changed()]
        window = [micro for micro in window if not micro.changed()]  # replaying those would run other values
        try:
            return self._replay(ctx, report, window, backward=backward, changed=changed)
        except Exception as error:  # the replay's own failure never replaces the detection
            line = f"the replay of this micro-batch failed: {error!r}; the detection above is what the sentinel saw"
            return unreplayed(report, line, error=repr(error))

    def _refusal(self, report: Report) -> str | None:
        """Why this detection is not replayed at all, or None."""
        if report.phase != "train":
            return "an evaluation forward is checked, not replayed (its inputs are not kept)"
        loss_first = any(
            entry.role is Role.LOSS and entry.non_finite for frame in report.frames for entry in frame.entries
        )
        if loss_first and report.section("sentinel") is None:  # the model's output was finite: nothing to replay
            return "not replayed: the inf/nan first appeared in the loss, computed outside the model from its output"
        if self._sharded:
            return (
                "not replayed: the model's parameters are sharded (FSDP), and a forward on this rank alone would "
                "gather them through collectives no other rank runs; run with mode='full' to see every module"
            )
        return None

    def _replay(
        self, ctx: EngineContext, report: Report, window: list[MicroBatch], *, backward: bool, changed: list[str]
    ) -> Report:
        """Replay the window; a second time when the first stays finite, to tell a computation that differs from
        run to run from one that repeats itself (a transient fault)."""
        first = replay_window(ctx, window, backward=backward, generators=self._generators)
        if first.found is not None and first.micro is not None:
            return reproduced(first.found, report, first.micro, backward=backward)
        if changed:  # what was replayed stayed finite, and the rest could not be: nothing to conclude from that
            return not_replayable(report, changed)
        second = replay_window(ctx, window, backward=backward, generators=self._generators)
        if second.found is not None and second.micro is not None:
            return reproduced(second.found, report, second.micro, backward=backward, second=True)
        agree = same_numbers(first, second)
        kept = {id(generator.generator) for generator in self._generators}
        unsaved = [
            f"the generator {generator.name!r} (made after watching began, so its state was not kept)"
            for generator in own_generators.held_by(ctx.model)
            if id(generator.generator) not in kept
        ]
        if not agree and unsaved:
            return not_restored(report, unsaved)
        return not_reproduced(report, window, ctx.world_size, replays_agree=agree)


def _non_finite_output_gradient(window: Sequence[MicroBatch]) -> tuple[MicroBatch, str] | None:
    """The first kept gradient w.r.t. the model's output that is inf/nan, by micro-batch and label (slow path). Not
    in a micro-batch where a call took an input that carries a graph (`model(model(x))`): an earlier call's output
    gradient may then have come through the model's own backward, which the replay runs to tell."""
    for micro in window:
        if any(call.fed for call in micro.calls):
            continue
        for call in micro.calls:
            for label, grad in call.output_grads.items():
                if not bool(torch.isfinite(grad).all()):
                    return micro, label
    return None


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _shards_parameters(module: torch.nn.Module) -> bool:
    # FSDP2 (`fully_shard`) and FSDP1 wrappers; nanwatch imports neither (core/torch_glue/hooks.py checks FSDP2 the
    # same way).
    return reshards_after_forward(module) or type(module).__name__ == "FullyShardedDataParallel"
