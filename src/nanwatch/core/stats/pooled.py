"""Many tensors measured with multi-tensor kernels: the accelerator's way (paths.py), a few launches for any number.

`multi_tensor_range` measures a list of tensors of one device and dtype, whatever their shapes: `_foreach_abs`, a
`_foreach_max` (the abs maxima), `_foreach_neg_` and a second `_foreach_max` (the abs minima, negated), one stack. Six
ops however many tensors, where measuring each as it is seen takes two per tensor. The numbers are those of
`abs().aminmax()`: a min and a max are exact however grouped, and max propagates nan. The parameters' batch
measurement (`grouped.StackPlan`) and the deferred calls' outputs use it on an accelerator.

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
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from nanwatch.core.stats.kernels import abs_aminmax
from nanwatch.core.stats.measure import Measurement
from nanwatch.core.stats.output_rows import Rows

__all__ = [
    "CHANGED_AFTER_CALL",
    "GROUP_MAX_ELEMENTS",
    "MULTI_TENSOR_DTYPES",
    "POOL_MAX_ELEMENTS",
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
    in six device ops however many tensors. Raises RuntimeError where torch refuses (devices differ)."""
    count = len(tensors)
    with torch.no_grad():  # no graph, whatever requires grad
        magnitudes = torch._foreach_abs(list(tensors))
        highs = torch._foreach_max(magnitudes)
        torch._foreach_neg_(magnitudes)  # the largest negated magnitude is the smallest magnitude, negated
        negated_lows = torch._foreach_max(magnitudes)
        both = torch.stack([*highs, *negated_lows])
        return both[count:].neg_(), both[:count]


class PoolOwner(Protocol):
    """Who keeps tensors in a pool: a watched module (core/engine/recording/deferral.py's `Site`)."""

    pooled: bool  # its calls' tensors are kept in the pool (not measured as its calls return)
    pool_judged: bool  # its first recorded batch was judged (`Probes`): `pooled` is not decided again


class PoolProbe(NamedTuple):
    """A tensor of an owner's first recorded batch, measured as the call returned: was it changed in place by the
    check? Held until then (a tensor changed and then let go was changed all the same), within `Probes`' bound."""

    tensor: torch.Tensor
    version: int
    owner: PoolOwner


class Probes:
    """The probes of owners not judged yet, within the room their pool leaves them (`Pool.probe`): an owner with a
    tensor past it is not judged at this check, and is probed again in its next recorded batch."""

    def __init__(self) -> None:
        self._probes: list[PoolProbe] = []
        self._unfinished: set[int] = set()  # ids of owners with a tensor left out
        self.elements = 0

    def note(self, tensor: torch.Tensor, version: int, owner: PoolOwner, room: int) -> None:
        numel = tensor.numel()
        if self.elements + numel > room:
            self._unfinished.add(id(owner))
            return
        self.elements += numel
        self._probes.append(PoolProbe(tensor.detach() if tensor.requires_grad else tensor, version, owner))

    def judge(self) -> None:
        """At a check: each owner probed whole has its tensors pooled from now on, unless one of them was changed in
        place since its call. The probes are let go."""
        probes, unfinished = self._probes, self._unfinished
        self.clear()
        refused = {id(probe.owner) for probe in probes if probe.tensor._version != probe.version}
        for probe in probes:
            owner = probe.owner
            if not owner.pool_judged and id(owner) not in unfinished:
                owner.pool_judged = True
                owner.pooled = id(owner) not in refused

    def clear(self) -> None:
        self._probes, self._unfinished, self.elements = [], set(), 0


class PooledRows(Rows):
    """The tensors of one device and dtype kept since the last measurement, measured together when any of their
    numbers is first read (`_settle`); then the rows are the vectors, and the tensors are let go."""

    __slots__ = ("_kept", "_versions", "_owners", "_changed")

    def __init__(self) -> None:
        super().__init__()
        self._kept: list[torch.Tensor] | None = []
        self._versions: list[int] = []
        self._owners: list[PoolOwner] = []
        self._changed: frozenset[int] = frozenset()

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

    def changed(self, row: int) -> bool:
        """Whether the tensor kept at `row` was changed in place after its call (then it was not measured)."""
        if self._kept is not None:
            self._settle()
        return row in self._changed

    def _settle(self) -> None:
        kept, versions, owners = self._kept, self._versions, self._owners
        assert kept is not None, "pooled rows measured twice"
        self._kept, self._versions, self._owners = None, [], []
        if [tensor._version for tensor in kept] != versions:
            changed = {row for row, tensor in enumerate(kept) if tensor._version != versions[row]}
            for row in changed:
                owners[row].pooled = False  # measured as its calls return from now on
                kept[row] = kept[row].new_zeros(())  # what the caller wrote later is neither shown nor screened
            self._changed = frozenset(changed)
        try:
            self._lows, self._highs = multi_tensor_range(kept)
        except (RuntimeError, NotImplementedError):  # never a reason to stop watching: each measured on its own
            ranges = [abs_aminmax(tensor) for tensor in kept]
            self._lows = torch.stack([low for low, _ in ranges])
            self._highs = torch.stack([high for _, high in ranges])


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
        return None if self.rows.changed(self.row) else self.rows.low(self.row)

    @abs_min.setter
    def abs_min(self, value: torch.Tensor | None) -> None:
        pass  # the numbers are the pool's

    @property
    def abs_max(self) -> torch.Tensor | None:
        return None if self.rows.changed(self.row) else self.rows.high(self.row)

    @abs_max.setter
    def abs_max(self, value: torch.Tensor | None) -> None:
        pass

    @property
    def skipped(self) -> str | None:
        return CHANGED_AFTER_CALL if self.rows.changed(self.row) else None

    @skipped.setter
    def skipped(self, value: str | None) -> None:
        pass

    @property
    def is_float(self) -> bool:
        return not self.rows.changed(self.row)


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

    def probe(self, tensor: torch.Tensor, version: int, owner: PoolOwner) -> None:
        """Note a tensor of an owner's first recorded batch, for the check to judge (`judge`), in the room the kept
        tensors leave (launched and let go first when they would leave too little)."""
        if self._elements and self._elements + self._probes.elements + tensor.numel() > self._max_elements:
            self.settle()
        self._probes.note(tensor, version, owner, self._max_elements - self._elements)

    def judge(self) -> None:
        """At a check: the owners probed whole since the last one are judged (`Probes.judge`)."""
        self._probes.judge()

    def forget_probes(self) -> None:
        self._probes.clear()

    def keep(self, tensor: torch.Tensor, version: int, owner: PoolOwner) -> PooledMeasurement | None:
        """Keep a plain, strided, non-empty tensor with storage (the caller knows it is), seen at `version`: its
        measurement, made when first read. None when it is not kept (too large, a dtype or layout the multi-tensor
        kernels do not take as a whole, another thread): measure it as it is seen then."""
        numel = tensor.numel()
        probed = self._probes.elements
        if (
            numel + probed > self._max_elements
            or tensor.dtype not in MULTI_TENSOR_DTYPES
            or not tensor.is_contiguous()  # a multi-tensor kernel takes dense tensors in one launch, others one by one
            or _get_ident() != self._thread
        ):
            return None
        if self._elements + probed + numel > self._max_elements:
            self.settle()
        key = (tensor.device, tensor.dtype)
        rows = self._open.get(key)
        if rows is None or not rows.open:  # none yet, or read (and measured) since
            rows = self._open[key] = PooledRows()
        # Detached (the same values and version counter): a kept output does not keep its graph alive.
        row = rows.add(tensor.detach() if tensor.requires_grad else tensor, version, owner)
        self._elements += numel
        return PooledMeasurement(rows, row, tensor.dtype, tuple(tensor.shape))

    def settle(self) -> None:
        """Measure what is kept (launched, not read) and let the tensors go."""
        for rows in self._open.values():
            if rows.open:
                rows._settle()
        self._open.clear()
        self._elements = 0
