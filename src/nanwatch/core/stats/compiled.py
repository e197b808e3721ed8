"""Recording under `torch.compile`: the statistics are compiled into the graph, the bookkeeping runs after it.

When dynamo compiles a model whose modules carry nanwatch's hooks, it traces the hooks too. Everything the eager path
does to save work (the statistics cache's lookups by storage and version counter, weak references, reused buffers)
reads what a graph cannot hold: dynamo would break the graph there, or guard on it and recompile at every call. So
under `torch.compiler.is_compiling()` a hook measures every tensor afresh with plain tensor ops (inductor fuses
`abs` into the reduction, and measures a tensor two hooks see once: common subexpressions) and hands the results to
one custom operator, `nanwatch::record`, that the graph calls in place of the bookkeeping. The operator is opaque to
the compiler (it is not traced, and adds no graph break and nothing to guard on); it writes to a token tensor, so the
compiler keeps every call, in order; when the graph runs, each call copies its numbers and hands them to the engine,
which makes the frame then and there, as the eager hook would have (`Watcher._take_compiled`).

What a record means (module, class, labels, roles, dtypes, ranks) is known when the graph is traced, so it travels
as one string constant, `key` (dynamo folds it); `frame_template(key)` turns it back into fields once per distinct
key. Sizes can be dynamic, so they travel as a small CPU tensor. `measurements()` pairs a template with the numbers.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import torch

from nanwatch.core.stats.base import Kernel
from nanwatch.core.stats.kernels import ABS_KEEPS_DTYPE, FLOAT8_DTYPES
from nanwatch.core.stats.measure import Measurement
from nanwatch.core.walk import call_leaves, note

__all__ = [
    "FrameTemplate",
    "Receiver",
    "LeafTemplate",
    "Sink",
    "frame_key",
    "frame_template",
    "marker_key",
    "measurements",
    "record_call",
    "record_marker",
]

# Separators that never occur in module names, labels or dtype names: one field, one leaf, one part of a key.
_FIELD, _LEAF, _PART = "\x1f", "\x1e", "\x1d"
# A record that is not a frame: an adapter hook, run by the engine when the graph gets there (`Watcher.outside_graph`).
_MARKER = "!"

ExtraKernels = tuple[tuple[str, Kernel], ...]
# What the engine is handed for each record: its key (without the token), the numbers (copies), the sizes of its
# tensors one after the other.
Receiver = Callable[[str, list[torch.Tensor], list[int]], None]


# ------------------------------------------------------------------------------------------------ the sink


class Sink:
    """Where the records of one watcher's hooks go, as the graph runs: to `receiver`.

    `token` goes into every key the watcher's hooks build, so the operator finds the receiver; a closed sink's records
    (from a graph compiled while it was open) are dropped.
    """

    _next = itertools.count(1)
    # token -> (the receiver's owner, held weakly, and its function), or (None, the receiver) for a plain function.
    _open: dict[int, tuple[weakref.ref[Any] | None, Callable[..., None]]] = {}

    def __init__(self, receiver: Receiver) -> None:
        self.token = next(Sink._next)
        # A watcher's bound method is held through a weak reference to the watcher: one dropped without close() (a
        # notebook cell run again) must not live on, with its model, in this table of the whole process; its entry
        # goes with it (the callback holds the table itself: at interpreter exit the class may be gone first).
        if inspect.ismethod(receiver):
            table, token = Sink._open, self.token
            owner = weakref.ref(receiver.__self__, lambda _: table.pop(token, None))
            Sink._open[token] = (owner, receiver.__func__)
        else:
            Sink._open[self.token] = (None, receiver)

    def close(self) -> None:
        Sink._open.pop(self.token, None)

    @staticmethod
    def receiver(token: int) -> Receiver | None:
        """The receiver of an open sink, or None (closed, or its watcher is gone)."""
        found = Sink._open.get(token)
        if found is None:
            return None
        owner, function = found
        if owner is None:
            return function
        alive = owner()
        return None if alive is None else partial(function, alive)


# Written by every call of the operator, so that the compiler keeps the calls (a call that returns nothing and
# writes nothing would be dead code) in the order the hooks made them.
_ORDER = torch.zeros(1)


@torch.library.custom_op("nanwatch::record", mutates_args=("order",))
def _record(order: torch.Tensor, key: str, values: list[torch.Tensor]) -> None:
    """At run time, for each hook call a graph traced: hand the engine the numbers (copies: the compiler may reuse the
    memory of a graph's temporaries once this call, their last reader, returns) and the sizes."""
    token, _, rest = key.partition(_PART)
    receiver = Sink.receiver(int(token))
    if receiver is not None:
        receiver(rest, [value.clone() for value in values[:-1]], values[-1].tolist())


@_record.register_fake
def _record_fake(order: torch.Tensor, key: str, values: list[torch.Tensor]) -> None:
    return None


def _emit(key: str, values: list[torch.Tensor]) -> None:
    torch.ops.nanwatch.record(_ORDER, key, values)


# ------------------------------------------------------------------------------------------------ tracing


def frame_key(token: int, name: str, class_name: str) -> str:
    """The start of the keys of a hook's records: made outside the trace, so that dynamo sees one string constant
    (an int it saw change between compilations, such as a new watcher's token, it would make dynamic, and a dynamic
    int cannot become text in a graph)."""
    return _PART.join((str(token), name, class_name))


def marker_key(token: int, index: int) -> str:
    """The key of adapter hook `index`'s records (see `frame_key`)."""
    return _PART.join((str(token), _MARKER, str(index)))


def record_call(
    prefix: str,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    output: Any,
    kernels: ExtraKernels,
) -> None:
    """Measure one module call as dynamo traces it, and hand the numbers to `nanwatch::record`.

    Only tensor ops and constants: nothing here reads a tensor's identity, storage or version. The lines and labels
    are those of the eager path: the parameters, then the call's leaves as core/walk.py labels them.
    """
    record = _Record(kernels)
    for param_name, param in module._parameters.items():
        if param is not None:
            record.leaf(param_name, "parameter", param)
    for label, role, leaf, noted in call_leaves(args, output, kwargs):
        if isinstance(leaf, torch.Tensor):
            record.leaf(label, role, leaf)
        elif noted:
            record.texts.append(_FIELD.join((label, role, "", "", note(leaf), "", "")))
    record.emit(prefix + _PART + _LEAF.join(record.texts))


def record_marker(key: str) -> None:
    """Under compile: the adapter hook of `key` (`marker_key`) runs here, when the graph runs, outside the graph."""
    _emit(key, [torch.zeros(0, dtype=torch.int64, device="cpu")])


class _Record:
    """One hook call's leaves as text, and its numbers: abs min and max stacked by device and dtype (one tensor each
    for the operator, not two per line), then the other statistics' vectors, then every tensor's sizes."""

    def __init__(self, kernels: ExtraKernels) -> None:
        self.kernels = kernels
        self.texts: list[str] = []
        self.kinds: list[tuple[torch.dtype, torch.device]] = []
        self.ranges: list[list[torch.Tensor]] = []
        self.extras: list[torch.Tensor] = []
        # dynamo cannot make text of a dynamic size: the sizes travel as numbers, the key says each tensor's rank
        self.sizes: list[Any] = []

    def leaf(self, label: str, role: str, tensor: torch.Tensor) -> None:
        self.sizes.extend(tensor.shape)
        skipped = _skipped(tensor)
        names = []
        group = ""
        if not skipped:
            data = tensor.detach()
            abs_min, abs_max = _range(data)
            group = str(self._group(abs_max, [abs_min, abs_max]))
            for name, kernel in self.kernels:
                vector = kernel(data)
                if vector is not None:
                    self.extras.append(vector)
                    names.append(name)
        rank = str(tensor.dim())  # static, even where a size is not
        self.texts.append(_FIELD.join((label, role, str(tensor.dtype), rank, skipped, ",".join(names), group)))

    def _group(self, value: torch.Tensor, pair: list[torch.Tensor]) -> int:
        for index, (dtype, device) in enumerate(self.kinds):
            if dtype == value.dtype and device == value.device:
                self.ranges[index] += pair
                return index
        self.kinds.append((value.dtype, value.device))
        self.ranges.append(pair)
        return len(self.kinds) - 1

    def emit(self, key: str) -> None:
        values = [torch.stack(pairs) for pairs in self.ranges] + self.extras
        values.append(torch.tensor(self.sizes, dtype=torch.int64, device="cpu"))
        _emit(key, values)


def _skipped(tensor: torch.Tensor) -> str:
    """Why a tensor gets no numbers under compile ("" when it gets them), as the eager path says it where it also has
    none (a sparse tensor, whose values the eager path measures, is not measured inside a graph)."""
    if tensor.is_meta:
        return "meta: not measured"
    if tensor.layout is not torch.strided:
        return str(tensor.layout).replace("torch.", "") + ": not measured"
    if tensor.numel() == 0:
        return "empty"
    dtype = tensor.dtype
    if dtype in ABS_KEEPS_DTYPE or dtype is torch.bool or dtype in FLOAT8_DTYPES or dtype.is_complex:
        return ""
    return f"{str(dtype).replace('torch.', '')} not measured"


def _range(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if data.dtype is torch.bool:
        magnitude = data.to(torch.uint8)
    elif data.dtype in FLOAT8_DTYPES:
        magnitude = data.float().abs()  # float8 has no reduction kernels; every float8 value is exact in float32
    else:
        magnitude = data.abs()  # complex: the (real) magnitude
    abs_min, abs_max = torch.aminmax(magnitude)
    return abs_min, abs_max


# ------------------------------------------------------------------------------------------------ replaying


@dataclass(frozen=True, slots=True)
class LeafTemplate:
    label: str
    role: str
    dtype: torch.dtype | None
    rank: int | None  # a tensor's number of dimensions; None for a line that is no tensor
    note: str | None  # why there are no numbers: a skipped tensor's reason, or "None", "not a tensor", ...
    group: int | None  # which stack holds its abs min and max (None: not measured)
    extra: tuple[str, ...]  # the other statistics measured, one vector each, in the record's order


@dataclass(frozen=True, slots=True)
class FrameTemplate:
    """What a record's key says: a frame's module, class and leaves, or (`marker`) an adapter hook."""

    module_name: str
    class_name: str
    leaves: tuple[LeafTemplate, ...]
    marker: int | None = None
    groups: int = 0  # how many stacks of abs min and max lead the record's numbers


@lru_cache(maxsize=4096)
def frame_template(key: str) -> FrameTemplate:
    """The fields of a record's key (without its token): parsed once per distinct key."""
    parts = key.split(_PART)
    if parts[0] == _MARKER:
        return FrameTemplate("", "", (), marker=int(parts[1]))
    name, class_name, text = parts
    leaves = tuple(_leaf_template(leaf) for leaf in text.split(_LEAF) if leaf)
    groups = 1 + max((leaf.group for leaf in leaves if leaf.group is not None), default=-1)
    return FrameTemplate(name, class_name, leaves, groups=groups)


def _leaf_template(text: str) -> LeafTemplate:
    label, role, dtype_name, rank, note, extra, group = text.split(_FIELD)
    dtype = getattr(torch, dtype_name.replace("torch.", ""), None) if dtype_name else None
    return LeafTemplate(
        label,
        role,
        dtype if isinstance(dtype, torch.dtype) else None,
        int(rank) if rank else None,
        note or None,
        int(group) if group else None,
        tuple(extra.split(",")) if extra else (),
    )


def measurements(template: FrameTemplate, values: list[torch.Tensor], sizes: list[int]) -> list[Measurement | str]:
    """One Measurement per tensor leaf of the template (or the note of a line that is no tensor), in order."""
    stacks = [iter(stack.unbind()) for stack in values[: template.groups]]
    extras = iter(values[template.groups :])
    found: list[Measurement | str] = []
    offset = 0
    for leaf in template.leaves:
        if leaf.rank is None:
            found.append(leaf.note or "not a tensor")
            continue
        shape = tuple(sizes[offset : offset + leaf.rank])
        offset += leaf.rank
        if leaf.group is None:
            found.append(Measurement(None, None, leaf.dtype, shape, skipped=leaf.note))
            continue
        stack = stacks[leaf.group]
        abs_min, abs_max = next(stack), next(stack)
        extra = {name: next(extras) for name in leaf.extra} if leaf.extra else None
        found.append(Measurement(abs_min, abs_max, leaf.dtype, shape, extra=extra))
    return found
