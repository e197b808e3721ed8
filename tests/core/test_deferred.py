"""Deferred recording (core/engine/recording/): from a module's second recorded batch on, a call with one tensor in
and one small float tensor out keeps a reference to its output and makes its frame at the check. What the frames say
must not change: these tests run several batches, so that the later ones are deferred, and compare every line with
the numbers computed directly (the same tensors; abs min and max are exact, so equality holds)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tests.engine_helpers import deferred_calls
from tests.models import Cast
from torch import nn

from nanwatch import WatchConfig
from nanwatch.core.frames import ResolvedFrame, resolve
from nanwatch.core.watcher import Watcher


def _frames_of(watcher: Watcher, batch: int) -> list[ResolvedFrame]:
    return [frame for frame in resolve(watcher.recent_frames()) if frame.batch_number == batch]


def _line(frame: ResolvedFrame, label: str) -> tuple[float | int | None, float | int | None]:
    entry = next(e for e in frame.entries if e.label == label)
    return entry.abs_min, entry.abs_max


def _range(tensor: torch.Tensor) -> tuple[float, float]:
    values = tensor.detach().abs()
    return values.min().item(), values.max().item()


def _third_batch(model: nn.Module) -> tuple[torch.Tensor, int, list[ResolvedFrame]]:
    """Three batches of `model` watched, the third deferred: its input, how many calls were deferred, its frames."""
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    try:
        for batch in range(3):
            x = torch.randn(5, 4)
            model(x)
            deferred = deferred_calls(watcher)
            frames = _frames_of(watcher, batch)
            watcher.end_batch()
    finally:
        watcher.close()
    return x, deferred, frames


def test_a_chain_of_small_modules_is_deferred_and_records_the_same_numbers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    x, deferred, frames = _third_batch(model)
    assert deferred == 4, "the three modules and the Sequential around them, in the third batch"
    with torch.no_grad():  # no watched call: the functional forms
        hidden = nn.functional.linear(x, model[0].weight, model[0].bias)
        squashed = hidden.tanh()
        out = nn.functional.linear(squashed, model[2].weight, model[2].bias)
    first, tanh, last, root = frames
    assert [frame.module_name for frame in frames] == ["0", "1", "2", ""]
    assert [entry.label for entry in first.entries] == ["weight", "bias", "input[0]", "output"]
    assert _line(first, "input[0]") == _range(x)
    assert _line(first, "output") == _line(tanh, "input[0]") == _range(hidden)
    assert _line(tanh, "output") == _line(last, "input[0]") == _range(squashed)
    assert _line(last, "output") == _line(root, "output") == _range(out)
    assert _line(root, "input[0]") == _range(x)
    assert _line(last, "weight") == _range(model[2].weight)


@pytest.mark.parametrize("dtypes", ["one", "several"])
def test_deferred_outputs_of_one_shape_keep_each_its_own_dtype_and_numbers(dtypes: str) -> None:
    """Outputs of one shape are measured in one stack when they share a dtype; a stack would turn a bfloat16 output
    into float32, so outputs of several dtypes go in one stack per dtype. Each line keeps its output's dtype and
    numbers either way."""
    torch.manual_seed(0)
    cast: list[nn.Module] = [Cast(torch.bfloat16), nn.Tanh(), Cast(torch.float32)] if dtypes == "several" else []
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), *cast, nn.Linear(4, 4))
    x, deferred, frames = _third_batch(model)
    assert deferred == len(model) + 1, "every module and the Sequential around them"
    value, expected = x, []
    with torch.no_grad():
        for module in model:  # unwatched now
            value = module(value)
            expected.append((str(value.dtype).removeprefix("torch."), _range(value)))
    outputs = [(frame.entries[-1].dtype, _line(frame, "output")) for frame in frames[:-1]]
    assert outputs == expected
    assert frames[-1].entries[-1].dtype == "float32"


def test_an_output_changed_in_place_after_its_call_is_never_deferred() -> None:
    """ReLU(inplace=True) overwrites the Linear's output after its hook ran: the first batch shows it, so the Linear
    is recorded as it returns in every batch, and its line keeps the values from before the ReLU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    for batch in range(3):
        x = torch.randn(5, 4)
        before_relu = nn.functional.linear(x, model[0].weight, model[0].bias).detach()  # no watched call
        model(x)
        frames = _frames_of(watcher, batch)
        assert _line(frames[0], "output") == _range(before_relu), f"batch {batch}"
        assert _line(frames[1], "output") == _range(before_relu.relu())
        watcher.end_batch()
    watcher.close()


class _Mutates(nn.Module):
    """A Linear whose output the caller scales in place after it returned, once `scale_after` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.scale_after = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.scale_after:
            out.mul_(1000.0)
        return out


def test_an_in_place_change_that_starts_later_stops_the_deferral_from_then_on() -> None:
    """Deferred in batch 1; in batch 2 the caller starts scaling the Linear's output in place after its hook: that
    batch's line says so and shows no numbers (what the check would find is not what the call returned), and from
    batch 3 on the Linear is recorded as it returns again, exact."""
    torch.manual_seed(0)
    model = _Mutates()
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    seen = {}
    for batch in range(4):
        model.scale_after = batch >= 2
        x = torch.randn(3, 4)
        returned = nn.functional.linear(x, model.inner.weight, model.inner.bias).detach()  # no watched call
        model(x)
        output = next(e for e in _frames_of(watcher, batch)[0].entries if e.label == "output")
        seen[batch] = ((output.abs_min, output.abs_max), _range(returned), output.note)
        watcher.end_batch()
    assert seen[1][0] == seen[1][1], "deferred, exact"
    assert seen[1][2] is None
    assert seen[2][0] == (None, None), "changed after the call: no numbers the call did not return"
    assert seen[2][2] == "changed in place after the call: not measured"
    assert seen[3][0] == seen[3][1], "recorded as it returns from then on: exact again"
    assert seen[3][2] is None
    watcher.close()


class _TwiceLater(nn.Module):
    """One Linear called twice; once `scale` is set, its weight is doubled in place between the two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)
        self.scale = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.layer(x)
        if self.scale:
            with torch.no_grad():
                self.layer.weight.mul_(2.0)
        return self.layer(first)


def test_a_weight_changed_between_two_calls_of_a_batch_is_measured_again_in_later_batches() -> None:
    torch.manual_seed(0)
    model = _TwiceLater()
    model.scale = True  # from the first batch on
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    for batch in range(3):
        before = _range(model.layer.weight)
        model(torch.randn(2, 3))
        first, second, _root = _frames_of(watcher, batch)
        assert _line(first, "weight") == before
        assert _line(second, "weight") == _range(model.layer.weight)
        watcher.end_batch()
    watcher.close()


def test_a_buffer_the_loop_refills_is_measured_as_each_batch_saw_it() -> None:
    """One input tensor refilled in place before every batch (after the previous check): each batch's input line
    is that batch's data, deferred or not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    buffer = torch.empty(2, 4)
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    for batch in range(3):
        buffer.copy_(torch.randn(2, 4) * (batch + 1))
        model(buffer)
        assert _line(_frames_of(watcher, batch)[0], "input[0]") == _range(buffer)
        watcher.end_batch()
    watcher.close()


def test_nothing_is_deferred_when_other_statistics_are_measured() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
    watcher = Watcher(model, WatchConfig(count_underflow=True))
    watcher.attach()
    for _batch in range(3):
        model(torch.randn(5, 4))
        assert deferred_calls(watcher) == 0
        watcher.end_batch()
    watcher.close()


def test_a_parameter_put_on_a_deferred_module_is_the_one_its_lines_show() -> None:
    """Deferred from batch 1; before batch 3 the Linear gets a new weight (`module.weight = Parameter(...)`, as weight
    tying or pruning do): its line shows the new weight, not the old one's batch measurement."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    for batch in range(4):
        if batch == 3:
            model[0].weight = nn.Parameter(torch.full((4, 4), 7.0))
        model(torch.randn(2, 4))
        if batch == 2:
            assert deferred_calls(watcher) == 3, "the Linear, the Tanh and the Sequential"
        assert _line(_frames_of(watcher, batch)[0], "weight") == _range(model[0].weight), f"batch {batch}"
        watcher.end_batch()
    watcher.close()


def test_weights_an_optimizer_changes_before_the_check_show_as_the_forward_saw_them() -> None:
    """A loop that steps its optimizer before the check (no optimizer given to nanwatch): each batch's weight line is
    the weight its forward used, deferred or not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    for batch in range(4):
        used = [_range(model[0].weight), _range(model[2].weight)]
        optimizer.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        frames = _frames_of(watcher, batch)
        assert [_line(frames[0], "weight"), _line(frames[2], "weight")] == used, f"batch {batch}"
        assert _range(model[0].weight) != used[0], "the step changed the weight"
        watcher.end_batch()
    watcher.close()


class _ScalesLaterLayer(nn.Module):
    """Two Linears; once `scale` is set, the forward doubles the second one's weight in place between the two calls
    (after the batch measured every weight at the first call)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if self.scale:
            with torch.no_grad():
                self.second.weight.mul_(2.0)
        return self.second(hidden)


def test_a_weight_that_starts_changing_during_the_forward_is_measured_at_the_call_again() -> None:
    """Deferred from batch 1, a module's parameters are checked all at once at the check. From batch 2 the forward
    changes one of them before its module's call: the check finds it changed and cannot tell when (that batch's line
    may show the batch measurement), and from then on each module's parameters are checked at its call: exact."""
    torch.manual_seed(0)
    model = _ScalesLaterLayer()
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    for batch in range(5):
        model.scale = batch >= 2
        model(torch.randn(2, 4))
        if batch >= 3:
            second = next(f for f in _frames_of(watcher, batch) if f.module_name == "second")
            assert _line(second, "weight") == _range(model.second.weight), f"batch {batch}"
        watcher.end_batch()
    watcher.close()


def test_a_module_whose_weights_are_put_in_place_for_its_call_is_never_deferred() -> None:
    """As ZeRO-3 or FSDP gather a module's weights just before its call (new storage, no version change): the
    batch measurement made at the first module's call is not what the second one used, so it is recorded as it
    returns, with the weights of its call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def gather(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        module.weight.data = module.weight.data * 2.0  # new storage, as a gather makes

    model[1].register_forward_pre_hook(gather)
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    for batch in range(4):
        model(torch.randn(2, 4))
        assert _line(_frames_of(watcher, batch)[1], "weight") == _range(model[1].weight), f"batch {batch}"
        watcher.end_batch()
    watcher.close()


def test_a_watcher_left_open_and_dropped_lets_its_model_go() -> None:
    """The hook that hears of parameters put on modules is torch's, for the whole process: it must not keep a watcher
    nobody closed (a notebook cell that raised), nor the weights its cache tracks, once the model is dropped."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    for _ in range(3):
        model(torch.randn(2, 4))
        watcher.end_batch()
    weight = weakref.ref(model[0].weight)
    del model, watcher
    gc.collect()
    assert weight() is None


def test_a_weight_that_starts_changing_between_two_calls_is_measured_at_each_call_again() -> None:
    """Deferred from batch 1; from batch 2 the weight doubles between the module's two calls of a forward. From the
    batch after the check that found it on, each call's line is the weight that call used."""
    torch.manual_seed(0)
    model = _TwiceLater()
    watcher = Watcher(model, WatchConfig(max_frames_to_save=50))
    watcher.attach()
    for batch in range(5):
        model.scale = batch >= 2
        before = _range(model.layer.weight)
        model(torch.randn(2, 3))
        if batch >= 3:
            first, second, _root = _frames_of(watcher, batch)
            assert _line(first, "weight") == before, f"batch {batch}"
            assert _line(second, "weight") == _range(model.layer.weight), f"batch {batch}"
        watcher.end_batch()
    watcher.close()
