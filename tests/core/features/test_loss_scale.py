"""core/features/loss_scale/: nanwatch under a real `torch.amp.GradScaler` on the CPU, with float16 and bfloat16
autocast.

Inf gradients on steps the scaler skips are expected (recorded, the run goes on, the scale history kept); a scale
below `min_loss_scale`, non-finite activations or a non-finite loss, and inf/nan gradients on a step the scaler lets
through stop the run.

Every test runs twice: with the scale read at once, as on the CPU, and copied in the plain loop's forward pre-hook
and read with the check, as on a GPU (where reading it in the hook would make the host wait for the device).
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from tests.engine_helpers import loss_scale
from tests.models import InfInBackward, small_mlp
from torch import nn

from nanwatch import ConfigError, LossScaleBelowFloor, NonFiniteError, WatchConfig, WatchHandle, watch
from nanwatch.core.features.loss_scale import LossScaleHistory, ScaleRecord
from nanwatch.core.features.loss_scale import monitor as loss_scale_monitor
from nanwatch.core.frames import resolve
from nanwatch.core.watcher import Watcher

COPIED = "copied in the hook"


@pytest.fixture(autouse=True, params=["read at once", COPIED])
def scale_reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == COPIED:  # as on a GPU: no device reads the scale at once
        monkeypatch.setattr(loss_scale_monitor, "READ_AT_ONCE_ON", frozenset())
    return str(request.param)


def _fp16_model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def _fp16_step(model: nn.Module, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """One float16-autocast step. With batch 1 the bias gradient is the loss scale itself (d sum / d out = 1): at
    the default 65536 it overflows float16 (max 65504), at 32768 it does not."""
    x = torch.randn(1, 4) * 0.01
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = out.float().sum()
    scaler.scale(loss).backward()
    return loss


# ------------------------------------------------------------------------------------------ skipped steps


def test_an_overflow_on_a_skipped_step_is_recorded_and_the_run_goes_on(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = _fp16_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")  # init_scale 65536
    weights: list[torch.Tensor] = []
    with watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True) as handle:
        for _ in range(3):
            weights.append(model.weight.detach().clone())
            _fp16_step(model, scaler, optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            handle.step()
        monitor = loss_scale(handle.watcher)
        assert monitor is not None
        history = monitor.history()
    assert torch.equal(weights[0], weights[1])  # step 0 was skipped by the scaler...
    assert not torch.equal(weights[1], weights[2])  # ...step 1 was applied
    assert torch.isfinite(model.weight).all()
    assert handle.optimizer_step == 2  # the skipped step never ran optimizer.step()
    assert [(r.batch_number, r.scale) for r in history.records] == [(0, 65536.0), (0, 32768.0)]
    assert history.skipped_steps == 1
    assert history.gradient_overflows >= 1
    assert all(overflow.skipped for overflow in monitor.overflows)
    assert monitor.overflows[0].report.module_name == ""  # the root Linear: its bias gradient overflowed
    assert monitor.overflows[0].report.frames[-1].is_backward
    messages = [r.getMessage() for r in nanwatch_log.records]
    skipped = "at loss scale 65536: the GradScaler skipped its step (scale now 32768); going on"
    assert any("batch_number=0, first in module '' (backward)" in m and skipped in m for m in messages)
    assert monitor.overflows[0].scale == 65536.0  # the scale its gradients were computed with
    assert not any(r.levelno >= logging.ERROR for r in nanwatch_log.records)


def test_step_called_before_the_scaler_steps_confirms_the_skip_later() -> None:
    model = _fp16_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True) as handle:
        monitor = loss_scale(handle.watcher)
        assert monitor is not None
        for batch in range(3):
            _fp16_step(model, scaler, optimizer)
            handle.step()  # before scaler.step(): the scaler has not decided yet
            if batch == 0:
                assert [overflow.skipped for overflow in monitor.overflows] == [False]
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert [overflow.skipped for overflow in monitor.overflows] == [True]  # seen at batch 1's reading
    assert handle.optimizer_step == 2


def _scale_history_of_a_loop(*, step_first: bool, accumulate: int) -> tuple[LossScaleHistory, WatchHandle]:
    """8 micro-batches, an optimizer step every `accumulate`; `handle.step()` before `scaler.step()` or after
    `scaler.update()`. The scale starts far too high, so the first steps are skipped."""
    model = _fp16_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**19, growth_interval=2)
    with watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True) as handle:
        for batch in range(8):
            _fp16_step(model, scaler, optimizer)
            if step_first:
                handle.step()
            if batch % accumulate == accumulate - 1:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            if not step_first:
                handle.step()
    monitor = loss_scale(handle.watcher)  # closed: the last micro-batch's step is read too
    assert monitor is not None
    assert monitor.overflows
    assert all(overflow.skipped for overflow in monitor.overflows)
    return monitor.history(), handle


def _scale_changes(history: LossScaleHistory) -> list[tuple[int, float]]:
    return [(record.batch_number, record.scale) for record in history.records]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_skips_seen_with_step_before_the_scaler_are_put_on_the_batch_that_stepped(accumulate: int) -> None:
    # With step() first, a skip's drop is read as the next micro-batch starts, and put on the one that stepped.
    first, handle = _scale_history_of_a_loop(step_first=True, accumulate=accumulate)
    after, handle_after = _scale_history_of_a_loop(step_first=False, accumulate=accumulate)
    history, history_after = _scale_changes(first), _scale_changes(after)
    assert history == history_after
    assert handle.optimizer_step == handle_after.optimizer_step
    if accumulate == 1:
        assert history == [
            (0, 2.0**19),
            (0, 2.0**18),
            (1, 2.0**17),
            (2, 2.0**16),
            (3, 2.0**15),
            (5, 2.0**16),
            (6, 2.0**15),
        ]
        assert handle.optimizer_step == 3
    else:  # the scaler steps on micro-batches 1, 3, 5, 7
        assert history == [(0, 2.0**19), (1, 2.0**18), (3, 2.0**17), (5, 2.0**16), (7, 2.0**15)]
        assert handle.optimizer_step == 0


@pytest.mark.parametrize("step_first", [True, False], ids=["step-before-scaler", "step-after-update"])
def test_inf_gradients_let_through_after_a_skipped_step_never_reach_the_weights(
    tmp_path: Path, step_first: bool
) -> None:
    # Batch 0: the float16 bias gradient overflows at 65536, the scaler skips and halves the scale. Batch 1: at 32768
    # the parameters' gradients are finite, so the scaler steps, but the input's gradient (never checked by the
    # scaler) is inf. Read in step() before scaler.step(), batch 0's drop must not pass for batch 1's skip.
    torch.manual_seed(0)
    model = nn.Sequential(InfInBackward(), nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True, report_dir=tmp_path)
    weights: list[torch.Tensor] = []
    stages: list[str] = []

    def loop() -> None:
        for _ in range(3):
            weights.append(model[1].weight.detach().clone())
            x = (torch.randn(1, 4) * 0.01).requires_grad_()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(out.float().sum()).backward()
            if step_first:
                stages.append("handle.step")
                handle.step()
            stages.append("scaler.step")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if not step_first:
                stages.append("handle.step")
                handle.step()

    with pytest.raises(NonFiniteError) as info:
        loop()
    handle.close()
    assert stages[-1] == "scaler.step"  # raised by the optimizer's step pre-hook...
    assert len(weights) == 2  # ...in batch 1
    assert torch.equal(weights[0], weights[1])  # batch 0 was skipped by the scaler
    assert torch.equal(model[1].weight, weights[1])  # batch 1's step never ran
    assert handle.optimizer_step == 0
    assert info.value.batch_number == 1
    assert info.value.module_name == "0"
    assert "Loss scale (GradScaler): 65536 at batch 0 -> 32768 at batch 0;" in info.value.report
    assert "Detected inf/nan during batch_number=1" in (tmp_path / "nanwatch-report-rank0-batch1.txt").read_text()


def test_the_scale_history_follows_many_skips_and_growth() -> None:
    # Starts far too high: skipped steps halve it down to 32768, then it grows after 2 clean steps, and overflows.
    history, _ = _scale_history_of_a_loop(step_first=False, accumulate=1)
    scales = [record.scale for record in history.records]
    assert scales[:5] == [2.0**19, 2.0**18, 2.0**17, 2.0**16, 2.0**15]
    assert 2.0**16 in scales[5:]  # growth back to 65536, which overflows again
    assert scales[-1] == 2.0**15
    assert history.skipped_steps == sum(1 for a, b in zip(scales, scales[1:], strict=False) if b < a)
    text = history.to_text()
    assert text.startswith("Loss scale (GradScaler): 524288 at batch 0 -> 262144 at batch 0 -> 131072 at batch 1")
    assert "min_loss_scale=1" in text


def test_a_fused_optimizer_sees_found_inf_and_skips_itself() -> None:
    model = _fp16_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)  # unscales in its own step
    scaler = torch.amp.GradScaler("cpu")
    with watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True) as handle:
        before = model.weight.detach().clone()
        _fp16_step(model, scaler, optimizer)
        scaler.step(optimizer)  # calls optimizer.step() (pre-hook included) with found_inf set: no error
        scaler.update()
        optimizer.zero_grad()
        handle.step()
        assert torch.equal(model.weight, before)
        monitor = loss_scale(handle.watcher)
        assert monitor is not None
        assert all(overflow.skipped for overflow in monitor.overflows)
        assert len(monitor.overflows) == 1


# --------------------------------------------------------------------------------------------- fatal


def _scaled_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, handle: WatchHandle, count: int
) -> None:
    for _ in range(count):
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        handle.step()


def test_the_scale_falling_below_the_floor_stops_the_run_with_its_history(tmp_path: Path, scale_reading: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), InfInBackward(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    forwards = []  # forwards that ran to their end
    model.register_forward_hook(lambda module, args, output: forwards.append(1))
    handle = watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True, report_dir=tmp_path)
    with pytest.raises(LossScaleBelowFloor) as info:
        _scaled_steps(model, optimizer, scaler, handle, 10)
    handle.close()
    error = info.value
    assert isinstance(error, NonFiniteError)
    assert error.batch_number == 3  # 8 -> 4 -> 2 -> 1 -> 0.5, the fourth skipped step
    assert error.loss_scale == 0.5
    assert error.min_loss_scale == 1.0
    # Read at once, the scale stops the run as micro-batch 4 starts; copied in that micro-batch's pre-hook, it is
    # read with its check, and micro-batch 4 (one more skipped step) ran first.
    later = scale_reading == COPIED
    assert len(forwards) == 4 + later
    scales = [8.0, 4.0, 2.0, 1.0, 0.5] + [0.25] * later
    assert [scale for _, _, scale in error.scale_history] == scales
    assert [batch for batch, _, _ in error.scale_history] == [0, 0, 1, 2, 3] + [4] * later
    assert error.module_name == "1"  # where the last overflow first appeared
    assert "below min_loss_scale=1" in str(error)
    assert "Loss scale (GradScaler): 8 at batch 0 -> 4 at batch 0 -> 2 at batch 1" in error.report
    assert "1 InfInBackward (backward)" in error.report
    # On disk before it was raised, as text and JSON.
    text = (tmp_path / "nanwatch-report-rank0-batch3.txt").read_text()
    assert f"{4 + later} skipped steps" in text
    data = json.loads((tmp_path / "nanwatch-report-rank0-batch3.json").read_text())
    assert data["loss_scale"]["current"] == scales[-1]
    assert data["loss_scale"]["skipped_steps"] == 4 + later
    assert [r["scale"] for r in data["loss_scale"]["records"]] == scales
    assert data["loss_scale"]["min_loss_scale"] == 1.0
    assert handle.optimizer_step == 0  # not one step ran


def test_a_scale_copied_in_the_hook_is_read_only_when_it_changed(scale_reading: str) -> None:
    # Finite gradients: the scale doubles after every 3 steps. Read at once, the plain loop reads it in the forward
    # pre-hook of every micro-batch after the first; copied there, it is never read in a forward, only with the
    # check that saw it change, and the history is the same.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    in_forward = []
    model.register_forward_pre_hook(lambda module, args: in_forward.append(True))  # before nanwatch's pre-hook
    model.register_forward_hook(lambda module, args, output: in_forward.clear())
    reads_in_forward = []
    get_scale = scaler.get_scale
    scaler.get_scale = lambda: (reads_in_forward.append(bool(in_forward)), get_scale())[1]  # type: ignore[method-assign]
    with watch(model, optimizer=optimizer, scaler=scaler) as handle:
        _scaled_steps(model, optimizer, scaler, handle, 8)
        monitor = loss_scale(handle.watcher)
        assert monitor is not None
        history = monitor.history()
    assert _scale_changes(history) == [(0, 8.0), (2, 16.0), (5, 32.0)]
    assert sum(reads_in_forward) == (0 if scale_reading == COPIED else 7)


def test_the_floor_is_configurable_and_can_be_switched_off() -> None:
    for floor, raises in ((16.0, True), (None, False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), InfInBackward())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        with watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True, min_loss_scale=floor) as handle:
            if raises:
                with pytest.raises(LossScaleBelowFloor) as info:
                    _scaled_steps(model, optimizer, scaler, handle, 8)
                assert info.value.loss_scale == 8.0
                assert info.value.batch_number == 2
            else:
                _scaled_steps(model, optimizer, scaler, handle, 8)  # 64 -> 0.25, on and on
                assert scaler.get_scale() == 0.25


def test_the_floor_works_without_watch_gradients() -> None:
    # Without backward frames nanwatch sees no overflow, but the scale it reads still falls.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), InfInBackward())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    with watch(model, optimizer=optimizer, scaler=scaler) as handle, pytest.raises(LossScaleBelowFloor) as info:
        _scaled_steps(model, optimizer, scaler, handle, 4)
    assert info.value.batch_number == 1
    assert info.value.module_name is None
    assert "Loss scale (GradScaler): 2 at batch 0 -> 1 at batch 0 -> 0.5 at batch 1" in info.value.report


def test_inf_in_a_forward_activation_is_fatal_under_a_scaler() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e4)  # float16 output 4e4 * 4 inputs > 65504
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def loop() -> None:
        with watch(model, optimizer=optimizer, scaler=scaler) as handle:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.full((1, 4), 2.0))
            scaler.scale(out.float().sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            handle.step()

    with pytest.raises(NonFiniteError) as info:
        loop()
    assert not isinstance(info.value, LossScaleBelowFloor)
    assert info.value.module_name == "0"
    assert "Loss scale (GradScaler): 65536 at batch 0" in info.value.report


def test_a_non_finite_loss_given_to_watch_loss_is_fatal_under_a_scaler() -> None:
    model = _fp16_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def loop() -> None:
        with watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True) as handle:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(1, 4))
            loss = (out.float() * 1e38).sum() * 1e38  # inf in float32, computed outside the model
            scaler.scale(handle.watch_loss(loss)).backward()
            scaler.step(optimizer)
            scaler.update()
            handle.step()

    with pytest.raises(NonFiniteError) as info:
        loop()
    assert info.value.module_name == "(loss)"
    assert "(loss) Tensor" in info.value.report


def test_inf_gradients_on_a_step_the_scaler_lets_through_are_fatal() -> None:
    # x requires grad but is no parameter: the scaler never looks at its inf gradient and steps.
    torch.manual_seed(0)
    model = nn.Sequential(InfInBackward(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for step_first in (True, False):  # handle.step() after the scaler's step, or before it
        with watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True) as handle:
            x = torch.randn(2, 4, requires_grad=True)
            scaler.scale(model(x).sum()).backward()
            before = model[1].weight.detach().clone()
            if not step_first:
                handle.step()  # inf gradients, but the scaler has not decided yet: the run goes on
            with pytest.raises(NonFiniteError) as info:
                scaler.step(optimizer)  # the scaler finds its parameters' gradients finite; the pre-hook raises
            handle.watcher.close(check=False)
        assert torch.equal(model[1].weight, before)  # the step did not run
        assert info.value.module_name == "0"
        assert "Loss scale (GradScaler)" in info.value.report
        optimizer.zero_grad()
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)


def test_an_overflow_held_between_checks_is_raised_when_the_step_runs(tmp_path: Path) -> None:
    # The core API as an adapter whose micro-batch check comes before the optimizer's pre-hook drives it (Lightning).
    torch.manual_seed(0)
    model = nn.Sequential(InfInBackward(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher = Watcher(model, WatchConfig(watch_gradients=True, report_dir=tmp_path))
    watcher.watch_scaler(torch.amp.GradScaler("cpu", init_scale=4.0))
    watcher.attach()
    try:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        watcher.end_batch()  # inf gradients: held for the scaler's verdict, no error
        with pytest.raises(NonFiniteError) as info:
            watcher.on_optimizer_step("before", optimizer)  # the verdict: the step is about to run
    finally:
        watcher.close(check=False)
    assert (info.value.batch_number, info.value.module_name) == (0, "0")
    assert "Loss scale (GradScaler)" in info.value.report
    assert (tmp_path / "nanwatch-report-rank0-batch0.txt").exists()


def test_a_disabled_scaler_is_no_excuse() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), InfInBackward(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # `GradScaler(enabled=use_amp)` with use_amp False
    with watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True):
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        with pytest.raises(NonFiniteError) as info:
            scaler.step(optimizer)
    assert info.value.module_name == "1"


# ---------------------------------------------------------------------------------------------- bfloat16


def test_bfloat16_autocast_gradients_are_recorded_in_their_dtype() -> None:
    model = small_mlp(scale=False, inplace=True)
    with watch(model, watch_gradients=True, max_frames_to_save=100) as handle:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(2, 4))
        out.float().sum().backward()
        frames = resolve(handle.watcher.recent_frames())
        handle.step()
    dtypes = {(f.module_name, e.label): e.dtype for f in frames if f.is_backward for e in f.entries}
    assert dtypes[("2", "grad output")] == "bfloat16"
    assert dtypes[("0", "grad weight")] == "float32"  # accumulated into the float32 parameter


# ------------------------------------------------------------------------------------------- bad input


def test_a_scaler_that_is_not_one_is_refused_with_no_hook_left() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler.*got float"):
        watch(model, scaler=1.0)  # type: ignore[arg-type]
    assert not model._forward_hooks


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True])
def test_min_loss_scale_must_be_a_positive_finite_number(value: object) -> None:
    with pytest.raises(ValueError, match="min_loss_scale"):
        WatchConfig(min_loss_scale=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="field 'min_loss_scale'"):
        WatchConfig.from_dict({"min_loss_scale": value})
    with pytest.raises(ConfigError, match="min_loss_scale"):
        watch(nn.Linear(2, 2), min_loss_scale=value)


def test_loss_scale_error_survives_pickling() -> None:
    error = LossScaleBelowFloor(
        "m",
        loss_scale=0.5,
        min_loss_scale=1.0,
        scale_history=[(0, None, 1.0), (1, None, 0.5)],
        batch_number=1,
        rank=0,
        module_name="x",
        report="r",
    )
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is LossScaleBelowFloor
    assert (copy.loss_scale, copy.scale_history, copy.batch_number, str(copy)) == (0.5, error.scale_history, 1, "m")


def test_history_text_and_dict_when_older_changes_are_dropped() -> None:
    records = (ScaleRecord(0, None, 65536.0), ScaleRecord(900, 450, 0.0009765625))
    history = LossScaleHistory(records, skipped_steps=70, gradient_overflows=71, min_loss_scale=None, dropped=69)
    assert history.to_text() == (
        "Loss scale (GradScaler): 65536 at batch 0 -> ... 69 earlier changes ... -> 0.0009765625 at batch 900; "
        "70 skipped steps, 71 gradient overflows tolerated; min_loss_scale=none"
    )
    assert history.to_dict()["records"][1] == {"batch_number": 900, "optimizer_step": 450, "scale": 0.0009765625}
    assert history.to_dict()["current"] == 0.0009765625
