"""Backward frames: the gradients w.r.t. each module's outputs and inputs, and each parameter's accumulated gradient.

With `watch_gradients=True`, these join the ring next to the forward frames, in the order autograd produces them, so
a nan that first appears during backward is reported at the module where it appeared. A backward frame reads

                      encoder.1 Linear (backward)
    1.00e-05 2.00e-01 grad output
    3.00e-06 4.00e-01 grad weight
    0.00e+00 1.00e+00 grad input[0]

How the gradients are caught, and why not with `register_full_backward_hook`: a full backward hook wraps the module's
outputs in an autograd function whose results are views, and an in-place op on them afterwards
(`ReLU(inplace=True)`, `x += ...`) then fails. Here nothing is wrapped:

- the gradient w.r.t. an output or an input: a `Tensor.register_hook` on that tensor, put there by the module's forward
  hook (only on tensors that require grad). A hook registered before an in-place change receives the gradient w.r.t.
  the value before the change, i.e. the module's own output; the tensor's graph owns the hook, so it dies with the
  graph. One hook per tensor serves every module that produced or consumed it (a module's input is mostly the
  previous module's output): when it fires, the consumers' `grad input` lines come first, as their backward is what
  produced this gradient, then the producers' `grad output` lines. An in-place module (its output *is* its input)
  gets only `grad output`: its input's gradient is the previous module's `grad output`.
- a parameter's gradient: `Tensor.register_post_accumulate_grad_hook`, which runs once the gradient is accumulated
  into `.grad`. It runs at every backward: under gradient accumulation, the line of micro-batch k shows `.grad` after
  k micro-batches of the current optimizer step (the running sum), so the last micro-batch's line is exactly what the
  optimizer applies, and the first micro-batch whose contribution is not finite is the one reported. Its handles are
  kept and removed by `detach()`. Parameters that do not require grad when watching starts get no hook.

Under `torch.compile` the module's forward hooks are traced into the graph, where a tensor hook, a weak reference or
a version counter would break it: there the gradients w.r.t. outputs and inputs are not hooked (the graph stays whole),
and only the parameters' gradients are recorded (their hooks run when autograd accumulates `.grad`, outside the
compiled graph). A nan born in a compiled backward is then reported at the first parameter whose gradient holds it,
and the log says once that the other lines need an eager run.

Under a `GradScaler` the gradients are measured as autograd produces them, i.e. multiplied by the loss scale (before
`unscale_`). Nothing here waits for the device: `measure()` only launches kernels; the batch check reads them back.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from nanwatch.core.feature_api import EngineContext, Feature, Phase
from nanwatch.core.frames import GRAD_PREFIX, Direction, Entry, Frame, RecordedFrame, Role
from nanwatch.core.stats.measure import Measurement
from nanwatch.core.torch_glue.hooks import module_class_name, recomputing
from nanwatch.core.walk import walk

__all__ = ["GradientRecorder"]


@dataclass(slots=True)
class _Role:
    module_name: str
    class_name: str
    module: torch.nn.Module
    label: str
    role: Role


@dataclass(slots=True)
class _TensorWatch:
    """The one hook nanwatch put on one tensor (at one version), and every module that produced or consumed it."""

    ref: weakref.ref[torch.Tensor]
    version: int
    consumers: list[_Role] = field(default_factory=list)  # `grad input[i]`, innermost module first
    producers: list[_Role] = field(default_factory=list)  # `grad output`, innermost module first
    handle: RemovableHandle | None = None
    recomputed: bool = False  # first hooked in a recompute of activation checkpointing


class GradientRecorder(Feature):
    """Adds backward frames to the engine's pending frames (`watch_gradients=True`)."""

    name = "gradients"

    def __init__(self) -> None:
        self._ctx: EngineContext | None = None
        self._active = False
        # id(tensor) -> its watch, while the tensor's Python object lives (a weakref callback drops the entry).
        self._tensors: dict[int, _TensorWatch] = {}
        self._open: Frame | None = None  # the backward frame later lines of the same module may join
        self._compiled_calls = False  # a forward ran in a compiled graph, where no tensor was hooked
        self._said_compiled = False

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        """Put a forward hook (which hooks the tensors) on each module and a post-accumulate hook on each parameter."""
        self._ctx = ctx
        seen: set[int] = set()
        for name, module in modules:
            class_name = module_class_name(module)
            ctx.hooks.add_forward(module, self._make_forward_hook(name, class_name))
            for param_name, param in module._parameters.items():
                # A shared (tied) parameter is reported under the first module that owns it, once.
                if param is None or not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                hook = self._make_parameter_hook(name, class_name, module, GRAD_PREFIX + param_name)
                ctx.hooks.add_handle(param.register_post_accumulate_grad_hook(hook))
        self._active = True

    def detach(self, ctx: EngineContext) -> None:
        """Stop recording and remove the hooks still on live tensors (the engine's HookSet removes the rest)."""
        self._active = False
        for watched in list(self._tensors.values()):
            if watched.handle is not None:
                watched.handle.remove()
        self._tensors.clear()
        self._open = None

    def on_batch_end(self, ctx: EngineContext, phase: Phase, batch_number: int) -> None:
        if self._compiled_calls and not self._said_compiled:
            self._said_compiled = True
            if ctx.rank_logs(ctx.config.trace_ranks):
                ctx.logger.warning(
                    "nanwatch: watch_gradients under torch.compile records each parameter's gradient (`grad weight` "
                    "lines); the gradients w.r.t. module outputs and inputs inside the compiled graph are not "
                    "recorded, so the graph stays whole. Run the model eagerly to see them."
                )

    # ---------------------------------------------------------------------------------------------- forward

    def _make_forward_hook(self, name: str, class_name: str) -> Any:
        def forward_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            ctx = self._ctx
            if not self._active or ctx is None or not ctx.recording or not torch.is_grad_enabled():
                return
            if torch.compiler.is_compiling():
                # Traced into the graph: only this write is (dynamo replays it after each call of the graph).
                self._compiled_calls = True
                return
            try:
                self._hook_tensors(name, class_name, module, args, output)
            except Exception as error:  # our bookkeeping must never kill a healthy run
                ctx.disable(f"hooking the gradients of {name or class_name} failed: {error!r}")

        return forward_hook

    def _hook_tensors(
        self, name: str, class_name: str, module: torch.nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        # A recompute of activation checkpointing (during backward) leaves the tensors the first forward hooked as
        # they are: a non-reentrant checkpoint recomputes from the very same inputs, whose one gradient is shown once.
        # The tensors it makes are hooked: under a reentrant checkpoint, whose first forward ran without grad,
        # backward goes through the recomputed graph.
        recompute = recomputing()
        outputs = list(_grad_leaves(output, "output"))
        for label, tensor in outputs:
            watched = self._watch(tensor, recompute)
            if watched.recomputed or not recompute:
                watched.producers.append(_Role(name, class_name, module, GRAD_PREFIX + label, Role.OUTPUT))
        output_ids = {id(tensor) for _, tensor in outputs}
        for index, value in enumerate(args):
            for label, tensor in _grad_leaves(value, f"input[{index}]"):
                if id(tensor) not in output_ids:  # an in-place module: its output already carries the hook
                    watched = self._watch(tensor, recompute)
                    if watched.recomputed or not recompute:
                        watched.consumers.append(_Role(name, class_name, module, GRAD_PREFIX + label, Role.INPUT))

    def _watch(self, tensor: torch.Tensor, recompute: bool = False) -> _TensorWatch:
        key = id(tensor)
        watched = self._tensors.get(key)
        # The same object at the same version: the same value, so the same gradient. After an in-place change the
        # tensor's gradient is another one (w.r.t. the changed value), which needs a hook of its own.
        if watched is not None and watched.ref() is tensor and watched.version == tensor._version:
            return watched
        tensors = self._tensors

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            entry = tensors.get(key)
            if entry is not None and entry.ref is ref:
                del tensors[key]

        watched = _TensorWatch(weakref.ref(tensor, forget), tensor._version, recomputed=recompute)
        watched.handle = tensor.register_hook(self._make_tensor_hook(watched))
        tensors[key] = watched
        return watched

    # --------------------------------------------------------------------------------------------- backward

    def _make_tensor_hook(self, watched: _TensorWatch) -> Any:
        def tensor_hook(grad: torch.Tensor) -> None:
            ctx = self._ctx
            if not self._active or ctx is None or not ctx.recording:
                return
            try:
                with torch.no_grad():  # a backward with create_graph=True must not trace our kernels
                    measurement = ctx.measure(grad)
                for role in watched.consumers + watched.producers:
                    self._add(ctx, role.module_name, role.class_name, role.module, role.label, role.role, measurement)
            except Exception as error:
                ctx.disable(f"recording a gradient failed: {error!r}")

        return tensor_hook

    def _make_parameter_hook(self, name: str, class_name: str, module: torch.nn.Module, label: str) -> Any:
        def parameter_hook(param: torch.Tensor) -> None:
            ctx = self._ctx
            if not self._active or ctx is None or not ctx.recording or param.grad is None:
                return
            try:
                with torch.no_grad():
                    measurement = ctx.measure(param.grad)
                self._add(ctx, name, class_name, module, label, Role.PARAMETER, measurement)
            except Exception as error:
                ctx.disable(f"recording the gradient of {name}.{label[len(GRAD_PREFIX) :]} failed: {error!r}")

        return parameter_hook

    def _add(
        self,
        ctx: EngineContext,
        name: str,
        class_name: str,
        module: torch.nn.Module,
        label: str,
        role: Role,
        measurement: Measurement,
    ) -> None:
        entry = Entry(label, role, measurement)
        frame = self._open
        batch = ctx.counters.current_batch
        if (
            frame is not None
            and frame.module_name == name
            and frame.batch_number == batch
            and ctx.is_last_pending(frame)
        ):
            # Consecutive lines of one module make one frame; the order of the ring stays the order of production.
            frame.entries.append(entry)
            if ctx.tracing:  # the trace is a stream: it gets this line on its own, under the module's header
                ctx.trace_frame(
                    RecordedFrame(name, class_name, batch, ctx.counters.phase, [entry], Direction.BACKWARD), module
                )
            return
        frame = RecordedFrame(name, class_name, batch, ctx.counters.phase, [entry], Direction.BACKWARD)
        self._open = frame
        ctx.add_frame(frame, module)


def _grad_leaves(value: Any, label: str) -> Iterable[tuple[str, torch.Tensor]]:
    """The `(label, tensor)` leaves of `value` whose gradient autograd will compute."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield label, value
        return
    if value is None or isinstance(value, (int, float, bool, str)):
        return
    for leaf_label, leaf in walk(value, label):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            yield leaf_label, leaf
