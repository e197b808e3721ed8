"""core/stats/measure.py, stacking.py, readback.py, cache.py: exact abs-min/abs-max for every dtype, a reason
instead of a crash for odd tensors, the one-read inf/nan check, and a cache that never serves a stale measurement."""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nanwatch.core.frames import Entry, Frame, RecordedFrame, Role, resolve
from nanwatch.core.report import format_entry
from nanwatch.core.stats.cache import StatsCache
from nanwatch.core.stats.grouped import MagnitudePlan, as_vector
from nanwatch.core.stats.kernels import FLOAT8_DTYPES, count_non_finite
from nanwatch.core.stats.measure import Measurement, measure
from nanwatch.core.stats.readback import fold, holds_non_finite, read_flags


def find_non_finite(frames: list[Frame]) -> bool:
    return holds_non_finite(entry.measurement for frame in frames for entry in frame.entries if entry.measurement)


def _mixed(dtype: torch.dtype, n: int = 257) -> torch.Tensor:
    """Signed values spanning many magnitudes (subnormals and near-max values included where the dtype has them)."""
    generator = torch.Generator().manual_seed(0)
    if dtype.is_complex:
        real = torch.randn(n, generator=generator, dtype=torch.float64) * 100
        imag = torch.randn(n, generator=generator, dtype=torch.float64) * 0.01
        return torch.complex(real, imag).to(dtype)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        exponents = torch.linspace(-6, 4, n, dtype=torch.float64)
        signs = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0).to(torch.float64)
        values = (signs * 10**exponents).to(dtype)
        values[3] = -info.max
        values[7] = info.tiny / 4  # subnormal
        return values
    info = torch.iinfo(dtype)
    low = max(info.min + 1, -1000)  # abs(iinfo.min) overflows: transformers would print a negative abs-min too
    return torch.randint(low, min(info.max, 1000), (n,), generator=generator, dtype=dtype)


EXACT_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=str)
def test_abs_min_and_max_are_exactly_those_of_abs(dtype: torch.dtype) -> None:
    tensor = _mixed(dtype)
    m = measure(tensor)
    assert m.skipped is None
    assert m.abs_min is not None
    assert m.abs_max is not None
    # torch.equal also compares dtypes: the numbers are the ones `t.abs().min()` gives, not an fp32 approximation.
    assert torch.equal(m.abs_min, tensor.abs().min())
    assert torch.equal(m.abs_max, tensor.abs().max())
    assert m.abs_min.dim() == 0
    assert m.abs_max.dim() == 0
    assert m.dtype == dtype
    assert m.shape == (257,)


def test_non_contiguous_scalar_and_grad_requiring_tensors() -> None:
    base = torch.arange(-12.0, 12.0).reshape(4, 6)
    transposed = base.t()[::2]
    m = measure(transposed)
    assert torch.equal(m.abs_min, transposed.abs().min())
    assert torch.equal(m.abs_max, transposed.abs().max())
    assert m.shape == (3, 4)

    scalar = measure(torch.tensor(-2.5))
    assert scalar.shape == ()
    assert scalar.abs_min is not None
    assert scalar.abs_min.item() == 2.5

    weight = torch.nn.Parameter(torch.tensor([-3.0, 0.25]))
    measured = measure(weight)
    assert measured.abs_max is not None
    assert not measured.abs_max.requires_grad
    assert measured.abs_max.item() == 3.0


def _line(tensor: torch.Tensor, label: str = "x") -> str:
    frame = RecordedFrame("m", "M", 0, entries=[Entry(label, Role.INPUT, measure(tensor))])
    return format_entry(resolve([frame])[0].entries[0])


def test_bool_tensor_gives_zero_one_line() -> None:
    m = measure(torch.tensor([[True, False], [False, False]]))
    assert m.abs_min is not None
    assert m.abs_max is not None
    assert (m.abs_min.item(), m.abs_max.item()) == (0, 1)
    assert not m.is_float
    assert _line(torch.tensor([True, False])) == "0.00e+00 1.00e+00 x"
    assert _line(torch.zeros(3, dtype=torch.bool)) == "0.00e+00 0.00e+00 x"


@pytest.mark.parametrize("dtype", sorted((d for d in FLOAT8_DTYPES if "e8m0" not in str(d)), key=str), ids=str)
def test_float8_is_measured_exactly(dtype: torch.dtype) -> None:
    source = torch.tensor([0.5, -2.0, 0.015625, -240.0, 3.0])
    tensor = source.to(dtype)
    m = measure(tensor)
    reference = tensor.float().abs()
    assert m.abs_min is not None
    assert m.abs_max is not None
    assert m.abs_min.item() == reference.min().item()
    assert m.abs_max.item() == reference.max().item()
    assert m.dtype == dtype
    assert _line(tensor) == f"{reference.min().item():8.2e} {reference.max().item():8.2e} x"


def test_float8_nan_and_inf_are_detected() -> None:
    with_nan = torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)  # e4m3fn has nan but no inf
    with_inf = torch.tensor([1.0, float("-inf")]).to(torch.float8_e5m2)
    for tensor in (with_nan, with_inf):
        frame = RecordedFrame("m", "M", 0, entries=[Entry("x", Role.INPUT, measure(tensor))])
        assert find_non_finite([frame])
        assert resolve([frame])[0].non_finite


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        (torch.empty(0), "empty"),
        (torch.empty(3, 0, 2, dtype=torch.float16), "empty"),
        (torch.nn.Parameter(torch.empty(0)), "empty"),
        (torch.empty(4, 4, device="meta"), "meta: not measured"),
        (torch.zeros(3, 3).to_sparse(), "sparse_coo: empty"),
    ],
    ids=["empty", "empty-3d", "empty-parameter", "meta", "sparse-of-zeros"],
)
def test_unmeasurable_tensors_are_skipped_with_a_reason(tensor: torch.Tensor, reason: str) -> None:
    m = measure(tensor)
    assert m.skipped == reason
    assert m.abs_min is None
    assert m.abs_max is None
    assert m.shape == tuple(tensor.shape)
    assert _line(tensor, "weight") == f"{reason:>17} weight"


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32], ids=str)
def test_wide_unsigned_integers_are_measured_exactly(dtype: torch.dtype) -> None:
    # Before: NotImplementedError ("abs_cpu" not implemented for 'UInt16'), which stopped the watching.
    top = torch.iinfo(dtype).max
    tensor = torch.tensor([[7, top], [12, 40000]]).to(dtype)  # built from int64: the dtypes have few CPU kernels
    m = measure(tensor)
    assert m.skipped is None
    assert m.abs_min is not None
    assert m.abs_max is not None
    assert (m.abs_min.item(), m.abs_max.item()) == (7, top)  # every uint32 fits int64 exactly
    assert m.dtype == dtype
    assert m.shape == (2, 2)
    assert _line(tensor) == f"7.00e+00 {float(top):8.2e} x"
    assert not find_non_finite([RecordedFrame("m", "M", 0, entries=[Entry("x", Role.INPUT, m)])])


def test_uint64_is_marked_not_measured() -> None:
    # No kernel reduces uint64 on the CPU, and its values do not all fit int64: a note, never an error.
    tensor = torch.tensor([1, 2**62]).to(torch.uint64)
    m = measure(tensor)
    assert m.skipped == "uint64 not measured"
    assert m.abs_min is None
    assert m.abs_max is None
    assert m.dtype == torch.uint64
    assert _line(tensor, "output") == "uint64 not measured output"
    assert not find_non_finite([RecordedFrame("m", "M", 0, entries=[Entry("x", Role.INPUT, m)])])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensor_is_measured_over_all_its_components() -> None:
    # An eval-mode nn.TransformerEncoder with a padding mask passes nested tensors between its layers.
    nested = torch.nested.nested_tensor([torch.tensor([0.5, -1.0]), torch.tensor([3.0, -0.25, 2.0])])
    assert _values(StatsCache().activation(nested)) == (0.25, 3.0)
    assert _line(nested) == "2.50e-01 3.00e+00 x (nested: values)"
    nested_inf = torch.nested.as_nested_tensor([torch.ones(2), torch.full((3,), float("-inf"))], layout=torch.jagged)
    frame = RecordedFrame("m", "M", 0, entries=[Entry("x", Role.INPUT, measure(nested_inf))])
    assert find_non_finite([frame])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize(
    "to_sparse",
    [
        lambda t: t.to_sparse(),
        lambda t: t.to_sparse_csr(),
        lambda t: t.to_sparse_csc(),
        lambda t: t.to_sparse_bsr((2, 2)),
        lambda t: t.to_sparse_bsc((2, 2)),
    ],
    ids=["coo", "csr", "csc", "bsr", "bsc"],
)
def test_sparse_tensors_are_measured_on_their_stored_values(to_sparse: Callable[[torch.Tensor], torch.Tensor]) -> None:
    dense = torch.tensor([[0.0, 0.5, 0.0, 0.0], [-4.0, 0.0, 0.0, 0.25]])
    sparse = to_sparse(dense)
    kind = str(sparse.layout).removeprefix("torch.")
    m = measure(sparse)
    # The values stored (a block format stores the zeros of its blocks too), not the zeros left out.
    stored = (0.0 if kind in ("sparse_bsr", "sparse_bsc") else 0.25, 4.0)
    assert (m.skipped, m.note, m.shape) == (None, f"{kind}: values", (2, 4))
    assert _values(m) == stored
    assert _line(sparse, "output") == f"{stored[0]:8.2e} {stored[1]:8.2e} output ({kind}: values)"
    assert not find_non_finite([RecordedFrame("m", "M", 0, entries=[Entry("x", Role.OUTPUT, m)])])
    dense[1, 0] = math.nan
    with_nan = to_sparse(dense)
    assert find_non_finite([RecordedFrame("m", "M", 0, entries=[Entry("x", Role.OUTPUT, measure(with_nan))])])
    assert count_non_finite(with_nan).tolist() == [1, 0]
    extra = measure(with_nan, (("non_finite_counts", count_non_finite),)).extra
    assert extra is not None
    assert extra["non_finite_counts"].tolist() == [1, 0]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensors_are_measured_on_their_components_only() -> None:
    # A jagged tensor narrowed from a padded one keeps the whole buffer: only the components' elements are measured.
    padded = torch.tensor([[1.0, 2.0, 9.0], [math.nan, 3.0, 4.0]])
    narrowed = torch.nested.narrow(padded, 1, torch.tensor([0, 1]), torch.tensor([2, 2]), layout=torch.jagged)
    m = measure(narrowed)
    assert (m.note, m.shape) == ("nested: values", None)
    assert _values(m) == (1.0, 4.0)
    empty = torch.nested.nested_tensor([], layout=torch.strided)
    assert measure(empty).skipped == "nested: empty"


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_tensor_is_measured_on_its_values() -> None:
    tensor = torch.quantize_per_tensor(torch.tensor([-1.0, 0.5, 0.2]), 0.1, 0, torch.qint8)
    m = measure(tensor)
    reference = tensor.dequantize().abs()
    assert m.abs_min is not None
    assert m.abs_max is not None
    assert torch.equal(m.abs_min, reference.min())
    assert torch.equal(m.abs_max, reference.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.complex64], ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nan_and_inf_are_detected(dtype: torch.dtype, bad: float) -> None:
    tensor = torch.tensor([1.0, -2.0, 3.0]).to(dtype)
    tensor[1] = bad
    frame = RecordedFrame("m", "M", 0, entries=[Entry("x", Role.INPUT, measure(tensor))])
    assert find_non_finite([frame])
    entry = resolve([frame])[0].entries[0]
    assert entry.non_finite
    expected = "nan" if bad != bad else "inf"
    assert format_entry(entry).split()[1] == expected


def test_fp16_overflow_from_arithmetic_is_detected() -> None:
    big = torch.full((4,), 60000.0, dtype=torch.float16)
    frame = RecordedFrame("m", "M", 0, entries=[Entry("x", Role.INPUT, measure(big * 2))])
    assert find_non_finite([frame])


def test_integer_and_bool_tensors_are_never_non_finite() -> None:
    frame = RecordedFrame(
        "m",
        "M",
        0,
        entries=[
            Entry("i", Role.INPUT, measure(torch.tensor([2**62, -(2**62)]))),
            Entry("b", Role.INPUT, measure(torch.ones(2).bool())),
        ],
    )
    assert not find_non_finite([frame])


# ------------------------------------------------------------------------------------------------ StatsCache


def _values(m: Measurement) -> tuple[float, float]:
    assert m.abs_min is not None
    assert m.abs_max is not None
    return m.abs_min.item(), m.abs_max.item()


def _abs_range(tensor: torch.Tensor) -> tuple[float, float]:
    return tensor.detach().abs().min().item(), tensor.detach().abs().max().item()


def test_cache_measures_an_unchanged_parameter_once() -> None:
    cache = StatsCache()
    weight = torch.nn.Parameter(torch.tensor([1.0, -4.0]))
    first = cache.parameter(weight)
    assert cache.parameter(weight) is first


def test_cache_remeasures_a_parameter_changed_in_place() -> None:
    cache = StatsCache()
    weight = torch.nn.Parameter(torch.tensor([1.0, -4.0]))
    cache.parameter(weight)
    with torch.no_grad():
        weight.mul_(3)
    assert _values(cache.parameter(weight)) == (3.0, 12.0)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.5, foreach=False),
        lambda params: torch.optim.SGD(params, lr=0.5, foreach=True),
        lambda params: torch.optim.Adam(params, lr=0.5, foreach=True),
    ],
    ids=["sgd", "sgd-foreach", "adam-foreach"],
)
def test_cache_remeasures_after_an_optimizer_step(make_optimizer: Callable[..., torch.optim.Optimizer]) -> None:
    layer = torch.nn.Linear(4, 3)
    optimizer = make_optimizer(layer.parameters())
    cache = StatsCache()
    cache.parameter(layer.weight)
    layer(torch.randn(2, 4)).pow(2).sum().backward()
    optimizer.step()
    assert _values(cache.parameter(layer.weight)) == _abs_range(layer.weight)


def test_forget_parameters_catches_writes_that_bypass_the_version_counter() -> None:
    # A fused optimizer and `p.data.add_()` write the weights without bumping `_version`: no key can see that, so
    # the watcher drops parameter measurements at each batch boundary (tests/core/test_watcher.py checks it does).
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True)
    cache = StatsCache()
    cache.parameter(layer.weight)
    layer(torch.randn(2, 4)).pow(2).sum().backward()
    optimizer.step()
    layer.bias.data.add_(10.0)
    cache.forget_parameters()
    assert _values(cache.parameter(layer.weight)) == _abs_range(layer.weight)
    assert _values(cache.parameter(layer.bias)) == _abs_range(layer.bias)


def test_cache_remeasures_after_data_is_replaced_by_half_and_to() -> None:
    layer = torch.nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-1.001, 1.0, 12).reshape(3, 4))
    weight = layer.weight
    cache = StatsCache()
    assert cache.parameter(weight).dtype == torch.float32

    layer.half()  # replaces `.data`: same Parameter object, same `_version`, new storage and dtype
    assert layer.weight is weight
    m = cache.parameter(weight)
    assert m.dtype == torch.float16
    assert m.abs_max is not None
    assert m.abs_max.dtype == torch.float16
    assert torch.equal(m.abs_max, weight.detach().abs().max())

    layer.to(torch.float64)
    m = cache.parameter(weight)
    assert m.dtype == torch.float64
    assert m.abs_max is not None
    assert torch.equal(m.abs_max, weight.detach().abs().max())


def test_cache_remeasures_after_data_is_assigned_same_dtype() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    cache = StatsCache()
    assert _values(cache.parameter(weight)) == (1.0, 1.0)
    weight.data = torch.full((3,), -7.0)
    assert _values(cache.parameter(weight)) == (7.0, 7.0)


def test_cache_remeasures_an_activation_changed_in_place_and_keeps_the_old_numbers() -> None:
    cache = StatsCache()
    activation = torch.tensor([-5.0, 2.0, -0.5])
    before = cache.activation(activation)
    assert cache.activation(activation) is before
    torch.nn.ReLU(inplace=True)(activation)
    after = cache.activation(activation)
    assert after is not before
    assert _values(before) == (0.5, 5.0)  # what was recorded before the in-place op stays as it was
    assert _values(after) == (0.0, 2.0)


def test_cache_does_not_keep_activations_alive_and_ignores_reused_ids() -> None:
    cache = StatsCache()
    tensor = torch.full((8,), 3.0)
    cache.activation(tensor)
    ref = weakref.ref(tensor)
    del tensor
    gc.collect()
    assert ref() is None
    for value in range(1, 30):  # freed tensors' ids get reused; each new tensor must get its own numbers
        assert _values(cache.activation(torch.full((8,), float(value)))) == (value, value)


def test_cache_handles_inference_tensors() -> None:
    cache = StatsCache()
    with torch.inference_mode():
        tensor = torch.tensor([-1.0, 4.0])
        assert _values(cache.activation(tensor)) == (1.0, 4.0)
        tensor.mul_(2)
        assert _values(cache.activation(tensor)) == (2.0, 8.0)


def test_cache_handles_parameters_of_a_model_built_under_inference_mode() -> None:
    with torch.inference_mode():
        layer = torch.nn.Linear(2, 2)
        cache = StatsCache()
        assert _values(cache.parameter(layer.weight)) == _abs_range(layer.weight)
        layer.weight.mul_(4)  # no version counter to show this: inference parameters are measured every time
        assert _values(cache.parameter(layer.weight)) == _abs_range(layer.weight)


def test_cache_clear_forgets_parameters() -> None:
    cache = StatsCache()
    weight = torch.nn.Parameter(torch.ones(2))
    first = cache.parameter(weight)
    cache.clear()
    assert cache.parameter(weight) is not first


# ------------------------------------------------------------------------------------------------ the one read


def _frame(name: str, *tensors: torch.Tensor) -> Frame:
    return RecordedFrame(
        name, "Linear", 0, entries=[Entry(f"input[{i}]", Role.INPUT, measure(t)) for i, t in enumerate(tensors)]
    )


def test_the_check_on_clean_frames() -> None:
    frames = [_frame("a", torch.randn(4, 4)), _frame("b", torch.randn(3).half(), torch.randn(2).bfloat16())]
    assert not find_non_finite(frames)
    assert not find_non_finite([])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_check_sees_one_bad_value_among_many(bad: float, dtype: torch.dtype) -> None:
    clean = [_frame(f"l{i}", torch.randn(8)) for i in range(5)]
    dirty = torch.randn(100).to(dtype)
    dirty[57] = bad
    frames = [*clean[:3], _frame("culprit", torch.randn(3).half(), dirty), *clean[3:]]
    assert find_non_finite(frames)


def test_the_check_ignores_notes_skipped_integer_and_bool_entries() -> None:
    frame = RecordedFrame(
        "m",
        "M",
        0,
        entries=[
            Entry("input[0]", Role.INPUT, note="None"),
            Entry("input[1]", Role.INPUT, note="not a tensor"),
            Entry("weight", Role.PARAMETER, measure(torch.empty(0))),
            Entry("input[2]", Role.INPUT, measure(torch.empty(3, device="meta"))),
            Entry("input[3]", Role.INPUT, measure(torch.tensor([1, -(2**40)]))),
            Entry("output", Role.OUTPUT, measure(torch.tensor([True, False]))),
        ],
    )
    assert not find_non_finite([frame])


def test_read_flags_names_the_owners_of_the_flags_that_tripped() -> None:
    flags = [(torch.tensor(True), "a"), (torch.tensor(False), "b"), (torch.tensor(False), "c")]
    assert read_flags(flags) == ["b", "c"]
    assert read_flags([]) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_fold_names_what_tripped_among_values_vectors_and_flags_of_several_dtypes(bad: float) -> None:
    """Values (signed, as a min is), vectors and bool flags, float32 and bfloat16: one summary to read, a level of 0
    or nan per dtype, and the owners of exactly the parts that tripped."""
    fine32 = [torch.tensor(-3.0), torch.tensor(2.0)]
    bad32 = [torch.tensor(1.0), torch.tensor(bad)]
    vector16 = torch.tensor([0.5, bad, 7.0], dtype=torch.bfloat16)
    parts = [
        (fine32, "fine"),
        (bad32, "bad values"),
        (vector16, "bad vector"),
        (torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "fine vector"),
        (torch.tensor(True), "fine flag"),
        (torch.tensor(False), "tripped flag"),
    ]
    [folded] = fold(parts)
    levels = folded.summary.tolist()
    assert len(levels) == 3  # float32, bfloat16, the flags
    assert all(math.isnan(level) for level in levels)
    assert read_flags(parts) == ["bad values", "bad vector", "tripped flag"]
    clean = [(fine32, "fine"), (torch.tensor([1.0, 2.0]), "fine vector"), (torch.tensor(True), "fine flag")]
    assert fold(clean)[0].summary.tolist() == [0.0, 0.0]
    assert read_flags(clean) == []


def test_fold_of_one_dtype_is_three_device_ops_however_many_parts() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if "view" not in func.__name__ and "reshape" not in func.__name__:
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    parts = [([torch.tensor(float(i)) for i in range(50)], "a"), ([torch.tensor(-1.0), torch.tensor(2.0)], "b")]
    with Count() as count:
        fold(parts)
    assert [op.split(".")[0] for op in count.ops] == ["stack", "mul_", "sum"]


@pytest.mark.parametrize("many", [False, True], ids=["few: two foreach ops", "many: stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
def test_magnitude_plan_gives_abs_amax_stacked_or_alone(dtype: torch.dtype, bad: float | None, many: bool) -> None:
    torch.manual_seed(0)
    # Small tensors of one shape are stacked together (the bad value in the middle one), the large one is alone, and
    # a second dtype's tensors are combined apart.
    small = [torch.randn(3, 5, dtype=dtype) * 10**index for index in range(3)]
    large = torch.randn(70_000, dtype=dtype)
    other = [torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64) - 5]
    one_of_a_shape = torch.randn(7, dtype=dtype)
    if bad is not None:
        small[1][2, 3] = bad
        large[12_345] = bad
    tensors = [small[0], large, other[0], small[1], one_of_a_shape, other[1], small[2]]
    # Many tiny tensors on the CPU (a model of thousands of layers): stacked, not looped over one by one.
    tensors += [torch.randn(2, dtype=dtype) for _ in range(300 if many else 0)]
    plan = MagnitudePlan(tensors)
    assert plan.stacked == (many and not plan.accelerated)  # an accelerator's path: one multi-tensor op for any number
    groups = plan.launch(tensors)
    found: dict[int, torch.Tensor] = {}
    for indices, values in groups:
        vector = as_vector(values)
        assert vector.shape == (len(indices),)
        found.update(zip(indices, vector.unbind(), strict=True))
    assert sorted(found) == list(range(len(tensors)))  # each tensor once
    for index, tensor in enumerate(tensors):
        value = found[index]
        expected = tensor.abs().amax()
        assert value.shape == ()
        assert value.dtype == tensor.dtype
        assert torch.equal(value, expected) or (value.isnan() and expected.isnan()), (tensor.shape, value, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
def test_magnitude_plan_bounds_are_finite_exactly_when_the_tensors_are(dtype: torch.dtype, bad: float | None) -> None:
    """`exact=False` (the host's screen on the CPU): one bound per tensor, not finite for the tensor holding inf or
    nan, finite for the others, float16's largest values included (its bounds are taken in float32)."""
    torch.manual_seed(0)
    tensors = [torch.randn(50, 40, dtype=dtype) for _ in range(4)]
    tensors[1].fill_(torch.finfo(dtype).max if dtype == torch.float16 else 1e4)
    if bad is not None:
        tensors[2][7, 3] = bad
    groups = MagnitudePlan(tensors).launch(tensors, exact=False)
    found: dict[int, float] = {}
    for indices, values in groups:
        found.update(zip(indices, as_vector(values).tolist(), strict=True))
    assert sorted(found) == [0, 1, 2, 3]
    for index, value in found.items():
        assert math.isfinite(value) == (bad is None or index != 2), (index, value)
