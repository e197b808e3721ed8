"""core/gradients.py: backward frames with `watch_gradients=True`, driven through real forwards, backwards and steps.

A nan born in backward must be reported at the module where it appeared, in-place ops after a watched module must
keep working (and give the same gradients), parameter lines must show the accumulated `.grad`, the hooks must not
read anything back from the device, and `close()` must leave no hook behind.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tests.models import NanInBackward, small_mlp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanwatch import NonFiniteError, watch
from nanwatch.core.features.gradients import GradientRecorder
from nanwatch.core.frames import BACKWARD_SUFFIX, ResolvedFrame, resolve


class SqrtAt0(nn.Module):
    """sqrt: finite forward at 0 (sqrt(0) = 0), but its gradient there, 1 / (2 sqrt(0)), is inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


def _backward_lines(frames: list[ResolvedFrame]) -> list[tuple[str, str]]:
    return [(frame.module_name, entry.label) for frame in frames if frame.is_backward for entry in frame.entries]


def _frames(handle: Any) -> list[ResolvedFrame]:
    return resolve(handle.watcher.recent_frames())


# ----------------------------------------------------------------------------------------------- detection


def test_a_nan_born_in_backward_is_reported_at_that_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), SqrtAt0(), nn.Linear(8, 1))
    x = torch.randn(6, 4)

    def loop() -> None:
        with watch(model, watch_gradients=True) as handle:
            loss = model(x).sum()
            assert math.isfinite(loss.item())  # the forward is clean: the fault is in backward only
            loss.backward()
            handle.step()

    with pytest.raises(NonFiniteError) as info:
        loop()
    error = info.value
    assert error.module_name == "2"
    assert error.batch_number == 0
    lines = error.report.splitlines()
    header = lines.index(f"{' ' * 17} 2 SqrtAt0{BACKWARD_SUFFIX}")
    grad_output = lines[header + 1]
    assert grad_output.endswith(" grad output")
    assert math.isfinite(float(grad_output.split()[1]))  # what reached the module from above was finite
    grad_input = lines[header + 2]
    assert grad_input.endswith(" grad input[0]")
    assert grad_input.split()[1] == "inf"
    # The frames before it are finite: the forward ones and the backward of the last Linear.
    assert lines[1].endswith(" forward and backward frames:")
    before = lines[: header + 2]
    assert not any(" inf " in line or " nan " in line for line in before)


def test_a_custom_function_with_a_nan_gradient_is_the_module_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), NanInBackward(), nn.Linear(8, 1))

    def loop() -> None:
        with watch(model, watch_gradients=True) as handle:
            model(torch.randn(3, 4)).sum().backward()
            handle.step()

    with pytest.raises(NonFiniteError) as info:
        loop()
    assert info.value.module_name == "2"
    assert "2 NanInBackward (backward)" in info.value.report


def test_the_optimizer_guard_catches_a_backward_nan_before_it_reaches_the_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), NanInBackward(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with watch(model, optimizer=optimizer, watch_gradients=True) as handle:
        model(torch.randn(3, 4)).sum().backward()
        assert not torch.isfinite(model[0].weight.grad).all()  # the nan is in the gradient...
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.watcher.close(check=False)
    assert info.value.module_name == "1"
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param, old)  # ...and the step that would apply it never ran
    assert handle.optimizer_step == 0


def test_without_watch_gradients_a_backward_nan_is_not_seen_by_the_check() -> None:
    # The contrast that makes the option worth having: forward frames alone are all finite here.
    model = nn.Sequential(nn.Linear(4, 8), NanInBackward(), nn.Linear(8, 1))
    with watch(model) as handle:
        model(torch.randn(3, 4)).sum().backward()
        handle.step()
    assert not torch.isfinite(model[0].weight.grad).all()


# ------------------------------------------------------------------------------------------------- order


def test_backward_frames_follow_the_order_gradients_are_produced() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with watch(model, watch_gradients=True, max_frames_to_save=50) as handle:
        model(x).sum().backward()
        lines = _backward_lines(_frames(handle))
        handle.step()
    forward_count = 4  # three children and the root
    frames = _frames(handle)
    assert all(not frame.is_backward for frame in frames[:forward_count])
    assert all(frame.is_backward for frame in frames[forward_count:])
    # The input x does not require grad: no `grad input[0]` for module 0 nor the root.
    assert set(lines) == {
        ("2", "grad output"),
        ("", "grad output"),
        ("2", "grad weight"),
        ("2", "grad bias"),
        ("2", "grad input[0]"),
        ("1", "grad output"),
        ("1", "grad input[0]"),
        ("0", "grad output"),
        ("0", "grad weight"),
        ("0", "grad bias"),
    }
    position = {line: index for index, line in enumerate(lines)}
    # Backward runs from the loss to the input: module 2's lines come before module 1's, which come before 0's.
    assert position[("2", "grad output")] < position[("1", "grad output")] < position[("0", "grad output")]
    # At one tensor the consumer's `grad input` (its backward made that gradient) comes before the producer's.
    assert position[("2", "grad input[0]")] < position[("1", "grad output")]
    assert position[("1", "grad input[0]")] < position[("0", "grad output")]
    assert position[("0", "grad output")] < position[("0", "grad weight")]


def test_gradient_lines_hold_the_gradients_autograd_computed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    hidden = {}
    model[1].register_forward_hook(lambda module, args, output: hidden.__setitem__("tanh", output))
    with watch(model, watch_gradients=True, max_frames_to_save=50) as handle:
        out = model(x)
        hidden["tanh"].retain_grad()
        out.sum().backward()
        frames = _frames(handle)
        handle.step()
    by_line = {(f.module_name, e.label): e for f in frames if f.is_backward for e in f.entries}
    weight = by_line[("0", "grad weight")]
    assert weight.abs_max == pytest.approx(model[0].weight.grad.abs().max().item())
    assert weight.abs_min == pytest.approx(model[0].weight.grad.abs().min().item())
    assert weight.dtype == "float32"
    assert weight.shape == (8, 4)
    tanh_grad = hidden["tanh"].grad
    assert by_line[("1", "grad output")].abs_max == pytest.approx(tanh_grad.abs().max().item())
    assert by_line[("2", "grad input[0]")].abs_max == pytest.approx(tanh_grad.abs().max().item())
    assert by_line[("2", "grad output")].abs_max == pytest.approx(1.0)  # d(sum)/d(out)


# ----------------------------------------------------------------------------------------------- in-place


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        y += x  # in place on a watched module's output
        return y


def _inplace_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), Residual(), nn.ReLU(inplace=True), nn.Linear(8, 1))


def test_in_place_ops_after_a_watched_module_work_and_give_the_same_gradients() -> None:
    watched, plain = _inplace_model(), _inplace_model()
    x = torch.randn(5, 4)
    plain(x).pow(2).sum().backward()
    with watch(watched, watch_gradients=True, max_frames_to_save=100) as handle:
        watched(x).pow(2).sum().backward()
        frames = _frames(handle)
        handle.step()
    for (name, p_watched), p_plain in zip(watched.named_parameters(), plain.parameters(), strict=True):
        assert p_watched.grad is not None, name
        assert torch.equal(p_watched.grad, p_plain.grad), name
    # A full backward hook would have made the in-place ReLU raise; the gradients were recorded instead.
    lines = _backward_lines(frames)
    assert ("0", "grad output") in lines
    assert ("1", "grad output") in lines
    # The in-place ReLU's input is its output: only `grad output` for it.
    assert ("1", "grad input[0]") not in lines


def test_the_gradient_of_an_output_changed_in_place_afterwards_is_the_modules_own() -> None:
    # Linear 0's output is then clamped in place by ReLU: its line is the gradient w.r.t. the value before ReLU.
    watched = _inplace_model()
    x = torch.randn(5, 4)
    with watch(watched, watch_gradients=True, max_frames_to_save=100) as handle:
        watched(x).pow(2).sum().backward()
        frames = _frames(handle)
        handle.step()
    by_line = {(f.module_name, e.label): e for f in frames if f.is_backward for e in f.entries}

    reference = _inplace_model()  # the same model written out of place, keeping both gradients
    pre = reference[0](x)
    pre.retain_grad()
    post = torch.relu(pre)
    post.retain_grad()
    reference[4](torch.relu(reference[2](post))).pow(2).sum().backward()
    assert pre.grad is not None
    assert post.grad is not None
    assert not torch.equal(pre.grad, post.grad)  # ReLU zeroes some: the two gradients differ
    for label, expected in (("0", pre.grad), ("1", post.grad)):
        line = by_line[(label, "grad output")]
        assert line.abs_max == pytest.approx(expected.abs().max().item())
        assert line.abs_min == pytest.approx(expected.abs().min().item())


# ---------------------------------------------------------------------------------------- accumulation


def test_parameter_lines_show_the_accumulated_gradient_with_accumulation_2() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(2, 4) for _ in range(4)]
    seen: list[tuple[int, float]] = []
    expected: list[float] = []
    with watch(model, optimizer=optimizer, watch_gradients=True, max_frames_to_save=200) as handle:
        for index, x in enumerate(batches):
            model(x).sum().backward()
            expected.append(model[0].weight.grad.abs().max().item())
            for frame in _frames(handle):
                for entry in frame.entries:
                    if (frame.module_name, entry.label) == ("0", "grad weight") and frame.batch_number == index:
                        seen.append((frame.batch_number, float(entry.abs_max)))
            if index % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
            handle.step()
    assert [batch for batch, _ in seen] == [0, 1, 2, 3]  # one line per micro-batch
    assert [value for _, value in seen] == pytest.approx(expected)
    # Micro-batch 1's line is .grad after both micro-batches (what the optimizer applied), not micro-batch 1 alone.
    assert expected[1] != pytest.approx(expected[0])
    assert handle.optimizer_step == 2


def test_a_nan_in_the_second_micro_batch_is_reported_at_that_micro_batch() -> None:
    torch.manual_seed(0)
    sqrt = SqrtAt0()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), sqrt, nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)  # every ReLU output is 1: sqrt's gradient is finite
    with watch(model, optimizer=optimizer, watch_gradients=True) as handle:
        model(torch.randn(2, 4)).sum().backward()  # micro-batch 0: clean, accumulated, no step yet
        handle.step()
        with torch.no_grad():
            model[0].bias.fill_(-1.0)  # every ReLU output is 0 now: sqrt's gradient is inf
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.watcher.close(check=False)
    assert info.value.batch_number == 1
    assert info.value.module_name == "2"


# --------------------------------------------------------------------------------------- no host reads


class _HostReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (`.item()`, `.tolist()`, `bool(t)`)."""

    READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name in self.READS:
            self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_the_gradient_hooks_read_nothing_back_from_the_device() -> None:
    model = small_mlp(scale=False, inplace=True)
    with watch(model, watch_gradients=True) as handle:
        model(torch.randn(3, 4)).sum().backward()  # warm-up: first calls may initialise things
        handle.step()
        with _HostReads() as mode:
            model(torch.randn(3, 4)).sum().backward()
        assert mode.reads == []
        assert len(_backward_lines(_frames(handle))) >= 8  # and the backward was recorded
        handle.step()
    with _HostReads() as probe:
        torch.ones(2).sum().item()
    assert probe.reads == ["aten::_local_scalar_dense"]  # the probe does see a read


# ------------------------------------------------------------------------------------------------ detach


def _parameter_hooks(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_close_removes_the_parameter_and_tensor_hooks() -> None:
    model = small_mlp(scale=False, inplace=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer=optimizer, watch_gradients=True)
    assert _parameter_hooks(model) == 4
    loss = model(torch.randn(3, 4)).sum()  # its graph carries tensor hooks...
    recorder = handle.watcher.feature(GradientRecorder)
    assert recorder is not None
    assert len(recorder._tensors) > 0
    handle.close()
    assert _parameter_hooks(model) == 0
    assert len(recorder._tensors) == 0
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    before = len(handle.watcher.recent_frames())
    loss.backward()  # ...removed by close(): a backward afterwards records nothing and breaks nothing
    assert len(handle.watcher.recent_frames()) == before
    assert model[0].weight.grad is not None


def test_frozen_and_tied_parameters() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.frozen(self.embed(ids)))

    model = Tied()
    with watch(model, watch_gradients=True, max_frames_to_save=100) as handle:
        assert _parameter_hooks(model) == 1  # the tied weight once; frozen ones get none
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        lines = _backward_lines(_frames(handle))
        handle.step()
    assert [line for line in lines if line[1] == "grad weight"] == [("embed", "grad weight")]
    assert ("frozen", "grad output") in lines  # activations still carry gradients through frozen layers
    assert _parameter_hooks(model) == 0


def test_eval_and_no_grad_forwards_hook_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with watch(model, watch_gradients=True, watch_eval=True) as handle:
        with torch.no_grad():
            model(torch.randn(2, 4))
        recorder = handle.watcher.feature(GradientRecorder)
        assert recorder is not None
        assert len(recorder._tensors) == 0
        handle.step()
