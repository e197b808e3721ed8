"""Deferred recording: the recorder's common call measured at the check instead of as it returns.

On a model of many small modules a watched call costs what its Python costs, and most of that was building the frame
(its lines, the measurement objects) and copying the output aside. A call with one tensor in and one small
floating-point tensor out (no keywords) is deferred instead once its module has earned it: the hook puts a
`DeferredFrame` in the pending list (a record of what the call used), and keeps the output and its version counter
with the round's other deferred outputs (`DeferredOutputs`); `settle` measures them all at once when the frames are
next read (the check), in one stack (one per dtype, shape and device where they differ). The frame makes its lines
only when something reads them: the check reads the stacks whole, and of a clean batch only the ring's last few
frames are ever shown.

What a frame says does not change. A module's first recorded batch runs as before and is probed (`Site`): each
eligible call's output and version counter are noted, and at the check a module whose outputs nothing changed in
place since their calls is deferred from then on; one whose output was changed (a `ReLU(inplace=True)` after it,
`x += y` in its caller), whose parameters changed within the batch, or that had a call that could not be deferred,
never is. The version counter is what tells: a deferred output whose counter moved by the check (a change that began
later, such as a caller's `masked_fill_` on padded batches only) is not measured, since its values are no longer
what the call returned: its line says it was changed in place after the call, the check neither screens nor blames
it, and its module is recorded as it returns (measured at the call) from then on. The input is the previous
deferred call's output when it is that tensor unchanged (a chain of modules), else measured at the call as before.
A deferred module's lines name its parameters' batch measurement (made at the batch's first call). Its first
recorded batch shows that the measurement is what its call used (not weights gathered for the call, as FSDP and
ZeRO-3 do, nor changed since the batch began). After that the parameters are checked all at once, at the check: a
measurement kept from an earlier batch (evaluation) is checked whole before it is named again, and one whose
parameters changed by the check (an optimizer step the check follows, or a forward that began changing them) cannot
say whether that was before a call or after, so from then on each module's parameters are checked at each of its
calls, as they are for a recorded module. A parameter put on any module (`module.weight = Parameter(...)`)
does the same at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils.hooks import RemovableHandle

from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.recording.deferred_frames import (
    DEFERRED_DTYPES,
    DeferredFrame,
    DeferredOutputs,
    ModuleParameters,
    Settled,
)
from nanwatch.core.engine.recording.parameter_lines import ParameterLines, ParameterRow
from nanwatch.core.stats.cache import StatsCache, TrackedBatch
from nanwatch.core.stats.output_rows import STAGE_MAX_NUMEL

__all__ = ["Deferral", "Site", "deferrable"]

# Deferred outputs are kept alive until they are measured (the check): at most this many elements in all (16 MiB of
# float32) between two settlements; past it, calls are recorded as they return.
MAX_DEFERRED_ELEMENTS = 1 << 22
_Tensor = torch.Tensor
_NO_PARAMETERS: list[ParameterRow] = []  # shared by every deferred call of a module without parameters (read only)
_get_ident = threading.get_ident


class Site:
    """One watched module, as the recorder knows it: its names, its parameter lines, and whether its calls may be
    deferred."""

    __slots__ = ("name", "class_name", "lines", "defer", "probed", "changed", "screened", "pooled", "pool_judged")

    def __init__(self, name: str, class_name: str) -> None:
        self.name, self.class_name = name, class_name
        self.lines = ParameterLines()  # its parameter lines, made once per batch for the calls recorded as they return
        self.defer = False  # its calls may be deferred
        self.probed = False  # its first recorded batch was judged (or a call showed it never can be)
        self.changed = False  # an output was changed in place after its call, or a parameter within a batch: never
        # The settlement and batch measurement (`Deferral._screen_key`) whose screen already holds its parameters:
        # once per module.
        self.screened: object = None
        # On an accelerator: its calls' tensors are kept and measured together at the check (core/stats/pooled.py),
        # once its first recorded batch showed nothing changed them in place after its calls (`pool_judged`).
        self.pooled = False
        self.pool_judged = False


class Probe(NamedTuple):
    """An eligible call of a module in its first recorded batch: its output and the output's version counter then."""

    site: Site
    output: torch.Tensor
    version: int


def _heard_by(deferral: weakref.ref[Deferral]) -> Callable[[torch.nn.Module, str, torch.Tensor], None]:
    """torch's parameter-registration hook for `deferral`, holding it weakly: the hook is the whole process's, and a
    watcher nobody closed must not live on through it (nor the weights its cache tracks)."""

    def registered(module: torch.nn.Module, name: str, param: torch.Tensor) -> None:
        found = deferral()
        if found is not None:
            found.parameter_registered(module, name, param)

    return registered


def deferrable(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> bool:
    """One plain tensor in, one plain floating-point tensor out (strided, with values: not sparse, nested, meta or
    empty, which a stack cannot measure), no keywords, neither an inference tensor (no version counter to tell a
    change by)."""
    return (
        not kwargs
        and len(args) == 1
        and type(args[0]) is _Tensor
        and type(output) is _Tensor
        and output.dtype in DEFERRED_DTYPES
        and output.layout is torch.strided
        and not output.is_nested
        and not output.is_meta
        and output.numel() > 0
        and not output.is_inference()
        and not args[0].is_inference()
    )


class Deferral:
    """The deferred calls of one recorder: kept by `defer` (their frames made then, their lines later), their outputs
    measured by `settle`."""

    __slots__ = (
        "__weakref__",
        "_counters",
        "_cache",
        "_thread",
        "probes",
        "parameter_sites",
        "check_each_call",
        "_registrations",
        "_sites",
        "_current",
        "_measured_then",
        "settled",
        "_outputs",
        "_batches",
        "_screen_key",
        "_screened_for",
        "_elements",
    )

    def __init__(self, counters: Counters, cache: StatsCache) -> None:
        self._counters = counters
        self._cache = cache
        self._thread = _get_ident()  # calls are deferred on this thread only (not DataParallel's replicas)
        self.probes: list[Probe] = []  # calls of modules in their first recorded batch
        self.parameter_sites = 0  # watched modules with parameters (`Settled`)
        # Whether a deferred module's parameters are checked at each of its calls, rather than all at once when the
        # calls are settled (see the module's docstring): from the first time a check could not tell.
        self.check_each_call = False
        self._registrations: RemovableHandle | None = None  # the hook that hears of parameters put on modules
        self._sites: list[Site] = []  # every site made (`site`); the frames of deferred calls name theirs
        # The parameters' batch measurement found current since the calls were last settled (or dropped), and how
        # many the cache had made by then: one made before is checked whole before it is named again (`_renew`).
        self._current: TrackedBatch | None = None
        self._measured_then = -1
        self.settled = Settled()
        self._outputs = DeferredOutputs()  # this round's (since the last settlement)
        self._batches: list[TrackedBatch] = []  # the parameters' batch measurements this round's lines name
        # What a module's `screened` is when its parameters are in `settled.parameters`: new with each `settled`
        # and each batch measurement (`_screened_for`).
        self._screen_key = object()
        self._screened_for: TrackedBatch | None = None
        self._elements = 0  # of the outputs kept this round

    def forget(self, *, probes: bool = False) -> None:
        """The pending list was taken or dropped: nothing deferred is pending (nor probed, with `probes`)."""
        self._new_round()
        self.settled = Settled(self.parameter_sites)
        self._screen_key, self._screened_for = object(), None
        self._current, self._measured_then = None, self._cache.batches_measured
        if probes:
            self.probes = []

    def hooked(self, modules: list[torch.nn.Module]) -> None:
        """The recorder put its hooks on `modules`: how many have parameters, and from now on, a parameter put on any
        module turns on the per-call check (`parameter_registered`)."""
        count = sum(1 for module in modules if any(p is not None for p in module._parameters.values()))
        self.parameter_sites = self.settled.parameter_sites = count
        if self._registrations is None:
            self._registrations = register_module_parameter_registration_hook(_heard_by(weakref.ref(self)))

    def site(self, name: str, class_name: str) -> Site:
        """The site of a module about to be hooked."""
        site = Site(name, class_name)
        self._sites.append(site)
        return site

    def close(self) -> None:
        """Watching ended: the hook on parameter registration goes, and the sites' parameter lines (the ring's frames
        name their sites, and a closed watcher keeps nothing of the model)."""
        if self._registrations is not None:
            self._registrations.remove()
            self._registrations = None
        for site in self._sites:
            site.lines = ParameterLines()
        self._sites = []

    def probe(
        self, site: Site, params: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        """A recorded call of a module's first recorded batch: noted if the module's later calls could be deferred.
        Its parameters must be what the batch measured, as they are at the call: not weights gathered for the call
        (FSDP, ZeRO-3) nor changed since the batch began."""
        lines = site.lines
        tracked = self._cache.tracked_batch() if params else None
        if params and not (lines.stable and tracked is not None and lines.unchanged(params, tracked)):
            site.probed = site.changed = True  # never deferred, whatever its other calls
        elif not self._cache.kernels and deferrable(args, kwargs, output):
            self.probes.append(Probe(site, output, output._version))
        else:  # a call that could not be deferred, or parameters measured apart at it: never deferred
            site.probed = True

    def _renew(self) -> TrackedBatch | None:
        """The first deferred call with parameters since the calls were last settled (or since the batch measurement
        changed): the measurement, made now if it was not yet. One made before the last settlement (evaluation keeps
        one across micro-batches) is checked whole first, and made again if a parameter changed since
        (`model.to(...)`, weights loaded between evaluation batches)."""
        tracked = self._cache.tracked_batch()
        if (
            tracked is not None
            and self._cache.batches_measured == self._measured_then
            and not self._cache.unchanged(tracked)
        ):
            self._cache.forget_parameters()
            tracked = self._cache.tracked_batch()
        self._current = tracked
        if tracked is not None:
            self._batches.append(tracked)
            if tracked is not self._screened_for:  # a new key: each module's parameters are screened again
                self._screen_key, self._screened_for = object(), tracked
                self.settled.batches.append(tracked)
        return tracked

    def parameter_registered(self, module: torch.nn.Module, name: str, param: torch.Tensor) -> None:
        """A parameter was put on a module (`module.weight = Parameter(...)`, pruning, weight tying): one a deferred
        module's lines name may be gone, so each module's parameters are checked at its calls from now on."""
        self.check_each_call = True

    def judge_probes(self) -> None:
        """At a check: the modules whose probed outputs nothing changed in place since their calls are deferred from
        now on; those with one that was changed never are."""
        probes, self.probes = self.probes, []
        for probe in probes:
            site = probe.site
            site.probed = True
            if probe.output._version != probe.version:
                site.changed, site.defer, site.pooled = True, False, False
            elif not site.changed:
                site.defer = True

    def defer(self, pending: list[Any], site: Site, module: torch.nn.Module, arg: Any, output: Any) -> bool:
        """Keep a call whose lines can be made later: its frame joins `pending`. True when kept, False when it must be
        recorded now."""
        # The hot path, run at every module call of a long run: every check that can be left to `settle` is, and
        # what is left is a few attribute reads (each line here costs a few percent of the call).
        if type(output) is not _Tensor:
            return False
        numel = output.numel()
        elements = self._elements + numel
        outputs = self._outputs
        if (
            numel > STAGE_MAX_NUMEL
            or elements > MAX_DEFERRED_ELEMENTS
            or (output.dtype is not outputs.dtype and not outputs.admits(output.dtype))
            or _get_ident() != self._thread
        ):
            return False
        try:
            version = output._version
        except RuntimeError:  # an inference tensor keeps no version counter to tell a later change by
            return False
        kept, versions = outputs.tensors, outputs.versions
        input_row = -1
        if kept and arg is kept[-1] and arg._version == versions[-1]:  # the output of the deferred call before
            input_row = len(kept) - 1
        elif type(arg) is not _Tensor:
            return False
        params = module._parameters
        if params:
            tracked = self._cache.measured_batch
            if tracked is not self._current or tracked is None:
                tracked = self._renew()
            lines = site.lines
            if tracked is None or self.check_each_call:  # checked at the call: unchanged since measured?
                if tracked is None or lines.remade or not lines.unchanged(params, tracked):
                    site.defer, site.changed = False, True  # recorded as it returns from now on
                    return False
            elif not lines.holds(params):
                # Other tensors than the module's own in its parameter dict for this call (`functional_call`,
                # `stateless` swaps): the batch measurement is not what the call used. Recorded as it returns, with the
                # tensors it used, from now on.
                site.defer, site.changed = False, True
                return False
            named = lines.named
            if site.screened is not self._screen_key:  # the screen reads its parameters (once per module)
                site.screened = self._screen_key
                self.settled.parameters.append(ModuleParameters(tracked, named))
        else:
            tracked, named = None, _NO_PARAMETERS
        input_measured = None
        if input_row < 0:
            cache = self._cache
            cache.owner = site  # the module's, for the cache's pool (an accelerator's: core/stats/pooled.py)
            try:
                input_measured = cache.activation(arg)
            finally:
                cache.owner = None
            self.settled.inputs.append(input_measured)
        if kept and output is kept[-1] and version == versions[-1]:  # a container returning its last child's output
            output_row = len(kept) - 1
        else:
            output_row = len(kept)
            kept.append(output)
            versions.append(version)
            self._elements = elements
        pending.append(
            DeferredFrame(site, self._counters.stamp, tracked, named, input_measured, input_row, output_row, outputs)
        )
        return True

    def settle(self, pending: list[Any]) -> None:
        """Measure the outputs deferred since the last settlement together (most often one stack) for the frames
        waiting in `pending`, whose lines are made when read."""
        if not self._outputs.tensors:
            return
        outputs, batches = self._outputs, self._batches
        self._new_round()
        changed = outputs.changed()
        if changed:  # changed in place since the call: not measured, and its module recorded as it returns from now
            self._stop_deferring(pending, outputs, set(changed))  # on
        self._check_parameters(batches)
        with torch.no_grad():
            self.settled.stacks += outputs.measure()

    @property
    def waiting(self) -> bool:
        """Whether calls were deferred since the last settlement."""
        return bool(self._outputs.tensors)

    def _new_round(self) -> None:
        self._elements = 0
        self._outputs, self._batches = DeferredOutputs(), []
        self._current = None

    @staticmethod
    def _stop_deferring(pending: list[Any], outputs: DeferredOutputs, changed: set[int]) -> None:
        """The modules of the deferred calls whose outputs (`changed`: their rows in `outputs`) were changed in place
        after the calls are recorded as they return from now on."""
        for frame in pending:
            if type(frame) is DeferredFrame and frame.outputs is outputs and frame.output_row in changed:
                site = frame.site
                if isinstance(site, Site):  # nor its tensors pooled (an accelerator's: core/stats/pooled.py)
                    site.defer, site.changed, site.pooled = False, True, False

    def _check_parameters(self, batches: list[TrackedBatch]) -> None:
        """After settling: the parameters the settled calls' lines name, checked all at once."""
        self._measured_then = self._cache.batches_measured
        if not self.check_each_call and not all(self._cache.unchanged(batch) for batch in batches):
            # A parameter changed since its batch measurement: before a deferred call (a forward that began changing
            # it), or after (an optimizer step the check follows)? No telling. These frames show the batch
            # measurement; from now on each module's parameters are checked at each of its calls.
            self.check_each_call = True
