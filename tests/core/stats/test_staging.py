"""Small activations staged (copied into rows of a buffer) and measured together: the numbers of `abs().aminmax()`,
as they were when staged, whatever happens to the tensor or the buffer afterwards."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from nanwatch.core.stats import output_rows as staging
from nanwatch.core.stats.cache import StatsCache
from nanwatch.core.stats.measure import StackedMeasurement
from nanwatch.core.stats.output_rows import STAGE_MAX_NUMEL, StagedRows, Staging

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _numbers(rows: StagedRows, row: int) -> tuple[float, float]:
    return rows.low(row).item(), rows.high(row).item()


def _expected(tensor: torch.Tensor) -> tuple[float, float]:
    low, high = torch.aminmax(tensor.abs())
    return low.item(), high.item()


def _same(found: tuple[float, float], expected: tuple[float, float]) -> bool:
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(found, expected, strict=True))


def _signed(dtype: torch.dtype, seed: int, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * 10 ** (seed % 7 - 3)).to(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_staged_rows_are_exactly_abs_aminmax_nan_and_inf_included(dtype: torch.dtype) -> None:
    tensors = [_signed(dtype, seed) for seed in range(5)]
    tensors[1][0, 0] = float("nan")
    tensors[2][1, 2] = float("-inf")
    tensors[3][2, 4] = -0.0
    tensors[3][0, 1] = torch.finfo(dtype).tiny / 4  # a subnormal
    stage = Staging()
    placed = [stage.stage(tensor) for tensor in tensors]
    for tensor, where in zip(tensors, placed, strict=True):
        assert where is not None
        assert _same(_numbers(*where), _expected(tensor)), tensor
    assert math.isnan(placed[1][0].high(placed[1][1]).item())
    assert placed[2][0].high(placed[2][1]).item() == math.inf


def test_the_numbers_are_those_of_when_the_tensor_was_staged() -> None:
    tensor = _signed(torch.float32, 1)
    expected = _expected(tensor)
    stage = Staging()
    where = stage.stage(tensor)
    assert where is not None
    tensor.mul_(1000).relu_()  # what an in-place op after the module does
    assert _numbers(*where) == expected


def test_a_read_closes_its_segment_and_later_rows_go_to_a_new_one() -> None:
    first, second = _signed(torch.float32, 2), _signed(torch.float32, 3)
    stage = Staging()
    rows, row = stage.stage(first) or pytest.fail("not staged")
    assert _numbers(rows, row) == _expected(first)  # reduced now, mid-batch (a trace reads each frame)
    later = stage.stage(second)
    assert later is not None
    assert later[0] is not rows
    assert later[1] == 0
    assert _numbers(*later) == _expected(second)
    assert _numbers(rows, row) == _expected(first)


def test_rewind_reduces_rows_not_read_yet_before_the_buffer_is_written_again() -> None:
    first, second = _signed(torch.float32, 4), _signed(torch.float32, 5) * 7
    stage = Staging()
    unread = stage.stage(first)
    stage.rewind()  # the check is over: the buffer's first row is written again next
    again = stage.stage(second)
    assert unread is not None
    assert again is not None
    assert _numbers(*unread) == _expected(first)
    assert _numbers(*again) == _expected(second)


def test_every_number_survives_the_buffer_growing_and_being_written_again_when_full() -> None:
    count = 2 * staging._MAX_ROWS + 300  # past the largest buffer: its rows are reduced and it is written again
    tensors = [torch.full((2, 2), float(index)) * torch.tensor([[1.0, -2.0], [0.5, 3.0]]) for index in range(count)]
    stage = Staging()
    placed = [stage.stage(tensor) for tensor in tensors]
    assert all(where is not None for where in placed)
    for index in (0, 63, 64, 1000, staging._MAX_ROWS - 1, staging._MAX_ROWS, count - 1):
        rows, row = placed[index]  # type: ignore[misc]
        assert _numbers(rows, row) == (0.5 * index, 3.0 * index), index


def test_what_cannot_be_staged_is_refused() -> None:
    stage = Staging()
    assert stage.stage(torch.ones(STAGE_MAX_NUMEL + 1)) is None  # large: measured alone
    assert stage.stage(torch.ones(4, dtype=torch.int64)) is None  # not a float
    assert Staging(max_elements=100).stage(torch.ones(4, 4)) is None  # no room for a buffer of 64 rows of 16
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(stage.stage(torch.ones(3))))
    stage.stage(torch.ones(3))  # the area exists: the other thread is still refused
    thread.start()
    thread.join()
    assert found == [None]


def test_staging_builds_no_graph_and_survives_inference_mode_and_no_grad() -> None:
    stage = Staging()
    leaf = torch.randn(3, 3, requires_grad=True)
    with torch.inference_mode():
        assert stage.stage(torch.ones(2, 2)) is not None  # the buffer made here is a normal tensor
    with torch.no_grad():
        assert stage.stage(torch.ones(2, 2) * 2) is not None
    where = stage.stage((leaf * 3).detach())
    assert where is not None
    assert not where[0].highs.requires_grad
    assert _numbers(*where) == _expected(leaf * 3)


def test_the_cache_stages_small_activations_and_measures_large_ones_alone() -> None:
    cache = StatsCache()
    small, large = torch.randn(4, 4), torch.randn(STAGE_MAX_NUMEL + 1)
    staged, alone = cache.activation(small), cache.activation(large)
    assert type(staged) is StackedMeasurement
    assert type(alone) is not StackedMeasurement
    assert cache.activation(small) is staged  # the next module's input: the same measurement, not a new row
    small.mul_(2)  # changed in place: measured again, the old numbers kept
    changed = cache.activation(small)
    assert changed is not staged
    assert 2 * staged.abs_max.item() == changed.abs_max.item()


def test_staging_a_graphs_tensor_copies_it_with_autograd_off_and_leaves_grad_mode_as_it_was() -> None:
    stage = Staging()
    leaf = torch.randn(3, 3, requires_grad=True)
    first = stage.stage_plain(leaf * 3)  # makes the area (through stage(), from a detached alias)
    second = stage.stage_plain(leaf * 5)  # the area exists: copied straight, with autograd off
    assert first is not None
    assert second is not None
    assert torch.is_grad_enabled()
    assert second[2] != 0  # the storage pointer, for the cache
    assert not second[0].highs.requires_grad
    assert _numbers(second[0], second[1]) == _expected(leaf * 5)
    with torch.no_grad():
        third = stage.stage_plain(leaf * 7)
        assert not torch.is_grad_enabled()
    assert third is not None
    assert _numbers(third[0], third[1]) == _expected(leaf * 7)
    for refused in (torch.ones(0), torch.ones(STAGE_MAX_NUMEL + 1), torch.ones(2, device="meta")):
        assert stage.stage_plain(refused) is None
