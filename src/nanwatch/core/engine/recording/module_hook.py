"""The forward hook each watched module carries: the recorder's hot path, run after every watched module call.

On a model of many small modules, what a watched call costs is mostly memory the hook has to reach: between two
forwards the backward has flushed the CPU caches, so each object the hook touches that no other module call touched
(each closure cell, each per-module dict or list) is a cache miss, a large share of the call. The hook is therefore a
bound method of one small object per module (`ModuleHook`: its site and the few shared objects it needs, in slots),
not a closure over eight cells, and it asks its questions in the order that returns soonest.

What it does: nothing while the recorder is not recording; inside a graph being traced (Dynamo, export) it puts the
statistics into the graph (core/stats/compiled.py); during a backward (activation checkpointing recomputes the
forward) it records a `(recompute)` frame only when gradients are watched; otherwise it defers the call when its
module has earned it (core/engine/recording/deferral.py) or records it as it returns (the recorder's `record`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from nanwatch.core.engine.recording.deferral import Deferral, Site
from nanwatch.core.frames import Direction
from nanwatch.core.stats.compiled import record_call
from nanwatch.core.stats.measure import ExtraKernels

__all__ = ["MAX_PENDING_FRAMES", "ModuleHook", "Recording"]

# A loop that never ends its batches would grow the pending frames without bound; past this many (a few tens of MB),
# they are checked and moved into the ring (a host read mid-batch, which a loop that ends its batches never pays).
MAX_PENDING_FRAMES = 20_000
_FORWARD, _RECOMPUTE = Direction.FORWARD, Direction.RECOMPUTE
# What the hook asks first: true while Dynamo traces it (it knows the function), and torch's flag for the other
# tracers (non-strict export); cheaper than `is_compiling()`, which asks TorchScript first.
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_compiler = torch.compiler
# -1 unless autograd runs a backward on this thread: what `hooks.recomputing()` asks, called here directly.
_graph_task_id = torch._C._current_graph_task_id


# `(site, module, args, kwargs, output, direction)`: a call recorded as it returns.
RecordCall = Callable[[Site, torch.nn.Module, tuple[Any, ...], dict[str, Any], Any, Direction], None]


class Recording(Protocol):
    """What a module's hook reads of the recorder (core/engine/recording/recorder.py's `Recorder`)."""

    recording: bool  # False in an unwatched batch or phase, or once watching is disabled: the hooks return at once
    tracing: bool  # the batch is traced: every call is recorded as it returns, and handed to the trace
    show_recomputes: bool  # activation checkpointing's recomputes are recorded (watch_gradients)
    unsettled: list[Any]  # the pending frames as they are: those of deferred calls not measured yet
    max_pending: int  # past this many pending frames, `when_full` (`MAX_PENDING_FRAMES` unless a test lowers it)

    @property
    def record(self) -> RecordCall:
        """Make the call's frame now and add it to the pending frames."""

    when_full: Callable[[], None]  # more than `max_pending` are pending: check them now
    disable: Callable[[str], None]  # stop watching (the run goes on): recording failed


class ModuleHook:
    """The forward hook of one watched module (`forward_hook`, registered with keyword inputs).

    Args:
        recorder: where its frames go.
        deferral: keeps the calls that can be measured later (core/engine/recording/deferral.py).
        site: its module's names and what the deferral knows of it.
        prefix: the key of its records inside a compiled graph (core/stats/compiled.py's `frame_key`).
        kernels: the extra statistics measured in this run, for its records inside a compiled graph.
    """

    __slots__ = ("recorder", "deferral", "site", "prefix", "kernels")
    # core/torch_glue/hooks.py's `HookSet` leaves this hook as it is: it keeps itself out of pickles and deep copies.
    leaves_pickles_and_copies = True

    def __init__(self, recorder: Recording, deferral: Deferral, site: Site, prefix: str, kernels: ExtraKernels) -> None:
        self.recorder, self.deferral, self.site = recorder, deferral, site
        self.prefix, self.kernels = prefix, kernels

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # `copy.deepcopy(model)` (an EMA copy) copies the modules' hook dicts, and a bound method's object with them:
        # the copy is not watched, and gets no hook of ours (core/torch_glue/hooks.py's `copied_away`), rather than a
        # copy of the recorder and everything it holds.
        from nanwatch.core.torch_glue.hooks import copied_away

        return copied_away(self, memo)

    def __reduce__(self) -> tuple[Any, ...]:
        # `torch.save(model)` and `pickle` store the module's hook dicts with it: this hook goes as a no-op of the
        # standard library (core/torch_glue/hooks.py's `pickled_away`), which the pickle of its bound method reaches as
        # the `forward_hook` of what this reduces to.
        from nanwatch.core.torch_glue.hooks import pickled_module_hook

        return pickled_module_hook()

    def forward_hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        recorder = self.recorder
        if not recorder.recording:
            return
        if _dynamo_compiling() or _compiler._is_compiling_flag:
            # A graph is being traced (Dynamo, export): the statistics go into the graph, the bookkeeping runs after
            # each call of it (core/stats/compiled.py).
            record_call(self.prefix, module, args, kwargs, output, self.kernels)
            return
        site = self.site
        try:
            # A recompute of activation checkpointing (during backward) repeats a call already recorded, not a new
            # one: it is part of the backward story, shown with it (watch_gradients) as a frame marked `(recompute)`.
            # `recomputing()`, asked here without a second compile check.
            if _graph_task_id() != -1:
                if recorder.show_recomputes:
                    recorder.record(site, module, args, kwargs, output, _RECOMPUTE)
            elif (
                site.defer
                and not kwargs
                and len(args) == 1
                and not recorder.tracing
                and self.deferral.defer(pending := recorder.unsettled, site, module, args[0], output)
            ):
                if len(pending) > recorder.max_pending:
                    recorder.when_full()
            else:
                recorder.record(site, module, args, kwargs, output, _FORWARD)
        except Exception as error:  # our bookkeeping must never kill a healthy run
            recorder.disable(f"recording {site.name or type(module).__name__} failed: {error!r}")
