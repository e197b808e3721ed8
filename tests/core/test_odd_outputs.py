"""Odd outputs never turn watching off: a module that returns a sparse, nested, meta, empty, float8, quantized,
complex or DTensor output gets a line that says what was measured, and a nan in another module of the same model is
still found at its batch, in full mode (with and without gradients) and in sentinel mode. Where the odd tensor holds
values they are measured (a sparse tensor's stored values, a nested tensor's components, float8 upcast, a complex
tensor's magnitudes, a quantized tensor dequantized), so a nan inside it is found too."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests.models import Scale
from torch import nn

from nanwatch import NonFiniteError, WatchHandle, watch
from nanwatch.core.frames import Direction, resolve
from nanwatch.core.report import format_entry

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
]

Make = Callable[[torch.Tensor], Any]


@pytest.fixture
def mesh() -> Iterator[Any]:
    """A one-rank gloo group in this process (no port: an in-memory store), gone after the test."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _dtensor(mesh: Any) -> Make:
    from torch.distributed.tensor import DTensor, Shard

    return lambda h: DTensor.from_local(h, mesh, [Shard(0)], run_check=False)


# Each odd kind: how a module makes it from a (2, 4) float32 tensor, and the output line's text after the numbers
# (None: a line without numbers, whose text is given instead).
KINDS: dict[str, tuple[Make, str | None, str | None]] = {
    "sparse_coo": (lambda h: h.to_sparse(), "output (sparse_coo: values)", None),
    "sparse_csr": (lambda h: h.to_sparse_csr(), "output (sparse_csr: values)", None),
    "sparse_csc": (lambda h: h.to_sparse_csc(), "output (sparse_csc: values)", None),
    "sparse_bsr": (lambda h: h.to_sparse_bsr((2, 2)), "output (sparse_bsr: values)", None),
    "nested_strided": (
        lambda h: torch.nested.nested_tensor([h[0, :3], h[1]], layout=torch.strided),
        "output (nested: values)",
        None,
    ),
    "nested_jagged": (
        lambda h: torch.nested.nested_tensor([h[0, :3], h[1]], layout=torch.jagged),
        "output (nested: values)",
        None,
    ),
    "meta": (lambda h: torch.empty(h.shape, device="meta"), None, "meta: not measured output"),
    "empty": (lambda h: h[:, :0], None, "            empty output"),
    "float8_e4m3fn": (lambda h: h.to(torch.float8_e4m3fn), "output", None),
    "float8_e5m2": (lambda h: h.to(torch.float8_e5m2), "output", None),
    "quantized": (lambda h: torch.quantize_per_tensor(h.detach(), 0.01, 0, torch.qint8), "output", None),
    "complex64": (lambda h: torch.complex(h, -h), "output", None),
    "dtensor": (lambda h: h, "output", None),  # made with the `mesh` fixture (`_make`)
}


def _make(kind: str, request: pytest.FixtureRequest) -> Make:
    return _dtensor(request.getfixturevalue("mesh")) if kind == "dtensor" else KINDS[kind][0]


class Odd(nn.Module):
    """Returns an odd tensor made from its input; while `plain`, its input doubled instead."""

    def __init__(self, make: Make, *, plain: bool = False) -> None:
        super().__init__()
        self.make, self.plain = make, plain

    def forward(self, h: torch.Tensor) -> Any:
        return h * 2 if self.plain else self.make(h)


class Model(nn.Module):
    """`odd` gets the first layer's output and returns an odd tensor nothing uses; `scale` and `head` go on with the
    plain one (`scale.factor = nan` puts a nan there)."""

    def __init__(self, make: Make, *, plain: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.odd = Odd(make, plain=plain)
        self.scale = Scale()
        self.head = nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.parameters(), lr=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        self.odd(h)
        return self.head(self.scale(h))


def _output_line(handle: WatchHandle, module_name: str) -> str:
    frames = resolve(handle.watcher.recent_frames())
    frame = [f for f in frames if f.module_name == module_name and f.direction is Direction.FORWARD][-1]
    (entry,) = (e for e in frame.entries if e.label == "output")
    return format_entry(entry)


def _watch(model: Model, **options: Any) -> WatchHandle:
    return watch(model, optimizer=model.optimizer, **options)


def _run(model: Model, handle: WatchHandle | None, batches: int, *, nan_at: int = -1, odd_from: int = 0) -> list[float]:
    """Train `batches` micro-batches (a nan in `scale` from batch `nan_at`, `odd` odd from batch `odd_from`), watched
    by `handle` or not; the losses of the batches that ran through."""
    optimizer = model.optimizer
    losses = []
    for batch in range(batches):
        model.odd.plain = batch < odd_from
        if batch == nan_at:
            model.scale.factor = math.nan
        loss = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(batch))).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if handle is not None:
            handle.step()
        losses.append(loss.item())
    return losses


MODES = {
    "full": {},
    "full-gradients": {"watch_gradients": True},
    "sentinel": {"mode": "sentinel"},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_odd_output_never_stops_watching_and_a_later_nan_elsewhere_is_found(
    kind: str, mode: str, request: pytest.FixtureRequest
) -> None:
    make = _make(kind, request)
    model = Model(make)
    with _watch(model, **MODES[mode]) as handle:
        clean = _run(model, handle, 3)  # batches 0-2: the odd module's calls probed, then deferrable
        assert handle.watcher.disabled_reason is None
        if mode != "sentinel":
            expected, text = KINDS[kind][1:]
            line = _output_line(handle, "odd")
            if expected is None:
                assert line == text
            else:
                assert line.endswith(f" {expected}")
                assert "nan" not in line
        with pytest.raises(NonFiniteError) as info:
            _run(model, handle, 2, nan_at=1)  # batches 3 and 4: the nan in batch 4
        assert handle.watcher.disabled_reason is None
    assert (info.value.batch_number, info.value.module_name) == (4, "scale")
    assert clean == _run(Model(make), None, 3)  # watching changed no value the model computed


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "dtensor"])
def test_a_module_whose_output_turns_odd_after_it_was_deferred_keeps_watching_on(kind: str) -> None:
    # Plain outputs at first (so its calls are deferred: measured in one stack at the check), odd ones later: those
    # are measured one by one instead (an expert of a mixture of experts that gets no token returns an empty output).
    make = KINDS[kind][0]
    model = Model(make)
    with _watch(model) as handle:
        _run(model, handle, 4, odd_from=2)
        assert handle.watcher.disabled_reason is None
        expected, text = KINDS[kind][1:]
        line = _output_line(handle, "odd")
        assert line == text if expected is None else line.endswith(f" {expected}")
        with pytest.raises(NonFiniteError) as info:
            _run(model, handle, 2, nan_at=1)
        assert handle.watcher.disabled_reason is None
    assert (info.value.batch_number, info.value.module_name) == (5, "scale")


def _with_nan(h: torch.Tensor) -> torch.Tensor:
    h = h.detach().clone()
    h[1, 1] = math.nan
    return h


# A nan (or an inf: float8_e5m2 past its range, complex) inside the odd output itself, and how its line ends.
NON_FINITE: dict[str, tuple[Make, str]] = {
    "sparse_coo": (lambda h: _with_nan(h).to_sparse(), "     nan      nan output (sparse_coo: values)"),
    "sparse_csr": (lambda h: _with_nan(h).to_sparse_csr(), "     nan      nan output (sparse_csr: values)"),
    "sparse_csc": (lambda h: _with_nan(h).to_sparse_csc(), "     nan      nan output (sparse_csc: values)"),
    "sparse_bsr": (lambda h: _with_nan(h).to_sparse_bsr((2, 2)), "     nan      nan output (sparse_bsr: values)"),
    "nested_strided": (
        lambda h: torch.nested.nested_tensor([h[0, :3], _with_nan(h)[1]], layout=torch.strided),
        "     nan      nan output (nested: values)",
    ),
    "nested_jagged": (
        lambda h: torch.nested.nested_tensor([h[0, :3], _with_nan(h)[1]], layout=torch.jagged),
        "     nan      nan output (nested: values)",
    ),
    "float8_e4m3fn": (lambda h: _with_nan(h).to(torch.float8_e4m3fn), "     nan      nan output"),
    "float8_e5m2": (lambda h: (h * 1e6).to(torch.float8_e5m2), "      inf output"),
    "complex64-real": (lambda h: torch.complex(_with_nan(h), h), "     nan      nan output"),
    "complex64-imaginary": (lambda h: torch.complex(h, torch.full_like(h, math.inf)), "     inf      inf output"),
}


def _report_line(report: str, module_name: str, label: str) -> str:
    """The line `label` of the last frame of `module_name` in a report's text."""
    lines = report.splitlines()
    start = max(index for index, line in enumerate(lines) if line.split() == [module_name, "Odd"])
    return next(line for line in lines[start + 1 :] if line.split(" (")[0].endswith(f" {label}"))


@pytest.mark.parametrize("kind", list(NON_FINITE))
def test_inf_or_nan_inside_an_odd_output_is_found_there(kind: str) -> None:
    make, expected = NON_FINITE[kind]
    model = Model(make)
    with _watch(model) as handle:
        _run(model, handle, 3, odd_from=99)  # plain outputs: the module's calls are deferred from batch 1
        with pytest.raises(NonFiniteError) as info:
            _run(model, handle, 1)
        assert handle.watcher.disabled_reason is None
    assert (info.value.batch_number, info.value.module_name) == (3, "odd")
    assert _report_line(info.value.report, "odd", "output").endswith(expected)


@pytest.mark.parametrize("kind", list(NON_FINITE))
def test_inf_or_nan_inside_an_odd_output_is_found_at_its_first_call(kind: str) -> None:
    make, expected = NON_FINITE[kind]
    model = Model(make)
    with _watch(model) as handle:
        with pytest.raises(NonFiniteError) as info:
            _run(model, handle, 1)
        assert handle.watcher.disabled_reason is None
    assert (info.value.batch_number, info.value.module_name) == (0, "odd")
    assert _report_line(info.value.report, "odd", "output").endswith(expected)
