"""Deferred recording: the recorder's common call made into a frame at the check instead of as it returns.

On a model of many small modules a watched call costs what its Python costs, and most of that was building the frame
(its lines, the measurement objects) and copying the output aside. A call with one tensor in and one small
floating-point tensor out (no keywords) is deferred instead once its module has earned it: the hook keeps the
output and its version counter in the pending list, where its frame will go, and `settle` makes every such frame at
once when the frames are next read (the check), their outputs measured in one stack per dtype, shape and device.

What a frame says does not change. A module's first recorded batch runs as before and is probed (`Site`): each
eligible call's output and version counter are noted, and at the check a module whose outputs nothing changed in
place since their calls is deferred from then on; one whose output was changed (a `ReLU(inplace=True)` after it,
`x += y` in its caller), whose parameters changed within the batch, or that had a call that could not be deferred,
never is. The version counter is what tells: a deferred output whose counter moved by the check (a change that began
later) is measured as it is then, and its module is recorded as it returns from then on. The input is the previous
deferred call's output when it is that tensor unchanged (a chain of modules), else measured at the call as before.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from nanwatch.core.engine.counters import Counters
from nanwatch.core.engine.parameter_lines import ParameterLines
from nanwatch.core.frames import Direction, Entry, Frame, Role
from nanwatch.core.stats.cache import StatsCache
from nanwatch.core.stats.measure import Measurement, StackedMeasurement
from nanwatch.core.stats.staging import STAGE_MAX_NUMEL, Rows
from nanwatch.core.walk import OUTPUT_LABEL, input_label

__all__ = ["Deferral", "Settled", "Site", "deferrable"]

# Deferred outputs are kept alive until their frames are made: at most this many elements in all (16 MiB of float32)
# between two settlements; past it, calls are recorded as they return.
MAX_DEFERRED_ELEMENTS = 1 << 22
_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))
_Tensor = torch.Tensor
_INPUT, _OUTPUT, _FORWARD = Role.INPUT, Role.OUTPUT, Direction.FORWARD
_INPUT_0 = input_label(0)


class Site:
    """What the recorder has learned of one watched module's calls: whether they may be deferred."""

    __slots__ = ("defer", "probed", "changed", "checked")

    def __init__(self) -> None:
        self.defer = False  # its calls may be deferred
        self.probed = False  # its first recorded batch was judged (or a call showed it never can be)
        self.changed = False  # an output was changed in place after its call, or a parameter within a batch: never
        # The parameters' batch measurements this module's deferred calls last checked the fingerprints against: they
        # are checked at its first deferred call of each batch.
        self.checked: object = None


class Settled:
    """What the pending frames made from deferred calls hold, so that the check's screen need not read them line by
    line: the stacks their outputs were measured in (every row belongs to one of those frames), their modules'
    parameter measurements (once per module), and the inputs measured at the call."""

    __slots__ = ("frames", "stacks", "parameters", "inputs", "sites")

    def __init__(self) -> None:
        self.frames: set[int] = set()  # ids of the frames made
        self.stacks: list[tuple[Rows, torch.dtype]] = []
        self.parameters: list[Measurement] = []
        self.inputs: list[Measurement] = []
        self.sites: set[Site] = set()


def deferrable(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> bool:
    """One plain tensor in, one plain floating-point tensor out, no keywords, neither an inference tensor (no version
    counter to tell a change by)."""
    return (
        not kwargs
        and len(args) == 1
        and type(args[0]) is _Tensor
        and type(output) is _Tensor
        and output.dtype in _DTYPES
        and not output.is_inference()
        and not args[0].is_inference()
    )


# A deferred call, kept in the pending list where its frame will go: the site, the frame's names and counters, the
# parameter lines, the input (a Measurement made at the call, or the deferred call whose output it is), the output
# (or the deferred call whose output it is) and its version counter at the call.
DeferredCall = tuple[Site, str, str, int, str, list[Entry], Any, Any, int]


class Deferral:
    """The deferred calls of one recorder: kept by `defer`, made into frames by `settle`."""

    def __init__(self, counters: Counters, cache: StatsCache) -> None:
        self._counters = counters
        self._cache = cache
        self._thread = threading.get_ident()  # calls are deferred on this thread only (not DataParallel's replicas)
        self.probes: list[tuple[Site, torch.Tensor, int]] = []  # calls of modules in their first recorded batch
        self.count = 0  # deferred calls pending
        self.settled = Settled()
        self._elements = 0
        self._last_output: torch.Tensor | None = None  # the latest deferred call's own output, its version, the call
        self._last_version = -1
        self._last_call: DeferredCall | None = None

    def forget(self, *, probes: bool = False) -> None:
        """The pending list was taken or dropped: nothing deferred is pending (nor probed, with `probes`)."""
        self.count = self._elements = 0
        self._last_output, self._last_call, self._last_version = None, None, -1
        self.settled = Settled()
        if probes:
            self.probes = []

    def judge_probes(self) -> None:
        """At a check: the modules whose probed outputs nothing changed in place since their calls are deferred from
        now on; those with one that was changed never are."""
        probes, self.probes = self.probes, []
        for site, output, version in probes:
            site.probed = True
            if output._version != version:
                site.changed, site.defer = True, False
            elif not site.changed:
                site.defer = True

    def defer(
        self,
        pending: list[Any],
        site: Site,
        name: str,
        class_name: str,
        module: torch.nn.Module,
        arg: Any,
        output: Any,
        known: ParameterLines,
    ) -> bool:
        """Keep a call whose frame can be made later: True when kept, False when it must be recorded now."""
        if type(output) is not _Tensor or type(arg) is not _Tensor or output.is_inference():
            return False
        numel = output.numel()
        elements = self._elements + numel
        if numel > STAGE_MAX_NUMEL or elements > MAX_DEFERRED_ELEMENTS or output.dtype not in _DTYPES:
            return False
        if threading.get_ident() != self._thread:
            return False
        cache = self._cache
        params = module._parameters
        if not params:
            lines = []
        elif known.batch is not None and site.checked is known.batch and known.batch is cache.tracked_batch():
            lines = known.entries.copy()
        else:
            lines = known.lines(params, cache)
            site.checked = known.batch
            if not known.stable:  # changed since measured (or not tracked): recorded as it returns from now on
                site.defer, site.changed = False, True
        version = output._version
        last = self._last_output
        source: Any = self._last_call if arg is last and arg._version == self._last_version else cache.activation(arg)
        counters = self._counters
        phase = counters.phase
        batch = counters.batch_number if phase == "train" else counters.eval_batch_number
        if output is last and version == self._last_version:  # a container returning its last child's output
            pending.append((site, name, class_name, batch, phase, lines, source, self._last_call, version))
        else:
            call = (site, name, class_name, batch, phase, lines, source, output, version)
            pending.append(call)
            self._last_output, self._last_version, self._last_call = output, version, call
            self._elements = elements
        self.count += 1
        return True

    def settle(self, pending: list[Any]) -> None:
        """Make the frames of the deferred calls, where they wait in `pending`: their outputs measured together, each
        input sharing the measurement of the output it is."""
        if not self.count:
            return
        self.count = self._elements = 0
        self._last_output, self._last_call, self._last_version = None, None, -1
        places, stacks = self._measure_outputs(pending)
        settled = self.settled
        made: dict[int, Measurement] = {}
        place = iter(places)
        sites, made_frames = settled.sites, settled.frames
        for index, item in enumerate(pending):
            if type(item) is not tuple:
                continue
            site, name, class_name, batch, phase, lines, source, output, _ = item
            if site not in sites:  # its parameter lines: the same measurements at each of its calls of a batch
                sites.add(site)
                settled.parameters += [entry.measurement for entry in lines if entry.measurement is not None]
            if type(output) is tuple:
                measurement = made[id(output)]
            else:
                group, row = next(place)
                found, dtype, shape = stacks[id(group)]
                measurement = StackedMeasurement(found, row, dtype, shape)
            made[id(item)] = measurement
            if type(source) is tuple:
                source = made[id(source)]
            else:
                settled.inputs.append(source)
            lines.append(Entry(_INPUT_0, _INPUT, source))
            lines.append(Entry(OUTPUT_LABEL, _OUTPUT, measurement))
            frame = pending[index] = Frame(name, class_name, batch, phase, lines, _FORWARD)
            made_frames.add(id(frame))

    def _measure_outputs(
        self, pending: list[Any]
    ) -> tuple[list[tuple[list[torch.Tensor], int]], dict[int, tuple[Rows, torch.dtype, tuple[int, ...]]]]:
        """Every deferred call's own output, measured in one stack per dtype, shape and device: where each went (its
        group and row, in the calls' order), and each group's rows with the dtype and shape its tensors had."""
        groups: dict[tuple[torch.dtype, torch.Size, torch.device], list[torch.Tensor]] = {}
        places: list[tuple[list[torch.Tensor], int]] = []
        for item in pending:
            if type(item) is not tuple or type(item[7]) is tuple:  # a frame, or an output measured with another
                continue
            output = item[7]
            if output._version != item[8]:  # changed in place since the call: measured as it is now, and its
                item[0].defer, item[0].changed = False, True  # module recorded as it returns from now on
            key = (output.dtype, output.shape, output.device)
            group = groups.get(key)
            if group is None:
                group = groups[key] = []
            places.append((group, len(group)))
            group.append(output)
        stacks: dict[int, tuple[Rows, torch.dtype, tuple[int, ...]]] = {}
        with torch.no_grad():
            for (dtype, size, _), group in groups.items():
                # One row per output: its abs min and max (min and max are exact however grouped; nan propagates).
                values = torch.stack(group).abs_().view(len(group), -1)
                found = Rows(values.amin(1), values.amax(1))
                stacks[id(group)] = (found, dtype, tuple(size))
                self.settled.stacks.append((found, dtype))
        return places, stacks
