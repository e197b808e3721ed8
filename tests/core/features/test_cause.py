"""The cause on every detection (core/features/cause/): each kind named with its evidence, in a plain loop; the
tests run only on a detection and leave the run as it was (buffers, random generators); the repro capsule.

The same causes through Lightning, Accelerate and the HF Trainer: tests/adapters/test_cause_conformance.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from tests.models import wrong_backend
from torch import nn

import nanwatch
from nanwatch.core.features.cause import Cause


class Amplify(nn.Module):
    """Multiplies by a gain kept in its own dtype: in float16 a large enough input overflows, in float32 it does not."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.register_buffer("gain", torch.full((), gain))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Rounding(nn.Module):
    """Divides by (1 - (1 + 1e-3)): 0 in bfloat16, whose rounding loses the 1e-3; -1e-3 in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("one", torch.ones(()))
        self.register_buffer("delta", torch.full((), 1e-3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (self.one - (self.one + self.delta))


class Net(nn.Module):
    """linear -> dropout -> tail -> norm: BatchNorm and dropout so a rerun must put buffers and generators back."""

    def __init__(self, tail: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.1)
        self.tail = tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.tail(self.drop(self.linear(x))))
        return out


def _train(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    lr: float = 1e-3,
    loss_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    **config: object,
) -> nanwatch.NonFiniteError:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    # The whole loop is what raises.
    with (  # noqa: PT012
        pytest.raises(nanwatch.NonFiniteError) as caught,
        nanwatch.watch(model, optimizer=optimizer, **config) as handle,
    ):
        for index, x in enumerate(batches):
            out = model(x)
            loss = loss_fn(out, index) if loss_fn is not None else out.float().pow(2).mean()
            handle.watch_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
    return caught.value


def _cause(error: nanwatch.NonFiniteError) -> Cause:
    assert isinstance(error.cause, Cause), error.report
    assert f"cause: {error.cause}" in error.report
    return error.cause


def test_data_names_the_input_and_the_positions() -> None:
    torch.manual_seed(0)
    poisoned = torch.randn(4, 4)
    poisoned[1, 2] = float("nan")
    poisoned[3, 0] = float("inf")
    cause = _cause(_train(Net(nn.Identity()), [torch.randn(4, 4), poisoned]))
    assert cause.kind == "data"
    assert "input[0] holds 2 non-finite at (1, 2), (3, 0)" in cause.evidence
    assert cause.details["inputs"] == [{"label": "input[0]", "count": 2, "positions": [[1, 2], [3, 0]]}]


def test_a_keyword_input_is_named_as_the_report_names_it() -> None:
    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, *, features: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.linear(features)
            return out

    model = Keyword()
    poisoned = torch.ones(2, 4)
    poisoned[0, 1] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(nanwatch.NonFiniteError) as caught, nanwatch.watch(model, optimizer=optimizer) as handle:  # noqa: PT012
        model(features=poisoned).mean().backward()
        optimizer.step()
        handle.step()
    cause = _cause(caught.value)
    assert cause.kind == "data"
    assert "input.features holds 1 non-finite at (0, 1)" in cause.evidence


def test_float16_range_is_named_with_the_magnitude_it_needed_and_the_op() -> None:
    torch.manual_seed(0)
    model = Net(Amplify(8.0)).half()
    batches = [torch.randn(8, 4).half() * 1e4 for _ in range(2)]
    error = _train(model, batches)
    cause = _cause(error)
    assert cause.kind == "precision", cause
    assert cause.module_name == "tail"
    assert "float16's range overflowed: it holds at most 6.55e+04" in cause.evidence
    assert cause.details["dtype"] == "float16"
    assert cause.details["recomputed_in"] == "float32"
    assert cause.details["range_overflowed"] is True
    assert cause.details["first_op"] == "mul"
    assert cause.details["needed_abs_max"] > 65504


def test_bfloat16_rounding_is_told_apart_from_its_range() -> None:
    torch.manual_seed(0)
    model = Net(Rounding()).to(torch.bfloat16)
    cause = _cause(_train(model, [torch.randn(8, 4, dtype=torch.bfloat16)]))
    assert cause.kind == "precision", cause
    assert cause.details["dtype"] == "bfloat16"
    assert cause.details["range_overflowed"] is False
    assert cause.details["first_op"] == "div"
    assert "bfloat16's rounding made it non-finite, not its range" in cause.evidence


def test_an_inf_the_code_makes_in_any_dtype_is_not_called_precision() -> None:
    class AddsInf(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + float("inf")

    cause = _cause(_train(Net(AddsInf()), [torch.randn(4, 4)]))
    assert cause.kind == "unknown"
    assert "non-finite too: not a matter of float32's range" in cause.evidence


def test_weights_name_the_step_that_broke_them() -> None:
    class Boost(nn.Module):
        """A weight of 3.3e38 the forward does not use; at its 2nd call, a gradient of -3.4e38 (finite) for it: an SGD
        step of lr 0.1 then takes it past float32's max."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.full((1,), 3.3e38))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return _HugeGradient.apply(x, self.weight) if self.calls == 2 else x + 0 * self.weight.clamp(max=0)

    error = _train(Net(Boost()), [torch.randn(4, 4) for _ in range(4)], lr=0.1)
    cause = _cause(error)
    assert cause.kind == "weights", cause
    assert error.born_in_step == cause.born_in_step == 1
    assert error.optimizer_step == 2
    assert "weight of tail (Boost) held inf/nan when the forward began: born in optimizer step 1" in cause.evidence
    assert "learning rate 1.00e-01" in cause.evidence


class _HugeGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return grad, torch.full((1,), -3.4e38)


def test_a_loss_born_outside_the_model() -> None:
    def loss_fn(out: torch.Tensor, index: int) -> torch.Tensor:
        return (out * (1e30 if index == 1 else 1.0)).pow(2).mean()

    cause = _cause(_train(Net(nn.Identity()), [torch.randn(4, 4) for _ in range(3)], loss_fn=loss_fn))
    assert cause.kind == "loss"
    assert "born outside the model" in cause.evidence


def test_the_tests_leave_buffers_and_random_generators_as_they_were() -> None:
    """The rerun runs BatchNorm in training mode (it updates its running statistics) and dropout (it draws): after the
    detection both are as the run left them, so a run that goes on (skip, rewind) is not disturbed."""
    torch.manual_seed(0)
    model = Net(Amplify(8.0)).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = nanwatch.watch(model, optimizer=optimizer)
    model(torch.randn(8, 4).half()).float().mean().backward()  # a clean micro-batch: the norm's buffers change
    optimizer.step()
    optimizer.zero_grad()
    handle.step()
    model(torch.randn(8, 4).half() * 1e4).float().mean().backward()
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    with pytest.raises(nanwatch.NonFiniteError) as caught:
        optimizer.step()
    handle.close()
    assert _cause(caught.value).kind == "precision"
    for name, value in model.named_buffers():  # the detection's own forward left inf/nan in the statistics: kept
        torch.testing.assert_close(value, buffers[name], rtol=0, atol=0, equal_nan=True, msg=name)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state


def test_the_capsule_is_written_and_named(tmp_path: Path) -> None:
    torch.manual_seed(0)
    error = _train(Net(Amplify(8.0)).half(), [torch.randn(8, 4).half() * 1e4], report_dir=tmp_path)
    assert error.capsule == str(tmp_path / "nanwatch-capsule-rank0-batch0.pt")
    assert Path(error.capsule).is_file()
    assert f"repro capsule: {error.capsule}" in error.report
    written = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text())
    assert written["cause"]["kind"] == "precision"
    assert written["cause"]["capsule"] == error.capsule
    from nanwatch.core.formats.capsule import read_capsule

    capsule = read_capsule(error.capsule)
    assert capsule.module_name == "tail"
    assert capsule.dtype == "float16"


def test_no_capsule_without_a_culprit_call(tmp_path: Path) -> None:
    poisoned = torch.full((4, 4), float("nan"))
    error = _train(Net(nn.Identity()), [poisoned], report_dir=tmp_path)
    assert _cause(error).kind == "data"
    assert error.capsule is None
    assert not list(tmp_path.glob("nanwatch-capsule-*"))


def test_sentinel_mode_names_the_cause_its_replay_found() -> None:
    torch.manual_seed(0)
    error = _train(Net(Amplify(8.0)).half(), [torch.randn(8, 4).half() * 1e4], mode="sentinel")
    assert error.replay == "reproduced"
    cause = _cause(error)
    assert cause.kind == "precision"
    assert cause.module_name == "tail"


def test_a_clean_run_never_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanwatch.core.features import cause as cause_feature

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cause was tested on the clean path")

    monkeypatch.setattr(cause_feature, "diagnose", refuse)
    model = Net(nn.Identity())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, optimizer=optimizer) as handle:
        for _ in range(3):
            model(torch.randn(4, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            handle.step()


@pytest.mark.slow
def test_a_graph_wrong_only_when_compiled_is_the_compiler() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    compiled = torch.compile(model, backend=wrong_backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(nanwatch.NonFiniteError) as caught, nanwatch.watch(compiled, optimizer=optimizer) as handle:  # noqa: PT012
        compiled(torch.randn(4, 4)).pow(2).mean().backward()
        optimizer.step()
        handle.step()
    cause = _cause(caught.value)
    assert cause.kind == "compiler", cause
    assert cause.module_name == "0"
    assert cause.details == {
        "backend": "wrong_backend",
        "mode": None,
        "dtype": "float32",
        "eager_abs_max": cause.details["eager_abs_max"],
    }
    assert "run eagerly in the same dtype (float32) gives a finite output" in cause.evidence
    assert "torch.compile backend='wrong_backend'" in cause.evidence


class DropAmplify(nn.Module):
    """Dropout, then a float16 gain past its range: a culprit whose test runs a dropout, which draws."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.full((), 64.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, self.training) * self.gain


def test_the_tests_call_no_hook_of_the_users_and_draw_nothing_from_the_runs_generators() -> None:
    torch.manual_seed(0)
    model = Net(DropAmplify()).half()
    seen: list[str] = []
    model.tail.register_forward_hook(lambda module, args, output: seen.append("tail"))
    model.register_forward_pre_hook(lambda module, args: seen.append("model"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = nanwatch.watch(model, optimizer=optimizer)
    model(torch.randn(8, 4).half() * 1e4).float().mean().backward()
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    with pytest.raises(nanwatch.NonFiniteError) as caught:
        optimizer.step()
    handle.close()
    cause = _cause(caught.value)
    assert cause.kind == "precision", cause  # the rerun and both dtypes drew the forward's own dropout mask
    assert cause.module_name == "tail"
    assert seen == ["model", "tail"]  # the one forward of the run, not the rerun nor the precision test's copies
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state


def test_a_backward_culprit_is_not_tested_as_a_forward() -> None:
    class NanGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return grad * float("nan")

    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = NanGradient.apply(x)
            return out

    error = _train(Net(Bad()), [torch.randn(4, 4)], watch_gradients=True)
    cause = _cause(error)
    assert cause.kind == "unknown", cause
    assert cause.evidence == "the first non-finite value is a gradient, made in the backward: no test applies"


@pytest.mark.filterwarnings("ignore:.*steps the watched model's weights unguarded.*")
def test_weights_changed_by_an_unguarded_step_are_not_tested() -> None:
    """The optimizer steps before the check (no guard, which nanwatch warns of): the weights are no longer the
    forward's."""
    torch.manual_seed(0)
    model = Net(Amplify(8.0)).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(nanwatch.NonFiniteError) as caught, nanwatch.watch(model) as handle:  # noqa: PT012
        model(torch.randn(8, 4).half() * 1e4).float().mean().backward()
        optimizer.step()
        handle.step()
    cause = _cause(caught.value)
    assert cause.kind == "unknown", cause
    assert "the weights changed after the forward (an optimizer step ran before this check" in cause.evidence


def test_keeping_that_fails_never_fails_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """An input or state the keeping cannot handle stops the keeping, not the user's forward; the cause says why."""
    from nanwatch.core.features.cause import keeping

    def broken() -> None:
        raise RuntimeError("cannot read this generator")

    monkeypatch.setattr(keeping, "capture_rng_states", broken)
    torch.manual_seed(0)
    error = _train(Net(Amplify(8.0)).half(), [torch.randn(8, 4).half(), torch.randn(8, 4).half() * 1e4])
    cause = _cause(error)
    assert cause.kind == "unknown", cause
    assert cause.evidence == (
        "the micro-batch's forward could not be kept to run again: RuntimeError('cannot read this generator')"
    )


def test_an_input_the_forward_changed_in_place_is_not_called_data() -> None:
    class ScalesItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(1e38)  # finite data, made inf by the forward itself, in place
            out: torch.Tensor = self.linear(x)
            return out

    cause = _cause(_train(ScalesItsInput(), [torch.full((2, 4), 10.0)]))
    assert cause.kind == "unknown", cause
    assert "an input was changed in place after the call began" in cause.evidence
