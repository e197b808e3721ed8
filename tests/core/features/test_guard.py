"""core/features/guard.py: before every optimizer step, the gradients about to be applied are checked (one fused
reduction, read with the check's one host read), whatever the optimizer and whenever a parameter started to learn."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.models import InfInBackward, NanInBackward, small_mlp
from torch import nn

from nanwatch import NonFiniteError, WatchHandle, watch
from nanwatch.core.features.guard import MAX_NAMED


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _same(model: nn.Module, saved: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())


def _clean_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, handle: WatchHandle, inputs: torch.Tensor, count: int
) -> None:
    for _ in range(count):
        model(inputs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.step()


def test_a_nan_born_in_backward_never_reaches_the_weights_without_watch_gradients() -> None:
    # No backward frames are recorded: the guard alone reads the gradients, before the step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), NanInBackward(), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _weights(model)
    with watch(model, optimizer=optimizer) as handle:
        model(torch.ones(2, 3)).sum().backward()
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    assert _same(model, before)
    error = info.value
    assert (error.batch_number, error.module_name) == (0, "0")
    assert "non-finite gradients about to be applied by optimizer step 0: 0.weight nan, 0.bias nan" in error.report
    assert "(2 of 4 parameters); the step did not run" in error.report


@pytest.mark.parametrize("fault", [InfInBackward, NanInBackward])
def test_a_nan_born_in_backward_is_said_to_be_born_there_not_in_the_first_module_of_the_gradient_list(
    fault: type[nn.Module],
) -> None:
    # Every forward frame is finite; only the gradients are not. Before, the error said "first in module 'encoder.0'"
    # (merely the owner of the first gradient the optimizer holds) and the report nothing of backward.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 3)), fault(), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        handle.watch_loss(model(torch.ones(2, 3)).sum()).backward()  # the loss is recorded, and finite
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    error = info.value
    message = str(error)
    assert "first in module" not in message
    assert "in the gradients about to be applied (first: '0.0.weight')" in message
    said = (
        "every forward value recorded, the loss handed to watch_loss included, was finite: the inf/nan appeared in "
        "backward. watch_gradients=True"
    )
    assert said in message
    assert said[0].upper() + said[1:] in error.report  # the report says it too, after the gradients' line
    assert error.report.index("non-finite gradients about to be applied") < error.report.index("Every forward value")


NOT_RECORDED = (
    "every forward value recorded was finite, and no loss was handed to watch_loss: the inf/nan may have been born "
    "in a loss computed outside the watched modules (never recorded) or in backward. handle.watch_loss(loss) "
    "before loss.backward() records such a loss"
)


def _overflowing_losses() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    return {
        "scaled": lambda out, target: (out * 1e30).pow(2).sum(),  # float32 overflows past 3.4e38
        "functional fp16": lambda out, target: F.mse_loss(out.half() * 1e3, target.half()),  # past 65504
    }


@pytest.mark.parametrize("loss_name", list(_overflowing_losses()))
def test_a_loss_that_overflows_outside_the_model_is_not_said_to_be_born_in_backward(loss_name: str) -> None:
    # A plain loop that computes its loss outside the model and does not hand it over: every forward frame is
    # finite, the loss is inf, and so are the gradients. Before, the report said "the inf/nan appeared in backward"
    # and pointed at watch_gradients alone; nanwatch never looked at the loss.
    loss_fn = _overflowing_losses()[loss_name]
    model = small_mlp(2, scale=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(3, 4), torch.zeros(3, 2)
    before = _weights(model)
    losses = []

    def train() -> None:
        with watch(model, optimizer=optimizer) as handle:
            for _ in range(2):
                loss = loss_fn(model(inputs), targets)
                losses.append(loss.item())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                handle.step()

    with pytest.raises(NonFiniteError) as info:
        train()
    assert _same(model, before)
    error = info.value
    assert len(losses) == 1
    assert not math.isfinite(losses[0])
    assert NOT_RECORDED in str(error)
    assert NOT_RECORDED[0].upper() + NOT_RECORDED[1:] in error.report
    assert "the inf/nan appeared in backward" not in str(error) + error.report


@pytest.mark.parametrize("loss_name", list(_overflowing_losses()))
def test_a_loss_handed_to_watch_loss_is_named_as_where_the_inf_was_born(loss_name: str) -> None:
    loss_fn = _overflowing_losses()[loss_name]
    model = small_mlp(2, scale=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train() -> None:
        with watch(model, optimizer=optimizer) as handle:
            loss = handle.watch_loss(loss_fn(model(torch.randn(3, 4)), torch.zeros(3, 2)))
            loss.backward()
            optimizer.step()

    with pytest.raises(NonFiniteError) as info:
        train()
    error = info.value
    assert error.module_name == "(loss)"
    assert "first non-finite value produced by the loss, computed outside the watched modules" in str(error)
    assert "watch_loss" not in str(error)  # nothing to advise: the loss was recorded
    assert "backward" not in str(error)


def test_a_micro_batch_that_was_not_watched_is_not_said_to_have_a_finite_forward() -> None:
    # watch_every_n_batches=10 leaves batch 1 unwatched: its forward was never recorded, so nothing can say it was
    # finite; the guard still stops the step, naming the gradients only.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer, watch_every_n_batches=10) as handle:
        for batch in range(2):
            loss = model(torch.ones(2, 3)).sum()
            (loss * float("inf") if batch == 1 else loss).backward()
            if batch == 1:
                with pytest.raises(NonFiniteError) as info:
                    optimizer.step()
                break
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
        handle.close()
    error = info.value
    assert error.batch_number == 1
    assert "in the gradients about to be applied (first: '0.weight')" in str(error)
    assert "finite" not in str(error)
    assert "non-finite gradients about to be applied" in error.report
    assert "every forward value" not in error.report.lower()


def test_a_nan_made_after_backward_is_not_said_to_need_watch_gradients() -> None:
    # With watch_gradients the backward frames are finite too: the gradients went non-finite after the backward.
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer, watch_gradients=True) as handle:
        model(torch.ones(2, 3)).sum().backward()
        with torch.no_grad():
            model[1].bias.grad.fill_(float("nan"))  # gradient clipping gone wrong, say
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    message = str(info.value)
    assert "every value recorded, forward and backward, was finite" in message
    assert "watch_gradients=True" not in message


def test_a_forward_nan_with_non_finite_gradients_is_not_said_to_be_born_in_backward() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        model(torch.full((2, 3), float("inf"))).sum().backward()
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    assert "appeared in backward" not in str(info.value)
    assert "appeared in backward" not in info.value.report
    assert "first in module" in str(info.value)


def test_lbfgs_is_checked_after_its_closure_computed_the_gradients() -> None:
    # optimizer.step(closure): the step pre-hook runs before the closure, when there is nothing to check yet; the
    # closure is wrapped, so every evaluation it makes is checked before the optimizer uses its gradients.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), InfInBackward(), nn.Linear(3, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=3)
    before = _weights(model)
    x = torch.ones(2, 3)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    with watch(model, optimizer=optimizer) as handle:
        with pytest.raises(NonFiniteError) as info:
            optimizer.step(closure)
        handle.close()
    assert _same(model, before)  # LBFGS never moved the weights
    assert "0.weight inf" in info.value.report


def test_lbfgs_with_a_clean_closure_trains_and_returns_its_loss() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    losses = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        return loss

    with watch(model, optimizer=optimizer) as handle:
        returned = optimizer.step(closure)
        handle.step()
    assert returned is not None
    assert float(returned.detach()) == losses[0]  # the wrapped closure hands back what the user's returned
    assert handle.optimizer_step == 1


def test_a_parameter_unfrozen_after_watch_is_guarded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), InfInBackward(), nn.Linear(3, 1))
    model[0].requires_grad_(False)  # frozen when watching starts ...
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        model[0].requires_grad_(True)  # ... and unfrozen later, into a group of its own
        optimizer.add_param_group({"params": model[0].parameters()})
        before = _weights(model)
        model(torch.ones(2, 3)).sum().backward()
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    assert _same(model, before)
    assert "0.weight inf, 0.bias inf" in info.value.report


def test_the_report_names_the_first_few_parameters_and_counts_the_rest() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)], NanInBackward())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    named = ", ".join(f"{name} nan" for name in ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"])
    assert MAX_NAMED == 5
    assert f": {named} and 3 more (8 of 8 parameters); the step did not run" in info.value.report


def test_a_parameter_outside_the_watched_model_is_named_by_its_place_in_the_optimizer() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    extra = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        (model(torch.ones(1, 2)).sum() + (extra * torch.tensor([1.0, float("nan")])).sum()).backward()
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    assert "(parameter 2 of the optimizer, outside the watched model) nan (1 of 3 parameters)" in info.value.report


@pytest.mark.parametrize("fused", [False, True], ids=["bounds, confirmed", "exact magnitudes"])
def test_a_huge_finite_gradient_is_never_called_non_finite(fused: bool) -> None:
    """On the CPU the host's check screens the gradients by their 2-norms, which overflow from about 1e19 on: such a
    gradient trips the screen, and its own largest magnitude, read then, says it is finite: no detection, the step
    runs. A fused optimizer (told by the check itself to skip) is screened by the exact magnitudes."""
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-36, fused=fused or None)
    with watch(model, optimizer=optimizer, mode="sentinel") as handle:
        for _ in range(3):
            (model(torch.ones(2, 4)) * 1e30).sum().backward()  # gradients of about 1e30: finite, squares are not
            before = model[0].weight.detach().clone()
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
            assert not torch.equal(model[0].weight, before)  # the step ran
    assert handle.optimizer_step == 3


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_gradient_among_huge_ones_is_named_alone(bad: float) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-36)
    with watch(model, optimizer=optimizer) as handle:
        (model(torch.ones(2, 4)) * 1e30).sum().backward()
        model[1].bias.grad[2] = bad  # type: ignore[index]
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    word = "nan" if math.isnan(bad) else "inf"
    assert f": 1.bias {word} (1 of 4 parameters); the step did not run" in info.value.report


def test_the_guard_reads_nothing_back_on_a_clean_step() -> None:
    # One host read per check is all: the gradients' flags ride on the read the frames need anyway.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        _clean_steps(model, optimizer, handle, torch.ones(2, 3), 3)
    assert handle.optimizer_step == 3


class Scales(nn.Module):
    """Parameters of any shape, each scaling the input's sum: their shapes may change between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(3, 3)) for _ in range(3)])
        self.table = nn.Embedding(4, 2, sparse=True)  # a sparse gradient, reduced on its own

    def forward(self, x: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        total = x.sum() + self.table(torch.tensor([1])).sum()
        return sum((p * total * factor).sum() for p in self.scales)  # type: ignore[return-value]


def test_the_reduction_is_planned_again_when_a_gradient_changes_shape() -> None:
    # The plan (which gradients are stacked together) is made once per list of parameters; a parameter given new
    # data of another shape makes the next step plan again, and a nan in it is still seen.
    model = Scales()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with watch(model, optimizer=optimizer) as handle:
        for step, factor in enumerate([1.0, 1.0, float("nan")]):
            if step == 1:
                model.scales[1].data = torch.ones(5)  # no longer stacked with the others
            model(torch.ones(2), factor).backward()
            if step < 2:
                optimizer.step()
                optimizer.zero_grad()
                handle.step()
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
    assert info.value.batch_number == 2
    assert "scales.0 nan, scales.1 nan, scales.2 nan, table.weight nan (4 of 4 parameters)" in info.value.report


def test_a_parameter_swapped_into_the_optimizers_own_list_is_guarded() -> None:
    # The guard keeps its plan while the optimizer's list holds the same parameters, but reads that list at every
    # step: a parameter put in it in place of another (same length, same shape) is the one checked and named.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outside = nn.Parameter(torch.ones(1))
    with watch(model, optimizer=optimizer) as handle:
        _clean_steps(model, optimizer, handle, torch.ones(1, 2), 2)
        optimizer.param_groups[0]["params"][3] = outside  # in place of the last bias, same length and shape
        before = _weights(model)
        (model(torch.ones(1, 2)).sum() + (outside * float("nan")).sum()).backward()
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        handle.close()
    assert _same(model, before)
    assert "(parameter 3 of the optimizer, outside the watched model) nan (1 of 4 parameters)" in info.value.report
