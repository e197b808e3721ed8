"""Sentinel mode with an optimizer that takes `found_inf`: the check decided on the device, read a step later.

The fused AdamW is handed the check's flag, skips its own update when anything was inf/nan, and the host reads the
verdict when the next step is about to run (core/engine/decided_on_device.py). What must hold: no host read of the
step's own values before its update, the detection named as of the step it refused, no bad update applied, the
optimizer left as it was found, and a plain optimizer (or a GradScaler's flag) still decided on the host.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import nanwatch
from nanwatch import NonFiniteError

BAD = 3  # the micro-batch whose input holds a nan


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values (item, tolist, bool, float), by the step they happened in."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def model_and_optimizer(*, fused: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    kind: dict[str, bool] = {"fused": True} if fused else {"foreach": True}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, **kind)


def inputs(batch: int) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(batch))
    if batch == BAD:
        x[0, 0] = float("nan")
    return x


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> None:
    model(inputs(batch)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, handle: Any, batches: int, seen: list[Any]) -> None:
    """`batches` steps; `seen` gets each batch number as it starts, and the state as it was before the bad one."""
    for batch in range(batches):
        if batch == BAD:
            seen.append(copy.deepcopy((model.state_dict(), optimizer.state_dict())))
        seen.append(batch)
        step(model, optimizer, batch)
        handle.step()


def test_a_nan_is_raised_at_the_next_step_as_of_the_step_it_refused_with_the_weights_untouched() -> None:
    model, optimizer = model_and_optimizer()
    handle = nanwatch.watch(model, mode="sentinel", optimizer=optimizer, report_dir=None)
    seen: list[Any] = []
    with pytest.raises(NonFiniteError) as caught:
        train(model, optimizer, handle, 8, seen)
    handle.close()
    error = caught.value
    assert seen[-1] == BAD + 1  # read once the next step was queued: raised before that step applies
    before_bad_step = next(item for item in seen if isinstance(item, tuple))
    assert (error.batch_number, error.optimizer_step) == (BAD, BAD)
    assert error.replay == "reproduced"
    assert error.cause is not None
    assert error.cause.kind == "data"
    assert "the step did not run" in error.report
    weights, state = before_bad_step
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in weights.items())
    for param_state, kept in zip(optimizer.state_dict()["state"].values(), state["state"].values(), strict=True):
        assert all(torch.equal(param_state[key], kept[key]) for key in kept)  # step, moments: no update counted
    assert not hasattr(optimizer, "found_inf")  # the optimizer is left as it was found


def test_no_host_read_comes_before_a_steps_update_only_the_last_steps_verdict_after() -> None:
    model, optimizer = model_and_optimizer()
    reads_by_step = []
    with nanwatch.watch(model, mode="sentinel", optimizer=optimizer, report_dir=None) as handle:
        for _ in range(4):
            with HostReads() as counted:
                model(inputs(0)).pow(2).mean().backward()
                reads_before_update = list(counted.reads)
                optimizer.step()  # the check launched, handed over; the last step's verdict read first
                optimizer.zero_grad()
                handle.step()
            reads_by_step.append((reads_before_update, counted.reads))
    assert all(before == [] for before, _ in reads_by_step)
    # The first step is decided on the host (it makes the optimizer's state, which a skipped step would leave
    # unmade): its one read, at the step. The second is handed over and read at the third, and so on.
    assert [len(reads) for _, reads in reads_by_step] == [1, 0, 1, 1]


def test_under_skip_the_step_is_listed_and_the_run_ends_as_one_that_never_took_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, optimizer = model_and_optimizer()
    twin, twin_optimizer = model_and_optimizer()
    with nanwatch.watch(model, mode="sentinel", optimizer=optimizer, on_detect="skip", report_dir=None) as handle:
        for batch in range(6):
            step(model, optimizer, batch)
            handle.step()
    for batch in range(6):  # the twin skips the bad micro-batch's step by hand
        if batch == BAD:
            twin(inputs(batch)).pow(2).mean().backward()
            twin_optimizer.zero_grad()
            continue
        step(twin, twin_optimizer, batch)
    assert [(entry["batch_number"], entry["optimizer_step"]) for entry in handle.skipped] == [(BAD, BAD)]
    assert f"optimizer step {BAD} skipped" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    assert not hasattr(optimizer, "found_inf")


def test_a_nan_in_the_last_step_is_raised_when_watching_ends() -> None:
    model, optimizer = model_and_optimizer()

    def run() -> None:
        with nanwatch.watch(model, mode="sentinel", optimizer=optimizer, report_dir=None) as handle:
            train(model, optimizer, handle, BAD + 1, [])

    with pytest.raises(NonFiniteError) as caught:
        run()
    assert (caught.value.batch_number, caught.value.optimizer_step) == (BAD, BAD)  # as of the step it refused
    assert all(torch.isfinite(param).all() for param in model.parameters())
    assert not hasattr(optimizer, "found_inf")


def test_an_evaluation_between_steps_concludes_the_last_step_first(capsys: pytest.CaptureFixture[str]) -> None:
    """An evaluation's check reads the last step's verdict first (its forward is queued by then), so the sentinel's
    finding in the training step is what is reported, not overwritten by the evaluation's outputs."""
    model, optimizer = model_and_optimizer()
    seen: list[Any] = []
    handle = nanwatch.watch(model, mode="sentinel", optimizer=optimizer, report_dir=None, watch_eval=True)

    def train_and_evaluate() -> None:
        for batch in range(BAD + 2):
            step(model, optimizer, batch)
            handle.step()
            seen.append(batch)
            model.eval()
            with torch.no_grad():
                model(inputs(0))
            handle.watcher.start_batch("eval")
            handle.watcher.end_batch()
            model.train()

    with pytest.raises(NonFiniteError) as caught:
        train_and_evaluate()
    handle.close()
    assert seen[-1] == BAD  # raised by the evaluation after the bad step, before any later step
    assert (caught.value.batch_number, caught.value.phase) == (BAD, "train")
    assert "the sentinel saw inf/nan in output of the model" in caught.value.report
    assert caught.value.replay == "reproduced"  # replayed in the training mode the step ran in


def test_a_plain_optimizer_is_decided_on_the_host_before_its_step() -> None:
    model, optimizer = model_and_optimizer(fused=False)
    handle = nanwatch.watch(model, mode="sentinel", optimizer=optimizer, report_dir=None)
    seen: list[Any] = []
    with pytest.raises(NonFiniteError) as caught:
        train(model, optimizer, handle, 8, seen)
    handle.close()
    assert seen[-1] == BAD  # at its own step: the one read stays
    assert caught.value.batch_number == BAD
    assert not hasattr(optimizer, "found_inf")


def test_a_gradscalers_flag_is_never_replaced() -> None:
    """Under a GradScaler the fused optimizer is handed the scaler's `found_inf`: nanwatch leaves it to the scaler
    and decides on the host, and an overflow the scaler skips is not nanwatch's to report."""
    model, optimizer = model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    handed = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: handed.append(getattr(opt, "found_inf", None)))
    with nanwatch.watch(model, mode="sentinel", optimizer=optimizer, scaler=scaler, report_dir=None) as handle:
        for _ in range(3):
            scaler.scale(model(inputs(0)).pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            handle.step()
    assert len(handed) == 3
    assert all(flag is not None for flag in handed)
    assert handle.watcher.counters.optimizer_step == 3
    assert not hasattr(optimizer, "found_inf")


def test_a_headroom_warning_never_skips_a_step() -> None:
    """Only what detects inf/nan goes into the optimizer's flag: a loss near float16's largest value warns (the
    headroom check), and every step still applies."""
    model, optimizer = model_and_optimizer()
    with nanwatch.watch(model, mode="sentinel", optimizer=optimizer, report_dir=None) as handle:
        for batch in range(5):
            loss = model(inputs(0)).pow(2).mean()
            handle.watch_loss(loss.half() * 0 + torch.tensor(6.0e4, dtype=torch.float16))
            loss.backward()
            before = [param.detach().clone() for param in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
            if batch > 0:  # (the first step is the host's)
                assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), batch


def test_a_skipped_first_step_leaves_no_unmade_state_behind() -> None:
    """Fused SGD makes its momentum with `empty_like` in its first step: told to skip that step, it would keep
    garbage. The first step is decided on the host, so a nan there is skipped by clearing the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    with nanwatch.watch(model, mode="sentinel", optimizer=optimizer, on_detect="skip", report_dir=None) as handle:
        for batch in range(4):
            x = inputs(10 + batch)
            if batch == 0:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
    assert [entry["batch_number"] for entry in handle.skipped] == [0]
    assert all(torch.isfinite(param).all() for param in model.parameters())


def test_a_nan_in_the_last_step_is_raised_by_close_too() -> None:
    model, optimizer = model_and_optimizer()
    handle = nanwatch.watch(model, mode="sentinel", optimizer=optimizer, report_dir=None)
    train(model, optimizer, handle, BAD + 1, [])
    with pytest.raises(NonFiniteError) as caught:
        handle.close()
    assert (caught.value.batch_number, caught.value.optimizer_step) == (BAD, BAD)
