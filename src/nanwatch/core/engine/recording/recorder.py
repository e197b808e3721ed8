"""Recording: a forward hook per watched module makes a frame of what the call saw, eagerly or inside a graph.

One hook per module (module_hook.py: the hot path), with no per-feature dispatch inside it (a feature that
needs per-call work registers hooks of its own). Every frame, from a hook, a compiled graph, a feature (backward
frames) or the loss, joins the pending frames through one step, `append`: traced if the batch is traced, and checked
early if a loop that never ends its batches lets them pile up.

The common call (one tensor in, one small floating-point tensor out, no keywords) is deferred once its module has
shown that nothing changes its outputs in place after the call: its frame is made at the check (core/engine/
deferral.py).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.recording.deferral import Deferral, Site
from nanwatch.core.engine.recording.deferred_frames import Settled
from nanwatch.core.engine.recording.module_hook import MAX_PENDING_FRAMES, ModuleHook
from nanwatch.core.frames import Direction, Entry, Frame, RecordedFrame, Role
from nanwatch.core.log import warn
from nanwatch.core.stats.cache import StatsCache
from nanwatch.core.stats.compiled import (
    Sink,
    frame_key,
    frame_template,
    marker_key,
    measurements,
    record_call,
    record_marker,
)
from nanwatch.core.torch_glue.compiler import (
    forget_compiled_code,
    nested_code,
    run_outside_dynamo,
    stale_compiled_code,
    with_compiled_code,
)
from nanwatch.core.torch_glue.hooks import HookSet, module_class_name, reshards_after_forward
from nanwatch.core.walk import (
    INPUT,
    KEYWORD_PLAIN,
    OUTPUT,
    OUTPUT_LABEL,
    input_label,
    item_label,
    keyword_label,
    note,
    value_leaves,
)
from nanwatch.errors import NanwatchError

__all__ = ["MAX_PENDING_FRAMES", "Recorder", "hook_code", "own_code"]

_PARAMETER, _INPUT, _OUTPUT = Role.PARAMETER, Role.INPUT, Role.OUTPUT
_FORWARD = Direction.FORWARD
_ROLES = {role.value: role for role in Role}
_PLAIN_PARAMETERS = (torch.nn.Parameter, torch.Tensor)
_is_compiling = torch.compiler.is_compiling

FrameHandler = Callable[[Frame, torch.nn.Module, tuple[Any, ...], Any], None]


def _nothing() -> None:
    """What a recorder does with too many pending frames until a checker takes them."""


class Recorder:
    """Makes frames and keeps them pending until the next check.

    Args:
        counters: where the run is (the phase and micro-batch a frame belongs to).
        cache: launches the statistics (no host read) and remembers what it measured this batch.
        show_recomputes: record the forwards activation checkpointing runs again during backward (watch_gradients).
        trace: called with each frame (and its module, inputs, output) while the batch is traced.
        disable: stops watching (the run goes on) after a failure in recording.
    """

    def __init__(
        self,
        counters: Counters,
        cache: StatsCache,
        *,
        show_recomputes: bool,
        trace: FrameHandler,
        disable: Callable[[str], None],
    ) -> None:
        # The pending frames as they are (those of deferred calls are read once `settle` measured them): `pending`.
        self.unsettled: list[Any] = []
        self._deferral = Deferral(counters, cache)
        self.recording = True  # False in an unwatched batch or phase, or once watching is disabled: hooks return
        self.tracing = False
        self.hooked = False  # hooks were put on modules once (full mode), whether or not they are still there
        self.modules: dict[str, torch.nn.Module] = {}  # the watched modules by name, for traced compiled frames
        self._counters = counters
        self._cache = cache
        self.show_recomputes = show_recomputes
        self._trace = trace
        # Called when the pending frames pass `max_pending`: the checker that checks them sets it (`Checker`).
        self.when_full: Callable[[], None] = _nothing
        # The bound on the pending frames, read by `append` and by the modules' hooks alike: one value per recorder.
        self.max_pending = MAX_PENDING_FRAMES
        self.disable = disable
        # Under torch.compile the hooks' records arrive here as the graph runs (`_take_compiled`).
        self.sink = Sink(self._take_compiled)
        self._outside: list[Callable[[], Any]] = []  # adapter hooks run from inside a graph (`outside_graph`)

    @property
    def pending(self) -> list[Frame]:
        """The frames recorded since the last check, in the order of the calls (the deferred calls' outputs measured
        now)."""
        if self._deferral.waiting:
            self._deferral.settle(self.unsettled)
        return self.unsettled

    @pending.setter
    def pending(self, frames: list[Frame]) -> None:
        self.unsettled = frames
        self._deferral.forget()

    @property
    def settled(self) -> Settled:
        """What the pending frames made from deferred calls hold, for the check's screen."""
        return self._deferral.settled

    def drop_pending(self) -> None:
        """Forget what is pending without reading it (watching stops, or the watch ends)."""
        self.unsettled = []
        self._deferral.forget(probes=True)

    def append(
        self, frame: Frame, module: torch.nn.Module | None, args: tuple[Any, ...] = (), output: Any = None
    ) -> None:
        """The one way a frame joins the pending frames. A frame of no module (the loss, `Watcher.watch_loss`) is not
        traced: a trace shows module calls."""
        pending = self.unsettled
        pending.append(frame)
        if self.tracing and module is not None:
            self._trace(frame, module, args, output)
        if len(pending) > self.max_pending:
            self.when_full()

    def is_last(self, frame: Frame) -> bool:
        """True when `frame` is the latest pending frame (asked without making the deferred calls' frames)."""
        pending = self.unsettled
        return bool(pending) and pending[-1] is frame

    def take_pending(self) -> list[Frame]:
        """The pending frames, handed over to a check (none are pending after)."""
        pending = self.pending
        self.unsettled = []
        self._deferral.forget()
        return pending

    def frame(self, module_name: str, class_name: str, entries: list[Entry], direction: Direction = _FORWARD) -> Frame:
        """A frame of the current micro-batch."""
        batch, phase = self._counters.stamp
        return RecordedFrame(module_name, class_name, batch, phase, entries, direction)

    def hook(
        self,
        selected: list[tuple[str, torch.nn.Module]],
        hooks: HookSet,
        *,
        forget_stale: bool,
        info: Callable[[str], None],
    ) -> None:
        """A forward hook on each of the `(name, module)` pairs in `selected`, its handle kept in `hooks`; their
        parameters tracked (measured together once per batch, rather than one launch per parameter)."""
        for name, module in selected:
            # On a module FSDP2 manages, before FSDP's own forward hook frees the gathered parameters; keyword inputs
            # are inputs too (`model(**batch)`).
            hook = self.make_hook(name, module_class_name(module))
            hooks.add_forward(module, hook, with_kwargs=True, prepend=reshards_after_forward(module))
            self.modules.setdefault(name, module)
        self._cache.track_parameters(p for _, m in selected for p in m._parameters.values() if p is not None)
        self._deferral.hooked([module for _, module in selected])
        if forget_stale:
            self.forget_stale_compiled_code([module for _, module in selected], info, warn)
        self.hooked = bool(selected)

    def close(self) -> None:
        self._deferral.close()
        self.sink.close()
        self.modules.clear()
        self._outside.clear()

    # ----------------------------------------------------------------------------------------- the hot path

    def make_hook(self, name: str, class_name: str) -> Any:
        """The forward hook (with keyword inputs) that records `name`'s calls (core/engine/recording/module_hook.py)."""
        site = self._deferral.site(name, class_name)
        hook = ModuleHook(self, self._deferral, site, frame_key(self.sink.token, name, class_name), self._cache.kernels)
        return hook.forward_hook

    def record(
        self,
        site: Site,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        direction: Direction,
    ) -> None:
        # Runs after every module's forward, right after heavy kernels have flushed the CPU caches, where each
        # Python operation costs several times what it costs in isolation: keep the work per call minimal. No
        # `torch.no_grad()` here: measuring works on detached tensors, so it never builds a graph anyway.
        cache = self._cache
        params = module._parameters
        known = site.lines
        entries = known.lines(params, cache) if params else []
        activation = cache.activation
        # Whose tensors these are, for the cache's pool (an accelerator's: core/stats/pooled.py); a recompute's are
        # measured as they are seen.
        cache.owner = site if direction is _FORWARD else None
        try:
            # The labels of core/walk.py, with fast paths for a tensor and a flat tuple (`_add_leaves`).
            for index, value in enumerate(args):
                if isinstance(value, torch.Tensor):
                    entries.append(Entry(input_label(index), _INPUT, activation(value)))
                else:
                    self._add_leaves(entries, value, input_label(index), INPUT)
            if kwargs:
                self._add_keyword_inputs(entries, kwargs)
            if isinstance(output, torch.Tensor):
                entries.append(Entry(OUTPUT_LABEL, _OUTPUT, activation(output)))
            else:
                self._add_leaves(entries, output, OUTPUT_LABEL, OUTPUT)
        finally:
            cache.owner = None
        batch, phase = self._counters.stamp
        self.append(RecordedFrame(site.name, site.class_name, batch, phase, entries, direction), module, args, output)
        if not site.probed and direction is _FORWARD:
            self._deferral.probe(site, params, args, kwargs, output)

    def judge_probes(self) -> None:
        """At a check: the modules whose probed outputs nothing changed in place since are deferred from now on (and,
        on CUDA, their tensors pooled)."""
        self._deferral.judge_probes()
        self._cache.judge_pool_probes()

    def settle(self) -> None:
        """Measure the outputs of the deferred calls, whose frames wait in the pending list."""
        self._deferral.settle(self.unsettled)

    def record_loss(self, loss: torch.Tensor) -> None:
        """A loss computed outside the watched modules, as a frame of its own (module `(loss)`, not traced)."""
        with torch.no_grad():
            entry = Entry("loss", Role.LOSS, self._cache.measure(loss))
        self.append(self.frame("(loss)", type(loss).__name__, [entry]), None)

    def _add_keyword_inputs(self, entries: list[Entry], kwargs: dict[str, Any]) -> None:
        """Keyword inputs, labelled `input.<name>`: their tensors only (None, flags and sizes get no line, so a
        frame has the lines transformers' tool prints, and the keyword tensors after them)."""
        activation = self._cache.activation
        for keyword, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                entries.append(Entry(keyword_label(keyword), _INPUT, activation(value)))
            elif not isinstance(value, KEYWORD_PLAIN):
                for label, _, leaf, _ in value_leaves(value, keyword_label(keyword), INPUT, notes=False):
                    if isinstance(leaf, torch.Tensor):
                        entries.append(Entry(label, _INPUT, activation(leaf)))

    def _add_leaves(self, entries: list[Entry], value: Any, label: str, role: str) -> None:
        activation = self._cache.activation
        kind = _ROLES[role]
        if type(value) is tuple and len(value) <= 16:
            # The common case (attention blocks return `(hidden, None)`): a flat tuple of tensors and Nones needs
            # no walk. Anything else in it, and the whole value is walked as usual (the same labels).
            flat = []
            for index, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    flat.append(Entry(item_label(label, index), kind, activation(item)))
                elif item is None:
                    flat.append(Entry(item_label(label, index), kind, note=note(None)))
                else:
                    break
            else:
                entries.extend(flat)
                return
        for leaf_label, _, leaf, _ in value_leaves(value, label, role, notes=True):
            if isinstance(leaf, torch.Tensor):
                entries.append(Entry(leaf_label, kind, activation(leaf)))
            else:
                entries.append(Entry(leaf_label, kind, note=note(leaf)))

    def outside_graph(
        self, module: torch.nn.Module, hook: Callable[..., Any], *placeholders: Any
    ) -> Callable[..., Any]:
        """An adapter's `hook` on `module` (bookkeeping, no code for a graph), as a hook a compiled graph does not
        trace: dynamo puts one call of nanwatch's operator in its place, and the hook runs, outside the graph, when
        the graph gets there (given `placeholders` for the arguments after the module, which the graph does not
        hand over). A torch.nn container compiled whole (`torch.compile(nn.Sequential(...))`) traces its hooks; the
        root of a user's model runs them as frames of their own, which dynamo compiles too."""
        key = marker_key(self.sink.token, len(self._outside))
        self._outside.append(lambda: hook(module, *placeholders))

        def outside(called: torch.nn.Module, *args: Any) -> Any:
            if _is_compiling():
                record_marker(key)
                return None
            return hook(called, *args)

        return outside

    def _take_compiled(self, key: str, values: list[torch.Tensor], sizes: list[int]) -> None:
        """A record of a hook call inside a compiled graph, handed over as the graph runs (core/stats/compiled.py):
        the frame the eager hook would have made, or an adapter hook noted there (`outside_graph`)."""
        template = frame_template(key)
        if template.marker is not None:
            self._outside[template.marker]()  # an adapter's own hook: its errors are the adapter's, as in eager mode
            return
        if not self.recording:  # stopped (disabled, an unwatched batch) since the graph began
            return
        try:
            entries = []
            for leaf, found in zip(template.leaves, measurements(template, values, sizes), strict=True):
                if isinstance(found, str):
                    entries.append(Entry(leaf.label, _ROLES[leaf.role], note=found))
                else:
                    entries.append(Entry(leaf.label, _ROLES[leaf.role], found))
            frame = self.frame(template.module_name, template.class_name, entries)
            self.append(frame, self.modules[frame.module_name])
        except NanwatchError:
            raise
        except Exception as error:  # our bookkeeping must never kill a healthy run
            self.disable(f"recording {template.module_name or template.class_name} (compiled) failed: {error!r}")

    # ------------------------------------------------------------------------------------------ compiled code

    def forget_stale_compiled_code(
        self, modules: list[torch.nn.Module], info: Callable[[str], None], warn: Callable[[str], None]
    ) -> None:
        """Compiled code made before these hooks existed would run without them (dynamo does not guard on hooks
        added later), and record nothing: drop it, so the next call compiles again with the hooks in."""
        forget_compiled_code(with_compiled_code(own_code()))  # an earlier watcher's, compiled as frames of their own
        run_outside_dynamo(hook_code())
        stale = stale_compiled_code(modules)
        if not stale:
            return
        # Dynamo may reuse code compiled for another module of the same class (its guards need not name the module),
        # so whichever module it was made for, it goes: at worst a recompilation.
        if forget_compiled_code(stale):
            info(
                "nanwatch: compiled code (torch.compile) of these modules' forwards existed before watching began; "
                "it runs no hook added later, so nanwatch dropped it: the next compiled call compiles again, with "
                "the hooks in"
            )
        else:
            warn(
                "nanwatch: the model had run compiled (torch.compile) before watching began, and this torch cannot "
                "drop that compiled code: it will record nothing. Call torch._dynamo.reset() after starting to "
                "watch, or start watching before the first compiled call."
            )


def hook_code() -> list[types.CodeType]:
    """The code of nanwatch's module hooks, which a compiled root's `_call_impl` calls outside its `forward`."""
    return [ModuleHook.forward_hook.__code__, *nested_code(Recorder.outside_graph)]


def own_code() -> list[types.CodeType]:
    """nanwatch's code that dynamo may have compiled as frames of their own: the hooks and what they call."""
    return [*hook_code(), record_call.__code__, record_marker.__code__]
