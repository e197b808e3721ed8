"""Summary mode in the core: the abs max per module of the last watched batch, and when it is sent."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from tests.engine_helpers import held_frame_counts

from nanwatch import WatchConfig
from nanwatch.core.features.summary import Summary
from nanwatch.core.frames import Direction
from nanwatch.core.watcher import Watcher


def amax(*tensors: torch.Tensor) -> float:
    return max(float(t.detach().abs().max()) for t in tensors)


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def run_batches(watcher: Watcher, model: torch.nn.Module, inputs: list[torch.Tensor]) -> None:
    for x in inputs:
        model(x).sum().backward()
        watcher.end_batch()


def test_the_summary_is_each_modules_abs_max_over_its_float_tensors() -> None:
    model = mlp()
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    x = torch.tensor([[1.0, -2.0, 3.0, -40.0]])
    run_batches(watcher, model, [x])
    summary = watcher.summary()
    watcher.close(check=False)

    assert summary is not None
    first, relu, last = model[0], model[1], model[2]
    h = first(x)
    r = relu(h)
    out = last(r)
    expected = {
        "0": amax(first.weight, first.bias, x, h),
        "1": amax(h, r),
        "2": amax(last.weight, last.bias, r, out),
        "": amax(x, out),
    }
    assert summary.batch_number == 0
    assert summary.absmax == pytest.approx(expected, rel=0, abs=0)
    assert summary.max_module == "0"  # its input holds the 40, as does the root's; the first one wins a tie
    assert summary.max_value == 40.0
    assert summary.class_names["1"] == "ReLU"
    metrics = summary.metrics()
    assert metrics == {
        "nanwatch/absmax/0": expected["0"],
        "nanwatch/absmax/1": expected["1"],
        "nanwatch/absmax/2": expected["2"],
        "nanwatch/absmax/(root)": expected[""],
        "nanwatch/absmax_global": 40.0,
        "nanwatch/batch_number": 0.0,
    }
    assert all(isinstance(value, float) for value in metrics.values())


def test_integer_tensors_do_not_count() -> None:
    # Token ids of 900 would otherwise look like the largest activation in the model.
    torch.manual_seed(0)
    model = torch.nn.Embedding(1000, 4)
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    ids = torch.tensor([[900, 3]])
    output = model(ids)
    watcher.end_batch()
    summary = watcher.summary()
    watcher.close(check=False)
    assert summary is not None
    assert summary.absmax == {"": amax(model.weight, output)}
    assert summary.absmax[""] < 900


def test_a_module_called_twice_reports_the_larger_call() -> None:
    layer = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(2))
    model = torch.nn.Sequential(layer, layer)  # the same module twice: named once, "0"
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    model(torch.tensor([[3.0, -5.0]]) * 2)
    watcher.end_batch()
    summary = watcher.summary()
    watcher.close(check=False)
    assert summary is not None
    assert summary.absmax["0"] == 10.0


def test_the_summary_comes_from_the_last_watched_batch() -> None:
    model = mlp()
    watcher = Watcher(model, WatchConfig(watch_every_n_batches=2))
    watcher.attach()
    assert watcher.summary() is None  # nothing checked yet
    scales = [1.0, 100.0, 10.0, 1000.0]  # batches 1 and 3 are not watched
    run_batches(watcher, model, [torch.full((1, 4), scale) for scale in scales])
    summary = watcher.summary()
    watcher.close(check=False)
    assert summary is not None
    assert summary.batch_number == 2
    assert summary.absmax[""] == pytest.approx(amax(torch.full((1, 4), 10.0), model(torch.full((1, 4), 10.0))))


def test_a_summary_is_sent_every_n_batches_and_only_with_new_numbers() -> None:
    model = mlp()
    sent: list[Summary] = []
    # Batches 0, 3, 6, 9 are watched; a summary is due after every second batch.
    watcher = Watcher(model, WatchConfig(watch_every_n_batches=3, summary_every_n_batches=2))
    watcher.summary_sink = sent.append
    watcher.attach()
    sent_after: list[int] = []
    for _ in range(10):
        before = len(sent)
        run_batches(watcher, model, [torch.randn(2, 4)])
        if len(sent) > before:
            sent_after.append(watcher.counters.batch_number)
    watcher.close(check=False)
    # Due after 2, 4, 6, 8, 10 batches; the one after 6 would repeat batch 3's numbers (sent after 4): skipped.
    assert sent_after == [2, 4, 8, 10]
    assert [summary.batch_number for summary in sent] == [0, 3, 6, 9]


def test_without_an_interval_nothing_is_sent_but_the_summary_can_be_asked_for() -> None:
    model = mlp()
    sent: list[Summary] = []
    watcher = Watcher(model, WatchConfig())
    watcher.summary_sink = sent.append
    watcher.attach()
    run_batches(watcher, model, [torch.randn(2, 4) for _ in range(3)])
    summary = watcher.summary()
    watcher.close(check=False)
    assert sent == []
    assert summary is not None
    assert summary.batch_number == 2


def test_the_default_sink_logs_to_the_nanwatch_logger(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = mlp()
    watcher = Watcher(model, WatchConfig(summary_every_n_batches=2))
    watcher.attach()
    run_batches(watcher, model, [torch.full((1, 4), 7.0), torch.full((1, 4), -50.0)])
    watcher.close(check=False)
    messages = [r.getMessage() for r in nanwatch_log.records if "summary" in r.getMessage()]
    assert len(messages) == 1
    lines = messages[0].splitlines()
    assert (
        lines[0]
        == "nanwatch summary of batch_number=1: largest abs max 5.00e+01 in 0 (Linear); 4 modules, largest first:"
    )
    assert lines[1] == "5.00e+01 0 Linear"
    assert lines[2] == "5.00e+01 (root) Sequential"
    assert len(lines) == 5


def test_a_failing_sink_is_logged_and_the_run_goes_on(nanwatch_log: pytest.LogCaptureFixture) -> None:
    def broken(summary: Summary) -> None:
        raise OSError("the logging service is down")

    model = mlp()
    watcher = Watcher(model, WatchConfig(summary_every_n_batches=1))
    watcher.summary_sink = broken
    watcher.attach()
    run_batches(watcher, model, [torch.randn(2, 4) for _ in range(3)])
    watcher.close(check=False)
    assert watcher.counters.batch_number == 3
    failures = [r.getMessage() for r in nanwatch_log.records if r.levelno == logging.WARNING]
    assert len(failures) == 3
    assert "could not send its summary (the run goes on)" in failures[0]
    assert "the logging service is down" in failures[0]


def test_scope_narrows_the_summary() -> None:
    model = mlp()
    watcher = Watcher(model, WatchConfig(include_modules=["2"]))
    watcher.attach()
    run_batches(watcher, model, [torch.randn(2, 4)])
    summary = watcher.summary()
    watcher.close(check=False)
    assert summary is not None
    assert list(summary.absmax) == ["2"]


def test_nan_is_never_hidden_behind_a_finite_maximum() -> None:
    summary = Summary(4, {"a": 3.0, "b": math.nan, "c": 5.0}, {"a": "A", "b": "B", "c": "C"})
    assert summary.max_module == "b"
    assert math.isnan(summary.metrics()["nanwatch/absmax_global"])
    assert Summary(0, {}).to_text() == "nanwatch summary of batch_number=0: no float tensor was recorded"
    assert Summary(0, {}).metrics() == {"nanwatch/batch_number": 0.0}


def test_gradient_lines_are_left_out() -> None:
    # With watch_gradients the backward frames join the ring under the module's name; the summary is about forwards.
    model = mlp()
    watcher = Watcher(model, WatchConfig(watch_gradients=True))
    watcher.attach()
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0]])
    out = model(x)
    (out.sum() * 1e6).backward()  # gradients far larger than any activation
    watcher.end_batch()
    summary = watcher.summary()
    watcher.close(check=False)
    assert summary is not None
    assert any(frame.direction is Direction.BACKWARD for frame in watcher.recent_frames())
    assert summary.absmax[""] == amax(x, out)
    assert summary.max_value is not None
    assert summary.max_value < 1e3


class Three(torch.nn.Module):
    """Three parameterless leaves, one per input: each leaf's abs max comes from its own input alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x) + self.b(y) + self.c(z)
        return out


# The most frames held in a batch that never ends: the engine checks and commits past 20_000 pending frames, and the
# summary folds the frames it holds into numbers past 8192.
PENDING_CAP, SUMMARY_CAP = 20_000, 8192


@pytest.mark.slow
def test_a_batch_that_never_ends_holds_a_bounded_number_of_frames_and_its_summary_stays_exact() -> None:
    # Before: 100_000 frames could be pending and the summary held every frame of the batch.
    model = Three()
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    forwards = 10_100  # 4 frames each: two commits past the cap (at frames 20_001 and 40_002), 398 frames left over
    spikes = {3: ("x", 300.0), 6_000: ("y", -200.0), forwards - 1: ("z", 100.0)}  # first commit, second, left over
    expected: dict[str, float] = {}
    for step in range(forwards):
        small = (step % 97) * 0.01
        inputs = {"x": torch.full((2,), small), "y": torch.full((2,), -small), "z": torch.full((2,), small / 2)}
        if step in spikes:
            name, value = spikes[step]
            inputs[name] = torch.full((2,), value)
        out = model(inputs["x"], inputs["y"], inputs["z"])
        for module, tensors in (("a", [inputs["x"]]), ("b", [inputs["y"]]), ("c", [inputs["z"]])):
            expected[module] = max(expected.get(module, 0.0), amax(*tensors))
        expected[""] = max(expected.get("", 0.0), amax(*inputs.values(), out))

    held = held_frame_counts(watcher)
    assert held[0] < PENDING_CAP
    assert held[1] <= watcher.config.max_frames_to_save
    assert held[2] <= SUMMARY_CAP
    assert sum(held) < PENDING_CAP + SUMMARY_CAP + watcher.config.max_frames_to_save

    watcher.end_batch()  # the batch ends at last: its summary covers every forward, folded or held
    assert held_frame_counts(watcher)[2] <= SUMMARY_CAP
    summary = watcher.summary()
    watcher.close(check=False)
    assert summary is not None
    assert summary.batch_number == 0
    assert summary.absmax == {"a": 300.0, "b": 200.0, "c": 100.0, "": expected[""]}
    assert summary.absmax == expected  # the same numbers, worked out forward by forward
    assert summary.class_names == {"a": "Identity", "b": "Identity", "c": "Identity", "": "Three"}
