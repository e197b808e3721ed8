"""Many tensors measured with multi-tensor kernels: the way on CUDA (paths.py), a few launches for any number.

`multi_tensor_range` measures a list of tensors of one device and dtype, whatever their shapes: `_foreach_abs`, a
`_foreach_max` (the abs maxima), `_foreach_neg_` and a second `_foreach_max` (the abs minima, negated, as integers),
two stacks and a negation. Seven ops however many tensors, where measuring each as it is seen takes two per tensor.
The numbers are those of `abs().aminmax()`: a min and a max are exact however grouped, and max propagates nan. The
parameters' batch measurement (`grouped.StackPlan`) and the deferred calls' outputs use it on CUDA (paths.py).

A `Pool` keeps the activations of watched calls instead of measuring them as they are seen (a reference, detached,
and the version counter then), and measures those of one device and dtype together the first time any of their
numbers is read, normally by the check (`PooledRows`). At most `POOL_MAX_ELEMENTS` elements are kept at a time: past
that, what is kept is measured at once (launched, not read) and let go, so the memory a pool holds beyond what the
run holds anyway (with the probes below: 16M elements together, 64 MiB of float32), and the temporaries of its
measurement, stay bounded.

A kept tensor changed in place before it was measured (its version counter moved: `masked_fill_` by the caller, a
`ReLU(inplace=True)` after it) is not measured: its values are no longer what the call returned. Its measurement says
so (`CHANGED_AFTER_CALL`), its row holds zeros (neither shown nor screened), and the owner that kept it (a watched
module) is told, so that from then on its tensors are measured as its calls return. An owner's tensors are pooled
only once its first recorded batch showed that nothing changed them after its calls (`Probes`, judged by the cache
at the check).

What no version counter sees, the probes see by the numbers: a write through `.data`, or a custom kernel writing into a
tensor it was given (a fused loss that stores its gradient in the logits), changes a probed tensor's abs min or max
between its call and the check, and its module is not pooled either. A kept tensor is a detached alias, so a caller's
`output.data = other` does not reach it. What is left unseen: such a silent write that begins only after a module was
judged (a `.data` write on some batches only) shows in its frame as if the call had returned it, as it does for the
deferred outputs (core/engine/recording/deferral.py). The bound counts what a kept tensor keeps alive: a view of a
larger tensor counts its whole storage.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from nanwatch.core.stats.kernels import _SAME_SIZE_INT, abs_aminmax
from nanwatch.core.stats.measure import Measurement
from nanwatch.core.stats.output_rows import Rows

__all__ = [
    "CHANGED_AFTER_CALL",
    "GROUP_MAX_ELEMENTS",
    "MULTI_TENSOR_DTYPES",
    "POOL_MAX_ELEMENTS",
    "WATCH_ENDED",
    "Pool",
    "PoolOwner",
    "PoolProbe",
    "PooledMeasurement",
    "PooledRows",
    "Probes",
    "multi_tensor_range",
]

# What a kept tensor's line says when it was changed in place after its call, before it was measured.
CHANGED_AFTER_CALL = "changed in place after the call: not measured"
# What it says when watching ended before the check measured it.
WATCH_ENDED = "not measured: watching ended first"
# The dtypes measured with multi-tensor kernels (their abs keeps the dtype, and `_foreach_max` has a kernel for each).
MULTI_TENSOR_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))
# A multi-tensor group holds at most this many elements (its temporaries: 64 MiB of float32).
GROUP_MAX_ELEMENTS = 1 << 24
# A pool's kept tensors and its probes hold at most this many elements together (64 MiB of float32); a larger tensor
# is measured as it is seen.
POOL_MAX_ELEMENTS = 1 << 24
_get_ident = threading.get_ident


def multi_tensor_range(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The abs min and max of each tensor (all of one device and dtype, plain, strided and non-empty), as two vectors,
    in seven device ops however many tensors. Raises RuntimeError where torch refuses (devices differ).

    The minima are reduced as integers: a magnitude's bits, read as a signed integer of its size, order as the
    magnitude does (nan above inf), and negated they never reach the integer's lowest value, where CUDA's
    `_foreach_max` starts (a float max starting at the lowest finite float would turn an all-inf tensor's minimum into
    that float). As with the CPU's integer reductions (kernels.py), a tensor holding nan gets a number for its minimum
    where a float min gives nan; its maximum is nan, and `AbsRange.read` makes the minimum nan as it is read."""
    count = len(tensors)
    dtype = tensors[0].dtype
    as_int = _SAME_SIZE_INT[dtype]
    with torch.no_grad():  # no graph, whatever requires grad
        magnitudes = torch._foreach_abs(list(tensors))
        highs = torch.stack(torch._foreach_max(magnitudes))  # from 0 up: CUDA's starting value is never the answer
        bits = [magnitude.view(as_int) for magnitude in magnitudes]
        torch._foreach_neg_(bits)  # the largest negated magnitude is the smallest magnitude, negated
        lows = torch.stack(torch._foreach_max(bits)).neg_().view(dtype)
    assert len(lows) == count
    return lows, highs


class PoolOwner(Protocol):
    """Who keeps tensors in a pool: a watched module (core/engine/recording/deferral.py's `Site`)."""

    pooled: bool  # its calls' tensors are kept in the pool (not measured as its calls return)
    pool_judged: bool  # its first recorded batch was judged (`Probes`): `pooled` is not decided again
    changed: bool  # a tensor of its calls was changed in place after the call: never pooled (nor deferred)


class PoolProbe(NamedTuple):
    """A tensor of an owner's first recorded batch and its measurement as the call returned: was it changed in place
    by the check? Held until then (a tensor changed and then let go was changed all the same), within the pool's
    bound."""

    tensor: torch.Tensor
    version: int
    owner: PoolOwner
    measured: Measurement


class Probes:
    """The probes of owners not judged yet, within the room their pool leaves them (`Pool.probe`): an owner with a
    tensor past it is not judged at this check, and is probed again in its next recorded batch."""

    def __init__(self) -> None:
        self._probes: list[PoolProbe] = []
        self._unfinished: set[int] = set()  # ids of owners with a tensor left out
        self.elements = 0

    def note(self, probe: PoolProbe, elements: int, room: int) -> None:
        if self.elements + elements > room:
            self._unfinished.add(id(probe.owner))
            return
        self.elements += elements
        self._probes.append(probe)

    def judge(self) -> None:
        """At a check: each owner probed whole has its tensors pooled from now on, unless one of them was changed
        since its call: in place (its version counter moved), or where no version counter sees it (a write through
        `.data`, a custom kernel writing into its input: its numbers now differ from those at the call; one host
        read, in a batch with probes only). The probes are let go."""
        probes, unfinished = self._probes, self._unfinished
        if not probes and not unfinished:  # every check of a long run, once its modules are judged
            return
        self.clear()
        refused = {id(probe.owner) for probe in probes if probe.tensor._version != probe.version}
        try:
            refused |= _silently_changed([probe for probe in probes if id(probe.owner) not in refused])
        except Exception:  # never a reason to stop watching: none of them pooled, each measured as it returns
            refused = {id(probe.owner) for probe in probes}
        for probe in probes:
            owner = probe.owner
            if not owner.pool_judged and id(owner) not in unfinished:
                owner.pool_judged = True
                owner.pooled = id(owner) not in refused and not owner.changed

    def clear(self) -> None:
        self._probes, self._unfinished, self.elements = [], set(), 0


def _silently_changed(probes: list[PoolProbe]) -> set[int]:
    """The owners of probed tensors whose abs min or max now differs from the measurement at the call (nan equal to
    nan), all compared on the device and read in one go."""
    groups: dict[tuple[torch.device, torch.dtype], list[PoolProbe]] = {}
    for probe in probes:
        measured = probe.measured
        if measured.abs_max is not None and measured.abs_max.is_floating_point():
            groups.setdefault((probe.tensor.device, probe.tensor.dtype), []).append(probe)
    verdicts: list[torch.Tensor] = []
    with torch.no_grad():
        for group in groups.values():
            lows, highs = multi_tensor_range([probe.tensor for probe in group])
            then_lows = torch.stack([_number(probe.measured.abs_min) for probe in group]).to(lows.dtype)
            then_highs = torch.stack([_number(probe.measured.abs_max) for probe in group]).to(highs.dtype)
            # A nan maximum makes the minimum's bits moot (kernels.py): compared as nan either way.
            same_highs = (highs == then_highs) | (highs.isnan() & then_highs.isnan())
            same_lows = (lows == then_lows) | highs.isnan()
            verdicts.append((same_highs & same_lows).cpu())
    if not verdicts:
        return set()
    same = torch.cat(verdicts).tolist()
    ordered = [probe for group in groups.values() for probe in group]
    return {id(probe.owner) for probe, kept in zip(ordered, same, strict=True) if not kept}


def _number(value: torch.Tensor | None) -> torch.Tensor:
    assert value is not None
    return value.reshape(())


class PooledRows(Rows):
    """The tensors of one device and dtype kept since the last measurement, measured together when any of their
    numbers is first read (`_settle`); then the rows are the vectors, and the tensors are let go."""

    __slots__ = ("_kept", "_versions", "_owners", "_changed", "failed")

    def __init__(self) -> None:
        super().__init__()
        self._kept: list[torch.Tensor] | None = []
        self._versions: list[int] = []
        self._owners: list[PoolOwner] = []
        self._changed: frozenset[int] = frozenset()
        self.failed: str | None = None  # why none of these was measured, when none could be

    @property
    def open(self) -> bool:
        """Tensors are kept here, not measured yet."""
        return self._kept is not None

    def add(self, tensor: torch.Tensor, version: int, owner: PoolOwner) -> int:
        kept = self._kept
        assert kept is not None, "a measured pool row written again"
        kept.append(tensor)
        self._versions.append(version)
        self._owners.append(owner)
        return len(kept) - 1

    def not_measured(self, row: int) -> str | None:
        """Why the tensor kept at `row` has no numbers (changed in place after its call, or none of the rows could be
        measured), or None."""
        if self._kept is not None:
            self._settle()
        if self.failed is not None:
            return self.failed
        return CHANGED_AFTER_CALL if row in self._changed else None

    def _settle(self) -> None:
        kept, versions, owners = self._kept, self._versions, self._owners
        assert kept is not None, "pooled rows measured twice"
        self._kept, self._versions, self._owners = None, [], []
        if [tensor._version for tensor in kept] != versions:
            changed = {row for row, tensor in enumerate(kept) if tensor._version != versions[row]}
            for row in changed:
                owner = owners[row]
                owner.pooled, owner.changed = False, True  # measured as its calls return from now on
                kept[row] = kept[row].new_zeros(())  # what the caller wrote later is neither shown nor screened
            self._changed = frozenset(changed)
        try:
            try:
                self._lows, self._highs = multi_tensor_range(kept)
            except (RuntimeError, NotImplementedError):  # each measured on its own, then
                ranges = [abs_aminmax(tensor) for tensor in kept]
                self._lows = torch.stack([low for low, _ in ranges])
                self._highs = torch.stack([high for _, high in ranges])
        except Exception as error:  # a device that refuses everything: the lines say so, and watching goes on
            self.drop(f"not measured: {type(error).__name__}", len(kept))

    def drop(self, why: str, count: int | None = None) -> None:
        """None of these measured (the watch ended first, or the device refused), the tensors let go without an op
        launched for them: each line says `why`. Rows of zeros, on the host, for whatever reads the rows whole."""
        if count is None:
            if self._kept is None:  # measured already: its numbers stand
                return
            count = len(self._kept)
        self._kept, self._versions, self._owners = None, [], []
        self._lows = self._highs = torch.zeros(count)
        self.failed = why


class PooledMeasurement(Measurement):
    """A kept tensor's measurement: row `row` of its pool's rows, read when first asked for; or, when the tensor was
    changed in place after its call, no numbers and a note that says so."""

    __slots__ = ("rows", "row")

    def __init__(self, rows: PooledRows, row: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        # Made at every pooled activation: the fields set directly, not through the dataclass's __init__.
        self.rows, self.row = rows, row
        self.dtype, self.shape, self.extra = dtype, shape, None

    @property
    def abs_min(self) -> torch.Tensor | None:
        return None if self.rows.not_measured(self.row) else self.rows.low(self.row)

    @abs_min.setter
    def abs_min(self, value: torch.Tensor | None) -> None:
        pass  # the numbers are the pool's

    @property
    def abs_max(self) -> torch.Tensor | None:
        return None if self.rows.not_measured(self.row) else self.rows.high(self.row)

    @abs_max.setter
    def abs_max(self, value: torch.Tensor | None) -> None:
        pass

    @property
    def skipped(self) -> str | None:
        return self.rows.not_measured(self.row)

    @skipped.setter
    def skipped(self, value: str | None) -> None:
        pass

    @property
    def is_float(self) -> bool:
        return self.rows.not_measured(self.row) is None


class Pool:
    """Activations kept to be measured together (see the module's docstring), by device and dtype. Only the thread
    that made it keeps tensors (a forward may run in several: DataParallel), so rows are never shared.

    Args:
        max_elements: at most this many elements are kept at a time.
    """

    def __init__(self, max_elements: int = POOL_MAX_ELEMENTS) -> None:
        self._open: dict[tuple[torch.device, torch.dtype], PooledRows] = {}
        self._elements = 0
        self._max_elements = max_elements
        self._thread = _get_ident()
        self._probes = Probes()

    def probe(self, tensor: torch.Tensor, version: int, owner: PoolOwner, measured: Measurement) -> None:
        """Note a tensor of an owner's first recorded batch and its measurement at the call, for the check to judge
        (`judge`), in the room the kept tensors leave (launched and let go first when they would leave too little)."""
        if _get_ident() != self._thread or not _poolable(tensor):  # what is never kept needs no judging
            return
        elements = _footprint(tensor)
        if self._elements and self._elements + self._probes.elements + elements > self._max_elements:
            self.settle()
        probe = PoolProbe(tensor.detach(), version, owner, measured)
        self._probes.note(probe, elements, self._max_elements - self._elements)

    def judge(self) -> None:
        """At a check: the owners probed whole since the last one are judged (`Probes.judge`)."""
        self._probes.judge()

    def keep(self, tensor: torch.Tensor, version: int, owner: PoolOwner) -> PooledMeasurement | None:
        """Keep a plain tensor (the caller knows it is) seen at `version`: its measurement, made when first read. None
        when it is not kept (too large, a dtype or layout the multi-tensor kernels do not take whole, another thread):
        measure it as it is seen then."""
        if not _poolable(tensor) or _get_ident() != self._thread:
            return None
        elements, probed = _footprint(tensor), self._probes.elements
        if elements + probed > self._max_elements:
            return None
        if self._elements + probed + elements > self._max_elements:
            self.settle()
        key = (tensor.device, tensor.dtype)
        rows = self._open.get(key)
        if rows is None or not rows.open:  # none yet, or read (and measured) since
            rows = self._open[key] = PooledRows()
        # Detached: the same values and version counter, not its graph (kept alive otherwise), and not the object the
        # caller holds (`output.data = other` replaces that object's values, not these).
        row = rows.add(tensor.detach(), version, owner)
        self._elements += elements
        return PooledMeasurement(rows, row, tensor.dtype, tuple(tensor.shape))

    def settle(self) -> None:
        """Measure what is kept (launched, not read) and let the tensors go."""
        for rows in self._open.values():
            if rows.open:
                rows._settle()
        self._open.clear()
        self._elements = 0

    def drop(self) -> None:
        """Watching ends: what is kept and probed is let go, nothing launched for it (the device may be the reason
        the watch ends); the lines of kept tensors say they were not measured."""
        for rows in self._open.values():
            rows.drop(WATCH_ENDED)
        self._open.clear()
        self._elements = 0
        self._probes.clear()


def _poolable(tensor: torch.Tensor) -> bool:
    """A tensor the multi-tensor kernels measure whole, in one launch: strided, dense, with values, of a float dtype
    whose abs keeps it."""
    return (
        tensor.layout is torch.strided
        and tensor.dtype in MULTI_TENSOR_DTYPES
        and not tensor.is_meta
        and tensor.numel() > 0
        and tensor.is_contiguous()  # a multi-tensor kernel takes others one by one
    )


def _footprint(tensor: torch.Tensor) -> int:
    """The elements a kept tensor keeps alive: its storage's (a view of a large tensor keeps all of it), at least its
    own."""
    return max(tensor.numel(), tensor.untyped_storage().nbytes() // tensor.element_size())
