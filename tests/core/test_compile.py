"""torch.compile: watched in both orders with no graph break of nanwatch's, no recompilation per call, the same frames
as in eager mode (no `_orig_mod.`, no OptimizedModule frame), and hooks added after the model ran compiled taking
effect. Real torch.compile and dynamo's own graph-break counters; no mocks. The first test compiles with inductor,
the default; the others with "aot_eager" (the same dynamo and AOTAutograd graphs, without inductor's code
generation, which would take most of this file's time)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from tests.models import NanInBackward
from torch import nn
from torch._dynamo.utils import counters

import nanwatch
from nanwatch import NanwatchWarning, NonFiniteError
from nanwatch.core.frames import ResolvedFrame, resolve
from nanwatch.core.torch_glue.compiler import with_compiled_code

Order = Callable[[nn.Module, str], tuple[nn.Module, nanwatch.WatchHandle]]


class KeywordBlock(nn.Module):
    """A residual block that takes a keyword tensor, as transformers' blocks take their masks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x)) * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([KeywordBlock(), KeywordBlock()])
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale=torch.ones(()) if scale is None else scale)
        return self.head(h), h


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(index: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(index))


def watch_then_compile(model: nn.Module, backend: str = "inductor") -> tuple[nn.Module, nanwatch.WatchHandle]:
    handle = nanwatch.watch(model)
    return torch.compile(model, backend=backend), handle


def compile_then_watch(model: nn.Module, backend: str = "inductor") -> tuple[nn.Module, nanwatch.WatchHandle]:
    compiled = torch.compile(model, backend=backend)
    return compiled, nanwatch.watch(compiled)


ORDERS: dict[str, Order] = {"watch-then-compile": watch_then_compile, "compile-then-watch": compile_then_watch}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[int, int, list[str]]:
    """What `torch._dynamo.explain` counts: graphs, graph breaks, and the reasons of the breaks."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*args, **kwargs)
    torch._dynamo.reset()
    return explained.graph_count, explained.graph_break_count, [b.reason for b in explained.break_reasons]


def _graph_breaks(model: nn.Module, *args: Any, **kwargs: Any) -> int:
    return _graphs(model, *args, **kwargs)[1]


def _shape(frames: list[ResolvedFrame]) -> list[tuple[str, str, int, list[tuple[str, str | None, Any]]]]:
    return [
        (f.module_name, f.class_name, f.batch_number, [(e.label, e.dtype, e.shape) for e in f.entries]) for f in frames
    ]


def _eager_frames(batches: int) -> list[ResolvedFrame]:
    model = _net()
    with nanwatch.watch(model) as handle:
        for index in range(batches):
            model(_batch(index), scale=torch.full((), 0.5))
            handle.step()
        return resolve(handle.watcher.recent_frames())


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.slow
def test_watching_adds_no_graph_break_and_records_what_eager_mode_records(order: str) -> None:
    x, scale = _batch(0), torch.full((), 0.5)
    baseline = _graphs(_net(), x, scale=scale)
    assert baseline == (1, 0, [])

    model = _net()
    compiled, handle = ORDERS[order](model)
    # The module and its compiled wrapper alike: one graph, as unwatched (the root's hooks run outside dynamo's
    # frames, the others inside the graph).
    assert _graphs(model, x, scale=scale) == baseline
    assert _graphs(compiled, x, scale=scale) == baseline

    with warnings.catch_warnings():
        warnings.simplefilter("error", NanwatchWarning)  # nanwatch stopping to watch (or saying why) fails the test
        for index in range(3):
            compiled(_batch(index), scale=scale)
            handle.step()
        graphs_after_warmup = counters["stats"]["unique_graphs"]
        for index in range(3, 8):  # same shapes: nothing compiles again, whatever the batch number
            compiled(_batch(index), scale=scale)
            handle.step()
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup
    assert not counters["graph_break"]
    assert handle.watcher.disabled_reason is None

    frames = resolve(handle.watcher.recent_frames())
    handle.close()
    eager = _eager_frames(8)
    # Names as in eager mode (no `_orig_mod.`, no OptimizedModule frame), keyword tensors included, same numbers
    # (inductor may round differently in the last bits).
    assert _shape(frames) == _shape(eager)
    assert not any("_orig_mod" in f.module_name or f.class_name == "OptimizedModule" for f in frames)
    last_block = [entries for name, _, _, entries in _shape(frames) if name == "blocks.1"][-1]
    assert ("input.scale", "float32", ()) in last_block  # it got `scale=` as a keyword
    for ours, theirs in zip(frames, eager, strict=True):
        for a, b in zip(ours.entries, theirs.entries, strict=True):
            assert a.abs_max == pytest.approx(b.abs_max, rel=1e-5)
            assert a.abs_min == pytest.approx(b.abs_min, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.slow
def test_a_nan_in_a_compiled_forward_is_reported_at_its_batch(order: str) -> None:
    model = _net()
    compiled, handle = ORDERS[order](model, "aot_eager")

    def train() -> None:
        for index in range(4):
            x = _batch(index)
            if index == 2:
                x[1, 3] = float("nan")
            compiled(x)
            handle.step()

    with pytest.raises(NonFiniteError) as caught:
        train()
    handle.close()
    error = caught.value
    assert error.batch_number == 2
    assert error.module_name == "embed"
    assert error.culprit is not None
    assert error.culprit.message.startswith("nan entered through input[0] of the top-level model (Net)")
    assert "                  embed Linear" in error.report


@pytest.mark.slow
def test_dynamic_shapes_are_reported_with_their_sizes() -> None:
    model = _net()
    compiled, handle = watch_then_compile(model, "aot_eager")
    for index, rows in enumerate((4, 5, 6, 7)):  # the second size makes dynamo compile for dynamic shapes
        compiled(_batch(index, rows))
        handle.step()
    frames = resolve(handle.watcher.recent_frames())
    handle.close()
    assert not counters["graph_break"]
    last = [f for f in frames if f.batch_number == 3]
    assert [e.shape for e in last[0].entries] == [(16, 8), (16,), (7, 8), (7, 16)]  # embed: weight, bias, in, out


@pytest.mark.slow
def test_a_compiled_watched_model_compiles_its_forward_and_nothing_is_set_on_its_class() -> None:
    # torch.compile(model) enters the model through torch's own `__call__` (nanwatch sets nothing on the class), so
    # the `forward` is what compiles and the root's hooks run outside the graph.
    x, scale = _batch(0), torch.full((), 0.5)
    model = _net()
    classes = {kind: dict(vars(kind)) for kind in (Net, KeywordBlock, nn.Linear)}
    handle = nanwatch.watch(model)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x, scale=scale)
    handle.step()
    assert with_compiled_code([Net.forward.__code__]) == [Net.forward.__code__]
    assert not counters["graph_break"]
    assert {kind: dict(vars(kind)) for kind in classes} == classes
    handle.close()
    assert {kind: dict(vars(kind)) for kind in classes} == classes


@pytest.mark.slow
def test_a_module_compiled_in_place_runs_its_compiled_code_while_watched() -> None:
    # `module.compile()` keeps the module and sets its `_compiled_call_impl`, which torch's `__call__` runs instead of
    # `_call_impl`: the compiled code runs, and its frames are what eager mode records.
    scale = torch.full((), 0.5)
    model = _net()
    handle = nanwatch.watch(model)
    model.blocks[0].compile(backend="aot_eager")
    for index in range(3):
        model(_batch(index), scale=scale)
        handle.step()
    assert with_compiled_code([KeywordBlock.forward.__code__]) == [KeywordBlock.forward.__code__]
    assert not counters["graph_break"]
    frames = resolve(handle.watcher.recent_frames())
    handle.close()
    assert _shape(frames) == _shape(_eager_frames(3))  # what eager mode records, the block's frames from its graph


@pytest.mark.slow
def test_a_torch_nn_container_compiled_whole_runs_the_adapter_hooks_outside_the_graph() -> None:
    # torch.compile(nn.Sequential) traces the root's hooks too, the plain adapter's included: they must still count
    # eval batches and check each as it returns.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    handle = nanwatch.watch(model, watch_eval=True)
    compiled = torch.compile(model, backend="aot_eager")
    assert _graph_breaks(compiled, _batch(0)) == 0
    with torch.no_grad():
        compiled(_batch(0))
        compiled(_batch(1))
        assert handle.watcher.counters.eval_batch_number == 2
        x = _batch(2)
        x[0, 0] = float("inf")
        with pytest.raises(NonFiniteError) as caught:
            compiled(x)  # checked as the forward returns, as in eager mode
    handle.close()
    assert caught.value.phase == "eval"
    assert caught.value.batch_number == 2
    assert caught.value.module_name == "0"


@pytest.mark.slow
def test_watching_a_model_that_already_ran_compiled_recompiles_it_with_the_hooks() -> None:
    model = _net()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(_batch(0))  # compiled with no hook: dynamo would keep running this code after watch()
    with nanwatch.watch(compiled) as handle:
        compiled(_batch(1))
        handle.step()
        frames = resolve(handle.watcher.recent_frames())
    assert [f.module_name for f in frames] == [
        "embed",
        "blocks.0.fc",
        "blocks.0.act",
        "blocks.0",
        "blocks.1.fc",
        "blocks.1.act",
        "blocks.1",
        "head",
        "",
    ]


def test_a_compiled_step_that_ran_before_watching_is_said_to_record_nothing() -> None:
    # The compiled code is a function of the user's (a training step), which nanwatch cannot see or drop: it says
    # so rather than watching nothing in silence.
    model = _net()

    @torch.compile(backend="aot_eager")
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)[0].sum()

    forward(_batch(0))
    handle = nanwatch.watch(model)
    forward(_batch(1))
    with pytest.warns(NanwatchWarning, match="no watched module recorded anything during batch_number=0"):
        handle.step()
    forward(_batch(2))
    handle.step()  # said once
    handle.close()


class NanBornInBackward(nn.Module):
    """Two Linear layers with a nan made, when armed, in the backward between them (the forward is the identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fault = NanInBackward()
        self.fc2 = nn.Linear(8, 2)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(self.fault(h) if self.armed else h)


@pytest.mark.slow
def test_watch_gradients_keeps_the_graph_whole_and_reports_a_backward_nan_at_its_parameter(
    nanwatch_log: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = NanBornInBackward()
    handle = nanwatch.watch(model, watch_gradients=True)
    compiled = torch.compile(model, backend="aot_eager")
    assert _graphs(compiled, _batch(0)) == (1, 0, [])  # as unwatched: the gradient hooks add no break

    def train() -> None:
        for index in range(4):
            model.armed = index == 2
            compiled(_batch(index)).square().mean().backward()
            handle.step()

    with pytest.raises(NonFiniteError) as caught:
        train()
    handle.close()
    assert not counters["graph_break"]
    error = caught.value
    assert (error.batch_number, error.module_name) == (2, "fc1")
    assert "fc1 Linear (backward)" in error.report
    assert "grad weight" in error.report
    said = [r.getMessage() for r in nanwatch_log.records if "watch_gradients under torch.compile" in r.getMessage()]
    assert len(said) == 1, said  # once, not at every batch


@pytest.mark.slow
def test_a_transformers_model_gets_no_graph_break_of_nanwatch() -> None:
    # Watched, a transformers model compiles to the graphs it compiles to unwatched (a one-layer GPT-2: tracing
    # takes seconds per layer on a small CPU).
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def gpt2() -> nn.Module:
        torch.manual_seed(0)
        model: nn.Module = transformers.GPT2Model(config)
        return model

    baseline = _graphs(gpt2(), ids)
    model = gpt2()
    with nanwatch.watch(model):
        watched = _graphs(model, ids)
    assert watched == baseline
    assert all("nanwatch" not in reason for reason in watched[2])
