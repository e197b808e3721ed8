"""Many small tensors measured together: each copied, when it is seen, into a row of a buffer, the rows reduced at once.

On a model of many small layers a module call costs what launching kernels costs, and measuring an output there takes
two launches (`abs`, `aminmax`) and leaves two 0-d tensors behind. Staging takes one launch per tensor instead (a copy
into the next row of a buffer kept for its dtype and shape); the rows are reduced together the first time any of their
numbers is read, normally by the check at the end of the micro-batch: three launches for hundreds of rows. The copy
holds the values as they were when seen, so an in-place change made later (`ReLU(inplace=True)`, `x += y`) does not
change what was measured, and the numbers are those of `abs().aminmax()`: a min and a max are exact however grouped.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

__all__ = ["DtypeRows", "Rows", "StagedRows", "Staging", "STAGE_MAX_NUMEL"]

# Tensors of up to this many elements are staged: above it the kernels' work outweighs their launch cost, and a copy
# would only add a pass.
STAGE_MAX_NUMEL = 1 << 12
# All buffers of one Staging together hold at most this many elements (16 MiB of float32); past it, tensors are
# measured one by one as usual.
_MAX_ELEMENTS = 1 << 22
_FIRST_ROWS = 64
# A buffer grows (doubling) up to this many rows; then, once full, its rows are reduced and it is written again.
_MAX_ROWS = 1 << 13
_STAGED_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled


class DtypeRows(NamedTuple):
    """Rows measured together, and the dtype of the tensors they measure (what a check groups their maxima by)."""

    rows: Rows
    dtype: torch.dtype


class Rows:
    """The abs min and max of tensors measured together, as two device vectors (`lows[k]`, `highs[k]` for row k), cut
    into each tensor's 0-d values only when something reads them one by one (a report, a trace), never at every batch:
    the check reads the vectors whole."""

    __slots__ = ("_lows", "_highs", "_low_items", "_high_items")

    def __init__(self, lows: torch.Tensor | None = None, highs: torch.Tensor | None = None) -> None:
        self._lows, self._highs = lows, highs
        self._low_items: tuple[torch.Tensor, ...] | None = None
        self._high_items: tuple[torch.Tensor, ...] | None = None

    def _settle(self) -> None:
        """Make `_lows` and `_highs` (already made here; staged rows are reduced when first read)."""

    @property
    def lows(self) -> torch.Tensor:
        if self._lows is None:
            self._settle()
        assert self._lows is not None
        return self._lows

    @property
    def highs(self) -> torch.Tensor:
        if self._highs is None:
            self._settle()
        assert self._highs is not None
        return self._highs

    def low(self, row: int) -> torch.Tensor:
        if self._low_items is None:
            self._low_items = self.lows.unbind()
        return self._low_items[row]

    def high(self, row: int) -> torch.Tensor:
        if self._high_items is None:
            self._high_items = self.highs.unbind()
        return self._high_items[row]


class _Area:
    """One buffer of rows shaped like the tensors staged in it, and the segment its next rows join."""

    __slots__ = ("buffer", "rows", "count", "segment")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        # A view per row, made once: copying into one is a single torch call (indexing the buffer would be two).
        self.rows = buffer.unbind(0)
        self.count = 0
        self.segment = StagedRows(self, 0)


class StagedRows(Rows):
    """The rows of one segment of an area: from `start` up to where the area had got when they were first read. Once
    reduced, later rows go to a new segment, so what was read never changes."""

    __slots__ = ("_area", "start")

    def __init__(self, area: _Area, start: int) -> None:
        super().__init__()
        self._area: _Area | None = area
        self.start = start

    def _settle(self) -> None:
        area = self._area
        assert area is not None, "staged rows reduced twice"
        stop = area.count
        with torch.no_grad():
            # One column per tensor: amin/amax down the columns run as long vector passes (min and max propagate nan).
            columns = area.buffer[self.start : stop].abs_().view(stop - self.start, -1).t()
            self._lows, self._highs = columns.amin(0), columns.amax(0)
        self._area = None  # the values are in the vectors now; the buffer is free to be written again
        area.segment = StagedRows(area, stop)

    @property
    def open(self) -> bool:
        """Rows were staged here and not read yet."""
        return self._area is not None and self._area.count > self.start


class Staging:
    """Buffers for small floating-point tensors, one per (device, dtype, shape), used again batch after batch.

    `stage(tensor)` copies a detached, plain, strided tensor into the next row and says where it went, or returns None
    (too large, not a dtype staged, no room for a buffer of its shape, another thread): measure it as usual then.
    `rewind()`, once what was staged has been read (the check), reduces anything not read yet and starts the buffers
    over. Only the thread that made the Staging stages (a forward may run in several: DataParallel), so rows are never
    shared.
    """

    def __init__(self, max_elements: int = _MAX_ELEMENTS) -> None:
        self._areas: dict[tuple[torch.dtype, torch.Size, torch.device], _Area] = {}
        self._elements = 0
        self._max_elements = max_elements
        self._thread = threading.get_ident()

    def stage_plain(self, tensor: torch.Tensor) -> tuple[StagedRows, int, int] | None:
        """`stage()` of a plain `torch.Tensor` as a module returned it (attached to a graph or not), asking only what
        staging needs: non-empty, small, strided, with storage. Also gives its storage pointer (for the cache). The
        hot path of a model of many small modules: one torch call (the copy), no detached alias."""
        numel = tensor.numel()
        if not 0 < numel <= STAGE_MAX_NUMEL or tensor.layout is not torch.strided or tensor.is_meta:
            return None
        pointer = tensor.data_ptr()
        if not pointer or threading.get_ident() != self._thread:
            return None
        key = (tensor.dtype, tensor.shape, tensor.device)
        area = self._areas.get(key)
        if area is None or area.count == len(area.rows):
            staged = self.stage(tensor.detach())
            return None if staged is None else (staged[0], staged[1], pointer)
        count = area.count
        if tensor.requires_grad and _grad_enabled():
            _set_grad_enabled(False)  # copied with autograd off, so the buffer joins no graph
            try:
                area.rows[count].copy_(tensor)
            finally:
                _set_grad_enabled(True)
        else:
            area.rows[count].copy_(tensor)
        area.count = count + 1
        segment = area.segment
        return segment, count - segment.start, pointer

    def stage(self, data: torch.Tensor) -> tuple[StagedRows, int] | None:
        if threading.get_ident() != self._thread:
            return None
        key = (data.dtype, data.shape, data.device)
        area = self._areas.get(key)
        if area is None:
            if data.numel() > STAGE_MAX_NUMEL or data.dtype not in _STAGED_DTYPES:
                return None
            area = self._new_area(key, _FIRST_ROWS)
            if area is None:
                return None
        count = area.count
        if count == len(area.rows):
            area = self._grown(key, area)
            count = 0
        area.rows[count].copy_(data)
        area.count = count + 1
        segment = area.segment
        return segment, count - segment.start

    def _new_area(self, key: tuple[torch.dtype, torch.Size, torch.device], rows: int) -> _Area | None:
        dtype, shape, device = key
        size = rows * shape.numel()
        if self._elements + size > self._max_elements:
            return None
        # Never an inference tensor (made under inference_mode, it could not be written outside it), never part of a
        # graph.
        with torch.inference_mode(False), torch.no_grad():
            buffer = torch.empty((rows, *shape), dtype=dtype, device=device)
        self._elements += size
        area = self._areas[key] = _Area(buffer)
        return area

    def _grown(self, key: tuple[torch.dtype, torch.Size, torch.device], area: _Area) -> _Area:
        """A full area: its rows reduced now (their numbers are in vectors of their own then), and a buffer twice as
        large for the rows to come, or, at the limit, the same buffer written again from its first row."""
        if area.segment.open:
            area.segment._settle()
        rows = len(area.rows)
        if rows < _MAX_ROWS:
            self._elements -= rows * key[1].numel()
            del self._areas[key]
            larger = self._new_area(key, 2 * rows)
            if larger is not None:
                return larger
            self._elements += rows * key[1].numel()
            self._areas[key] = area
        area.count = 0
        area.segment = StagedRows(area, 0)
        return area

    def rewind(self) -> None:
        """Reduce what was staged and not read yet (frames kept hold those numbers), then start every buffer over."""
        for area in self._areas.values():
            if area.segment.open:
                area.segment._settle()
            area.count = 0
            area.segment = StagedRows(area, 0)

    def clear(self) -> None:
        self.rewind()
        self._areas.clear()
        self._elements = 0
