"""Recording under `torch.compile`: the statistics are compiled into the graph, the bookkeeping runs after it.

When dynamo traces a model whose modules carry nanwatch's hooks, it traces the hooks too. Everything the eager path
does to save work (the statistics cache's lookups by storage and version counter, weak references, reused buffers)
reads what a graph cannot: dynamo would break the graph there, or guard on it and recompile at every call. So under
`torch.compiler.is_compiling()` a hook measures every tensor afresh with plain tensor ops (inductor fuses `abs` into
the reduction, and its common-subexpression pass measures a tensor seen twice once) and hands the results to
`record()`, which dynamo does not trace: registered as a "reorderable logging function", its calls are replayed
right after the graph runs, with the graph's outputs as arguments. So nanwatch adds no graph break and nothing to
guard on.

What a record means (module, class, labels, roles, dtypes, shapes) is known when the graph is traced, so it travels
as one string constant, `key`, built from constants only (dynamo folds it); `frame_template(key)` turns it back into
fields once per distinct key. `measurements()` pairs a template with the replayed tensors.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from nanwatch.core.stats.base import Kernel
from nanwatch.core.stats.kernels import ABS_KEEPS_DTYPE, FLOAT8_DTYPES
from nanwatch.core.stats.measure import Measurement
from nanwatch.core.walk import TooDeep, TooMany, walk

__all__ = [
    "CompiledRecord",
    "FrameTemplate",
    "LeafTemplate",
    "Sink",
    "frame_template",
    "measurements",
    "record",
    "record_call",
    "record_marker",
    "ensure_registered",
    "traceable",
]

# Separators that never occur in module names, labels or dtype names: one field, one leaf, one part of a key.
_FIELD, _LEAF, _PART = "\x1f", "\x1e", "\x1d"
# A record that is not a frame: an adapter hook that runs after the graph (see `Watcher.outside_graph`).
_MARKER = "!"

ExtraKernels = tuple[tuple[str, Kernel], ...]
# One replayed record: its key and the tensors the graph computed for it.
CompiledRecord = tuple[str, tuple[torch.Tensor, ...]]


def traceable() -> bool:
    """Whether dynamo replays `record` after a graph rather than tracing it (see `ensure_registered`)."""
    return _registered


def ensure_registered() -> bool:
    """Register `record` with dynamo as a reorderable logging function, once torch._dynamo is loaded.

    Importing torch._dynamo takes seconds, so nanwatch never does: anything compiled has loaded it already. The engine
    asks at attach and at every batch boundary; a graph traced before (the first batch of a model compiled after
    `watch()` and entered through a torch.nn container) records through a graph break instead, and the guard on
    `traceable()` recompiles it once this is registered.
    """
    global _registered
    if _registered:
        return True
    config = sys.modules.get("torch._dynamo.config")
    functions = getattr(config, "reorderable_logging_functions", None)
    if not isinstance(functions, set):
        return False
    functions.add(record)
    _registered = True
    return True


_registered = False


# ------------------------------------------------------------------------------------------------ the sink


class Sink:
    """Where the replayed records of one watcher go: a queue, drained by the engine in order.

    `token` goes into every key the watcher's hooks build, so `record()` finds the queue; a closed sink's records
    (from a graph compiled while it was open) are dropped.
    """

    _next = itertools.count(1)
    _open: dict[int, deque[CompiledRecord]] = {}

    def __init__(self) -> None:
        self.token = next(Sink._next)
        self.queue: deque[CompiledRecord] = deque()
        self.seen = False  # a record arrived: a graph holds this watcher's hooks
        Sink._open[self.token] = self.queue

    def close(self) -> None:
        Sink._open.pop(self.token, None)
        self.queue.clear()


def record(key: str, *values: torch.Tensor) -> None:
    """Called by dynamo after a graph ran, once per hook call it traced, with the tensors that call computed."""
    token, _, rest = key.partition(_PART)
    queue = Sink._open.get(int(token))
    if queue is not None:
        queue.append((rest, values))


# ------------------------------------------------------------------------------------------------ tracing


def record_call(
    token: int,
    name: str,
    class_name: str,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    output: Any,
    kernels: ExtraKernels,
) -> None:
    """Measure one module call as dynamo traces it, and pass the results to `record` (replayed after the graph).

    Only tensor ops, string constants and list appends: nothing here reads a tensor's identity, storage or version.
    The leaves and labels are those of the eager path (parameters, `input[i]`, `input.<keyword>`, `output...`).
    """
    leaves: list[str] = []
    values: list[torch.Tensor] = []
    # The sizes of every tensor leaf, one after the other: dynamo cannot make text of a dynamic size, so they travel
    # as one small int64 tensor per call (the last value; a constant one when the shapes are static), and the key
    # says each tensor's rank.
    shapes: list[Any] = []
    for param_name, param in module._parameters.items():
        if param is not None:
            _leaf(leaves, values, shapes, param_name, "parameter", param, kernels)
    for index, value in enumerate(args):
        _leaves(leaves, values, shapes, value, f"input[{index}]", "input", kernels, notes=True)
    for keyword, value in kwargs.items():
        _leaves(leaves, values, shapes, value, f"input.{keyword}", "input", kernels, notes=False)
    _leaves(leaves, values, shapes, output, "output", "output", kernels, notes=True)
    values.append(torch.tensor(shapes, dtype=torch.int64))
    key = _PART.join((str(token), name, class_name, _LEAF.join(leaves)))
    record(key, *values)


def record_marker(token: int, index: int) -> None:
    """Under compile: note that adapter hook `index` ran here; the engine runs it when it drains the records."""
    record(_PART.join((str(token), _MARKER, str(index))))


def _leaves(
    leaves: list[str],
    values: list[torch.Tensor],
    shapes: list[Any],
    value: Any,
    label: str,
    role: str,
    kernels: ExtraKernels,
    *,
    notes: bool,
) -> None:
    """The leaves of `value`, labelled as core/walk.py labels them. `notes`: also the lines without numbers (None,
    not a tensor, ...); keyword inputs list their tensors only."""
    if isinstance(value, torch.Tensor):
        _leaf(leaves, values, shapes, label, role, value, kernels)
        return
    for leaf_label, leaf in walk(value, label):
        if isinstance(leaf, torch.Tensor):
            _leaf(leaves, values, shapes, leaf_label, role, leaf, kernels)
        elif notes:
            leaves.append(_FIELD.join((leaf_label, role, "", "", _note(leaf), "")))


def _note(leaf: object) -> str:
    if leaf is None:
        return "None"
    if isinstance(leaf, TooDeep):
        return "nested too deep"
    if isinstance(leaf, TooMany):
        return "not shown"
    return "not a tensor"


def _leaf(
    leaves: list[str],
    values: list[torch.Tensor],
    shapes: list[Any],
    label: str,
    role: str,
    tensor: torch.Tensor,
    kernels: ExtraKernels,
) -> None:
    dtype = tensor.dtype
    shape = str(tensor.dim())  # the rank is static, even where a size is not
    shapes.extend(tensor.shape)
    skipped = _skipped(tensor)
    names = []
    if skipped == "":
        data = tensor.detach()
        abs_min, abs_max = _range(data)
        values += [abs_min, abs_max]
        for name, kernel in kernels:
            vector = kernel(data)
            if vector is not None:
                values.append(vector)
                names.append(name)
    leaves.append(_FIELD.join((label, role, str(dtype), shape, skipped, ",".join(names))))


def _skipped(tensor: torch.Tensor) -> str:
    """Why a tensor gets no numbers under compile ("" when it gets them), as the eager path says it."""
    if tensor.is_meta:
        return "meta"
    if tensor.layout is not torch.strided:
        return str(tensor.layout).replace("torch.", "")
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
    rank: int | None  # a tensor's number of dimensions (its sizes travel in the record's last value)
    note: str | None  # why there are no numbers: a skipped tensor's reason, or "None", "not a tensor", ...
    measured: bool  # two range values follow in the record, then one vector per name in `extra`
    extra: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FrameTemplate:
    """What a record's key says: a frame's module and class and its leaves, or (`marker`) an adapter hook."""

    module_name: str
    class_name: str
    leaves: tuple[LeafTemplate, ...]
    marker: int | None = None

    @property
    def has_tensors(self) -> bool:
        return any(leaf.rank is not None for leaf in self.leaves)


@lru_cache(maxsize=4096)
def frame_template(key: str) -> FrameTemplate:
    """The fields of a record's key (without its token): parsed once per distinct key."""
    parts = key.split(_PART)
    if parts[0] == _MARKER:
        return FrameTemplate("", "", (), marker=int(parts[1]))
    name, class_name, leaves = parts
    return FrameTemplate(name, class_name, tuple(_leaf_template(text) for text in leaves.split(_LEAF) if text))


def _leaf_template(text: str) -> LeafTemplate:
    label, role, dtype_name, rank, note, extra = text.split(_FIELD)
    dtype = getattr(torch, dtype_name.replace("torch.", ""), None) if dtype_name else None
    measured = bool(dtype_name) and not note
    return LeafTemplate(
        label,
        role,
        dtype if isinstance(dtype, torch.dtype) else None,
        int(rank) if rank else None,
        note or None,
        measured,
        tuple(extra.split(",")) if extra else (),
    )


def measurements(template: FrameTemplate, values: tuple[torch.Tensor, ...]) -> list[Measurement | str]:
    """One Measurement per tensor leaf of the template (or the note of a leaf that is not a tensor), in order."""
    found: list[Measurement | str] = []
    sizes: list[int] = values[-1].tolist()  # a CPU tensor: no device sync
    position = offset = 0
    for leaf in template.leaves:
        if leaf.rank is None:
            found.append(leaf.note or "not a tensor")
            continue
        shape = tuple(sizes[offset : offset + leaf.rank])
        offset += leaf.rank
        if not leaf.measured:
            found.append(Measurement(None, None, leaf.dtype, shape, skipped=leaf.note))
            continue
        abs_min, abs_max = values[position], values[position + 1]
        position += 2
        extra = None
        if leaf.extra:
            extra = dict(zip(leaf.extra, values[position : position + len(leaf.extra)], strict=True))
            position += len(leaf.extra)
        found.append(Measurement(abs_min, abs_max, leaf.dtype, shape, extra=extra))
    return found
