"""The accelerator's way of measuring many tensors (core/stats/pooled.py): multi-tensor kernels whose numbers are those
of `abs().aminmax()` for each tensor, a pool that keeps activations until they are read and says which ones changed
in place before that, and the probes that decide whose activations are pooled. Run on the CPU: the numbers are the
same on any device, only the launches differ."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanwatch.core.stats.abs_range import AbsRange
from nanwatch.core.stats.cache import StatsCache
from nanwatch.core.stats.grouped import StackPlan
from nanwatch.core.stats.measure import StackedMeasurement, measure
from nanwatch.core.stats.paths import cpu_as_accelerator, multi_tensor_kernels
from nanwatch.core.stats.pooled import (
    CHANGED_AFTER_CALL,
    WATCH_ENDED,
    Pool,
    PooledMeasurement,
    PooledRows,
    multi_tensor_range,
)

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(), (1,), (3, 5), (2, 3, 4), (70,)]


class Owner:
    """A watched module, as the pool sees one."""

    def __init__(self, pooled: bool = True, judged: bool = True) -> None:
        self.pooled, self.pool_judged, self.changed = pooled, judged, False


def _pair(low: torch.Tensor | None, high: torch.Tensor | None) -> tuple[float, float]:
    assert low is not None
    assert high is not None
    return low.item(), high.item()


def _expected(tensor: torch.Tensor) -> tuple[float, float]:
    low, high = torch.aminmax(tensor.abs())
    return low.item(), high.item()


def _same(found: tuple[float, float], expected: tuple[float, float]) -> bool:
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(found, expected, strict=True))


def _tensors(dtype: torch.dtype, bad: float | None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        (torch.randn(shape, generator=generator, dtype=torch.float64) * 10 ** (index - 2)).to(dtype)
        for index, shape in enumerate(SHAPES)
    ]
    tensors[2][1, 2] = -0.0  # the smallest magnitude: a signed zero reads as zero
    if bad is not None:
        tensors[3][1, 0, 2] = bad
    return tensors


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf], ids=["finite", "nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_multi_tensor_range_gives_each_tensor_its_abs_aminmax(dtype: torch.dtype, bad: float | None) -> None:
    tensors = _tensors(dtype, bad)
    lows, highs = multi_tensor_range(tensors)
    assert lows.shape == highs.shape == (len(tensors),)
    assert lows.dtype == highs.dtype == dtype
    for index, tensor in enumerate(tensors):
        found = _pair(lows[index], highs[index])
        if math.isnan(found[1]):  # the minima are reduced as integers: a nan max means a nan min, as it is read
            found = AbsRange().read(found)  # type: ignore[assignment]
        assert _same(found, _expected(tensor)), index
    assert math.copysign(1.0, lows[2].item()) == 1.0  # zero, not minus zero
    if bad is not None:
        assert _same((highs[3].item(),), (abs(bad),))  # nan stays nan, -inf reads inf


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_a_tensor_of_infs_only_has_an_infinite_minimum(dtype: torch.dtype) -> None:
    # CUDA's `_foreach_max` starts from the lowest finite value: a float max of the negated magnitudes would give that
    # (65504 for float16) instead of -inf. The minima are reduced as integers, whose lowest value no magnitude reaches.
    tensors = [torch.full((), math.inf, dtype=dtype), torch.tensor([-math.inf, math.inf], dtype=dtype)]
    reduced: list[torch.dtype] = []

    class Reductions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._foreach_max.default:
                reduced.append(args[0][0].dtype)
            return func(*args, **(kwargs or {}))

    with Reductions():
        lows, highs = multi_tensor_range(tensors)
    assert lows.tolist() == [math.inf, math.inf]
    assert highs.tolist() == [math.inf, math.inf]
    assert reduced[0] == dtype
    assert not reduced[1].is_floating_point


def test_multi_tensor_range_builds_no_graph_and_leaves_its_tensors_alone() -> None:
    weight = torch.nn.Parameter(torch.randn(4, 3))
    activation = torch.randn(5) * 3
    before = activation.clone()
    lows, highs = multi_tensor_range([weight, activation])
    assert not lows.requires_grad
    assert not highs.requires_grad
    assert torch.equal(activation, before)
    assert activation._version == 0


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_a_pool_measures_what_it_kept_when_first_read(dtype: torch.dtype) -> None:
    pool, owner = Pool(), Owner()
    tensors = _tensors(dtype, math.nan)
    found = [pool.keep(tensor, tensor._version, owner) for tensor in tensors]
    assert all(type(measurement) is PooledMeasurement for measurement in found)
    rows = found[0].rows  # type: ignore[union-attr]
    assert isinstance(rows, PooledRows)
    assert rows.open
    for measurement, tensor in zip(found, tensors, strict=True):
        assert measurement is not None
        assert measurement.shape == tuple(tensor.shape)
        assert measurement.dtype == dtype
        assert measurement.skipped is None
        assert measurement.is_float
        # As a report reads it: a nan max means a nan min (the minima are reduced as integers).
        assert _same(AbsRange().read(_pair(measurement.abs_min, measurement.abs_max)), _expected(tensor))  # type: ignore[arg-type]
    assert not rows.open  # measured once, and the tensors let go
    assert owner.pooled


def test_a_tensor_changed_in_place_before_it_was_measured_says_so_and_its_owner_stops_pooling() -> None:
    pool, masked, plain = Pool(), Owner(), Owner()
    scores = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    hidden = torch.tensor([0.5, -7.0])
    kept_scores = pool.keep(scores, scores._version, masked)
    kept_hidden = pool.keep(hidden, hidden._version, plain)
    assert kept_scores is not None
    assert kept_hidden is not None
    scores.masked_fill_(torch.tensor([[False, True], [False, False]]), -math.inf)  # the caller masks after the call
    assert kept_scores.skipped == CHANGED_AFTER_CALL
    assert kept_scores.abs_min is None
    assert kept_scores.abs_max is None
    assert not kept_scores.is_float
    assert _pair(kept_hidden.abs_min, kept_hidden.abs_max) == (0.5, 7.0)
    assert kept_hidden.skipped is None
    # Its row holds zeros: the -inf written after the call is neither shown nor screened.
    assert kept_scores.rows.highs.tolist() == [0.0, 7.0]
    assert not masked.pooled
    assert plain.pooled


def test_a_tensor_of_a_graph_is_kept_detached_and_its_later_change_is_seen() -> None:
    pool, owner = Pool(), Owner()
    weight = torch.nn.Parameter(torch.tensor([2.0, -3.0]))
    output = weight * 2
    kept = pool.keep(output, output._version, owner)
    assert kept is not None
    output.add_(1)  # an in-place change through the graph's own tensor
    assert kept.skipped == CHANGED_AFTER_CALL
    assert not owner.pooled


def test_a_pool_past_its_bound_measures_what_it_kept_and_starts_again() -> None:
    pool, owner = Pool(max_elements=10), Owner()
    first, second = torch.arange(6.0), -torch.arange(6.0) - 1
    kept_first = pool.keep(first, first._version, owner)
    kept_second = pool.keep(second, second._version, owner)
    assert kept_first is not None
    assert kept_second is not None
    assert not kept_first.rows.open  # launched when the second would have passed the bound, and let go
    assert kept_second.rows is not kept_first.rows
    assert kept_second.rows.open
    first.mul_(2)  # after its measurement: what was measured stays
    assert _pair(kept_first.abs_min, kept_first.abs_max) == (0.0, 5.0)
    assert _pair(kept_second.abs_min, kept_second.abs_max) == (1.0, 6.0)


def test_a_pool_refuses_what_it_cannot_measure_whole() -> None:
    pool, owner = Pool(max_elements=100), Owner()
    assert pool.keep(torch.randn(101), 0, owner) is None  # past the bound on its own
    assert pool.keep(torch.arange(6), 0, owner) is None  # an integer dtype
    assert pool.keep(torch.randn(4, 5).t(), 0, owner) is None  # not contiguous: a multi-tensor kernel's slow path
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(pool.keep(torch.randn(3), 0, owner)))
    thread.start()
    thread.join()
    assert found == [None]  # another thread's (DataParallel's replicas)


def test_probes_pool_an_owner_whose_tensors_nothing_changed_and_only_one_probed_whole() -> None:
    pool = Pool(max_elements=10)
    changed, unchanged, too_big = Owner(False, False), Owner(False, False), Owner(False, False)
    output = torch.randn(3)
    pool.probe(output, output._version, changed, measure(output))
    kept = torch.randn(3)
    pool.probe(kept, kept._version, unchanged, measure(kept))
    big = torch.randn(20)
    pool.probe(big, 0, too_big, measure(big))  # past the room left: not judged at this check
    output.relu_()
    del output  # changed, then let go: changed all the same
    pool.judge()
    assert (changed.pool_judged, changed.pooled) == (True, False)
    assert (unchanged.pool_judged, unchanged.pooled) == (True, True)
    assert (too_big.pool_judged, too_big.pooled) == (False, False)
    small = torch.randn(5)
    pool.probe(small, 0, too_big, measure(small))  # its next recorded batch, within the room
    pool.judge()
    assert (too_big.pool_judged, too_big.pooled) == (True, True)


def test_kept_tensors_and_probes_share_one_bound() -> None:
    pool, pooled, new = Pool(max_elements=10), Owner(), Owner(False, False)
    first = torch.randn(6)
    kept = pool.keep(first, first._version, pooled)
    assert kept is not None
    probed = torch.randn(6)
    pool.probe(probed, 0, new, measure(probed))  # no room beside what is kept: that is launched and let go first
    assert not kept.rows.open
    assert pool.keep(torch.randn(6), 0, pooled) is None  # no room beside the probe: measured as it is seen
    assert pool.keep(torch.randn(4), 0, pooled) is not None
    pool.judge()  # the probes let go: the room is the pool's again
    assert pool.keep(torch.randn(9), 0, pooled) is not None


def test_a_write_no_version_counter_sees_in_a_first_batch_keeps_the_module_from_being_pooled() -> None:
    pool = Pool()
    masked_through_data, written_by_a_kernel, plain, deferred_refused = (Owner(False, False) for _ in range(4))
    scores, logits, hidden, other = (torch.randn(4, 6) for _ in range(4))
    for tensor, owner in [
        (scores, masked_through_data),
        (logits, written_by_a_kernel),
        (hidden, plain),
        (other, deferred_refused),
    ]:
        pool.probe(tensor, tensor._version, owner, measure(tensor))
    scores.data.masked_fill_(scores.data > 0, -math.inf)  # `.data`: a counter of its own, this one's never moves
    torch.ops.aten.mul_.Tensor(logits.data, 0.5)  # as a custom kernel writing into its input would
    deferred_refused.changed = True  # the deferral saw an output of this module changed in place meanwhile
    assert scores._version == logits._version == 0
    pool.judge()
    assert (masked_through_data.pool_judged, masked_through_data.pooled) == (True, False)
    assert (written_by_a_kernel.pool_judged, written_by_a_kernel.pooled) == (True, False)
    assert (plain.pool_judged, plain.pooled) == (True, True)
    assert (deferred_refused.pool_judged, deferred_refused.pooled) == (True, False)


def test_a_kept_tensor_is_not_reached_by_data_assignment_on_the_callers_object() -> None:
    pool, owner = Pool(), Owner()
    output = torch.tensor([1.0, -2.0])
    kept = pool.keep(output, output._version, owner)
    assert kept is not None
    output.data = torch.tensor([math.nan, 5.0])  # the caller's object now holds other values; what was returned stays
    assert _pair(kept.abs_min, kept.abs_max) == (1.0, 2.0)
    assert owner.pooled


def test_the_bound_counts_the_storage_a_view_keeps_alive() -> None:
    pool, owner = Pool(max_elements=100), Owner()
    base = torch.randn(10, 20)
    assert pool.keep(base[0], base._version, owner) is None  # 20 elements, but 200 kept alive
    assert pool.keep(torch.randn(20), 0, owner) is not None


def test_what_is_kept_when_watching_ends_is_let_go_unmeasured_and_says_so() -> None:
    pool, owner = Pool(), Owner()
    output = torch.randn(5)
    kept = pool.keep(output, output._version, owner)
    assert kept is not None
    pool.drop()
    assert not kept.rows.open
    assert kept.skipped == WATCH_ENDED
    assert kept.abs_min is None
    assert kept.abs_max is None
    assert not kept.is_float
    assert kept.rows.highs.tolist() == [0.0]  # read whole, nothing screened


def test_a_device_that_refuses_every_measurement_leaves_lines_that_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanwatch.core.stats import pooled

    def refuses(*args: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(pooled, "multi_tensor_range", refuses)
    monkeypatch.setattr(pooled, "abs_aminmax", refuses)
    pool, owner = Pool(), Owner()
    kept = [pool.keep(tensor, 0, owner) for tensor in (torch.randn(3), torch.randn(4))]
    assert all(measurement is not None for measurement in kept)
    assert [measurement.skipped for measurement in kept] == ["not measured: RuntimeError"] * 2  # type: ignore[union-attr]
    assert kept[0].abs_max is None  # type: ignore[union-attr]


def test_only_the_thread_that_made_a_pool_probes() -> None:
    pool, owner = Pool(), Owner(False, False)
    tensor = torch.randn(3)
    thread = threading.Thread(target=lambda: pool.probe(tensor, 0, owner, measure(tensor)))
    thread.start()
    thread.join()
    pool.judge()
    assert not owner.pool_judged  # a replica's call (DataParallel) is no probe of the module


@pytest.mark.cpu_path
def test_the_accelerator_path_is_taken_on_the_cpu_only_while_counting() -> None:
    tensor = torch.randn(3)
    assert not multi_tensor_kernels(tensor)
    with cpu_as_accelerator():
        assert multi_tensor_kernels(tensor)
    assert not multi_tensor_kernels(tensor)


def test_the_cache_pools_a_modules_activations_only_after_its_first_batch_was_judged() -> None:
    cache, owner = StatsCache(), Owner(False, False)
    with cpu_as_accelerator():
        cache.owner = owner
        first = torch.randn(64, 128)
        measured = cache.activation(first)
        assert type(measured) is not PooledMeasurement  # measured as it was seen: its first batch
        cache.owner = None
        cache.judge_pool_probes()
        assert owner.pooled
        cache.forget_activations()
        cache.owner = owner
        second = torch.randn(64, 128)
        pooled = cache.activation(second)
        assert type(pooled) is PooledMeasurement
        assert cache.activation(second) is pooled  # seen again unchanged: the same measurement
        cache.owner = None
        outside = cache.activation(torch.randn(64, 128))  # no module's call (a loss, the deferral's input)
        assert type(outside) is not PooledMeasurement
    assert _same(_pair(pooled.abs_min, pooled.abs_max), _expected(second))


def test_parameters_on_an_accelerator_are_measured_in_multi_tensor_groups_of_any_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nanwatch.core.stats import grouped

    monkeypatch.setattr(grouped, "GROUP_MAX_ELEMENTS", 300)  # a group holds at most 300 elements
    generator = torch.Generator().manual_seed(1)
    tensors: list[torch.Tensor] = [
        torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype))
        for shape, dtype in [
            ((16, 8), torch.float32),
            ((8,), torch.float32),
            ((4, 3), torch.bfloat16),
            ((200,), torch.float32),
            ((7,), torch.bfloat16),
            ((500,), torch.float32),  # past a group's bound: measured alone
        ]
    ]
    tensors.append(torch.nn.Parameter(torch.arange(3), requires_grad=False))  # no floating point: measured alone
    with torch.no_grad():
        tensors[1][3] = math.inf
    with cpu_as_accelerator():
        plan = StackPlan(tensors)
        found = plan.measure()
    assert all(shape is None for _, _, shape in plan.stacks)  # no stack by shape
    assert len(plan.stacks) == 3  # float32 in two groups of at most 300 elements, bfloat16 in one
    assert sorted(plan.alone) == [5, 6]
    for tensor, measurement in zip(tensors, found, strict=True):
        expected = measure(tensor)
        assert measurement.shape == expected.shape
        assert measurement.dtype == expected.dtype
        assert _same(_pair(measurement.abs_min, measurement.abs_max), _pair(expected.abs_min, expected.abs_max))
    assert type(found[0]) is StackedMeasurement
