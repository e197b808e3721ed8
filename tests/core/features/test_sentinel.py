"""core/features/sentinel/: sentinel mode on the plain loop, against full mode.

The replay of the failing micro-batch must give, value for value, the frames full mode records for it: on every
model of the differential tests (which full mode matches transformers' tool on), with BatchNorm and Dropout, for a nan
born in backward inside a gradient accumulation window, and under fp16 autocast with a GradScaler. The buffers and the
random generators end as they were; only the current window's inputs are kept; bad input is refused clearly; a
replay that itself fails leaves the detection standing.
"""

from __future__ import annotations

import gc
import json
import os
import random
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.models import NanInBackward, small_mlp
from tests.test_watch_differential import SCENARIOS, SEED
from torch import nn

import nanwatch
import nanwatch.core.features.sentinel.feature
from nanwatch import ConfigError, NonFiniteError, WatchConfig

REPLAYED = "reproduced by replaying micro-batch"


def _report_frames(report_dir: Path, batch: int) -> list[dict[str, Any]]:
    path = report_dir / f"nanwatch-report-rank0-batch{batch}.json"
    frames: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))["frames"]
    return [frame for frame in frames if frame["batch_number"] == batch]


# ------------------------------------------------------------------------------ the differential models

# Values a later module maps back into range never reach the output: an inf an in-place ReLU overwrites, an inf a
# Tanh saturates to 1. Full mode sees them in the frame recorded when they were made; sentinel mode, which watches no
# module, sees them only once they reach the output, the loss or (in training, as nan) the gradients. The README's
# "how to choose a mode" says so.
HIDDEN_FROM_THE_OUTPUT = ("mlp-inf-hidden-by-inplace-relu", "twice-inf-batch1")
SEEN_BY_SENTINEL = sorted(name for name in SCENARIOS if name not in HIDDEN_FROM_THE_OUTPUT)


def _run_scenario(name: str, mode: str, report_dir: Path) -> NonFiniteError:
    scenario = SCENARIOS[name]
    torch.manual_seed(SEED)
    model = scenario.build()
    torch.manual_seed(SEED + 1)
    with nanwatch.watch(model, mode=mode, report_dir=report_dir, max_frames_to_save=200) as handle:
        for index in range(scenario.batches):
            scenario.forward(model, index)
            try:
                handle.step()
            except NonFiniteError as error:
                assert index == scenario.detect_batch
                return error
            scenario.update(model)
    raise AssertionError(f"{mode}: nothing detected in {name}")


@pytest.mark.parametrize("name", SEEN_BY_SENTINEL)
def test_the_replay_records_the_frames_full_mode_records(name: str, tmp_path: Path) -> None:
    full = _run_scenario(name, "full", tmp_path / "full")
    sentinel = _run_scenario(name, "sentinel", tmp_path / "sentinel")

    batch = SCENARIOS[name].detect_batch
    assert (
        (sentinel.batch_number, sentinel.module_name)
        == (full.batch_number, full.module_name)
        == (
            batch,
            SCENARIOS[name].culprit,
        )
    )
    assert REPLAYED in sentinel.report
    replayed = _report_frames(tmp_path / "sentinel", batch)
    assert replayed == _report_frames(tmp_path / "full", batch)
    assert replayed, "no frame of the failing batch"
    assert str(sentinel.culprit) == str(full.culprit)


@pytest.mark.parametrize("name", HIDDEN_FROM_THE_OUTPUT)
def test_an_inf_that_never_reaches_the_output_is_not_seen_by_the_sentinel(name: str) -> None:
    scenario = SCENARIOS[name]
    torch.manual_seed(SEED)
    model = scenario.build()
    with nanwatch.watch(model, mode="sentinel") as handle:
        for index in range(scenario.batches):
            scenario.forward(model, index)
            handle.step()  # the output stays finite: nothing to see
            scenario.update(model)
    assert handle.batch_number == scenario.batches


# ------------------------------------------------------------------------------ BatchNorm and Dropout


class BlowupAbove(nn.Module):
    """Multiplies by 1e39 (inf in float32) when its input's first value is above `threshold`."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e39 if float(x[0, 0]) > self.threshold else x


def _bn_dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), BlowupAbove(1.5), nn.Linear(16, 1)
    )


def _train(model: nn.Module, mode: str, report_dir: Path, steps: int = 8) -> tuple[NonFiniteError, int]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    random.seed(1)
    with nanwatch.watch(model, optimizer=optimizer, mode=mode, report_dir=report_dir) as handle:
        for index in range(steps):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(index))
            y = torch.randn(6, 1, generator=torch.Generator().manual_seed(100 + index))
            loss = nn.functional.mse_loss(model(x), y)  # dropout draws from the global generator
            loss.backward()
            try:
                optimizer.step()
            except NonFiniteError as error:
                return error, index
            optimizer.zero_grad()
            handle.step()
    raise AssertionError(f"{mode}: nothing detected")


def test_batchnorm_and_dropout_replay_exactly_and_the_buffers_end_as_they_were(tmp_path: Path) -> None:
    full_model, sentinel_model = _bn_dropout_net(), _bn_dropout_net()
    full, full_at = _train(full_model, "full", tmp_path / "full")
    full_rng = torch.get_rng_state()
    sentinel, sentinel_at = _train(sentinel_model, "sentinel", tmp_path / "sentinel")
    sentinel_rng = torch.get_rng_state()

    assert full_at == sentinel_at == full.batch_number == sentinel.batch_number
    assert full_at > 0, "the fault must come after a few steps, so the running stats have moved"
    assert sentinel.module_name == full.module_name == "4"
    assert REPLAYED in sentinel.report
    frames = _report_frames(tmp_path / "sentinel", full_at)
    assert frames == _report_frames(tmp_path / "full", full_at)
    assert any(frame["class"] == "Dropout" for frame in frames)
    # The replay put the running stats back as the run left them, and the generators too: the two runs are the same.
    for (name, a), (_, b) in zip(full_model.state_dict().items(), sentinel_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(full_rng, sentinel_rng), "the replay left the random generator moved"


# ------------------------------------------------------------------------------ backward, accumulation window


class BackwardFaultAt(nn.Module):
    """A nan gradient in backward when its input holds a value above `threshold` (the forward is the identity)."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold
        self.nan = NanInBackward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nan(x) if float(x.abs().max()) > self.threshold else x


def _accumulating(mode: str, report_dir: Path, *, watch_gradients: bool) -> tuple[NonFiniteError, list[int]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), BackwardFaultAt(50.0), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = [torch.randn(2, 4) for _ in range(6)]
    inputs[4][0, 0] = 1e3  # micro-batch 4: the second of the window {3, 4, 5}
    stepped: list[int] = []
    options: dict[str, Any] = {"watch_gradients": True} if watch_gradients else {}
    with nanwatch.watch(model, optimizer=optimizer, mode=mode, report_dir=report_dir, **options) as handle:
        for index, x in enumerate(inputs):
            model(x).sum().div(3).backward()
            try:
                if index % 3 == 2:
                    optimizer.step()
                    optimizer.zero_grad()
                    stepped.append(index)
                handle.step()
            except NonFiniteError as error:
                return error, stepped
    raise AssertionError(f"{mode}: nothing detected")


def test_a_nan_born_in_backward_is_replayed_through_the_window_until_it_reproduces(tmp_path: Path) -> None:
    sentinel, stepped = _accumulating("sentinel", tmp_path / "sentinel", watch_gradients=False)

    assert stepped == [2], "the step of the window {3, 4, 5} ran"
    assert sentinel.batch_number == 4  # found by replaying 3, then 4 (detected at 5's step)
    assert f"{REPLAYED} 4 " in sentinel.report
    assert "non-finite gradients about to be applied" in sentinel.report
    full, _ = _accumulating("full", tmp_path / "full", watch_gradients=True)
    assert full.batch_number == 4
    replayed = _report_frames(tmp_path / "sentinel", 4)
    # The replay's backward accumulates into parameters of its own (no `.grad` of the run is touched, no DDP hook
    # fires), summed over the window as `.grad` is: every frame full mode with watch_gradients records, value for
    # value, the parameters' `grad weight` lines included.
    assert replayed == _report_frames(tmp_path / "full", 4)
    assert any(entry["label"] == "grad weight" for frame in replayed for entry in frame["entries"])
    assert "the run's .grad and its hooks untouched" in sentinel.report


# ------------------------------------------------------------------------------ fp16 and a GradScaler


def test_fp16_autocast_with_a_grad_scaler_replays_under_the_same_autocast(tmp_path: Path) -> None:
    def run(mode: str) -> NonFiniteError:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")  # 65536: the first steps overflow and are skipped, as expected
        with nanwatch.watch(model, optimizer=optimizer, scaler=scaler, mode=mode, report_dir=tmp_path / mode) as h:
            for index in range(6):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(index))
                if index == 4:
                    x = x * 3e4  # float16 overflows in the second Linear
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                scaler.scale(out.float().sum()).backward()
                try:
                    scaler.step(optimizer)  # checked here, or (a step the scaler skips) in h.step()
                    scaler.update()
                    optimizer.zero_grad()
                    h.step()
                except NonFiniteError as error:
                    return error
        raise AssertionError(f"{mode}: nothing detected")

    full, sentinel = run("full"), run("sentinel")
    assert sentinel.batch_number == full.batch_number == 4
    assert sentinel.module_name == full.module_name
    assert REPLAYED in sentinel.report
    frames = _report_frames(tmp_path / "sentinel", 4)
    assert frames == _report_frames(tmp_path / "full", 4)
    assert {entry["dtype"] for frame in frames for entry in frame["entries"]} >= {"float16"}


# ------------------------------------------------------------------------------ memory


@pytest.mark.slow
def test_only_the_current_windows_inputs_are_kept() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[weakref.ref[torch.Tensor]] = []
    # Kept by reference (copied, they would be let go at once): the references go with their window.
    with nanwatch.watch(model, optimizer=optimizer, mode="sentinel", sentinel_copy_inputs="never") as handle:
        for index in range(4):
            x = torch.randn(2, 4)
            kept.append(weakref.ref(x))
            model(x).sum().backward()
            del x
            gc.collect()
            assert kept[-1]() is not None, "the input of the micro-batch in flight is kept to replay it"
            if index % 2 == 1:  # a window of two micro-batches
                assert kept[-2]() is not None, "an input of the window was let go before its step"
                optimizer.step()
                optimizer.zero_grad()
            handle.step()
        model(torch.randn(2, 4))  # the next window begins
        gc.collect()
        assert [ref() is None for ref in kept] == [True, True, True, True]


# ------------------------------------------------------------------------------ no false alarm


class LargeButFinite(nn.Module):
    """Finite values whose float32 sum overflows (4 x 3e38), an empty output, and a -inf for a negative input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        large = self.fc(x) * 0 + 3e38
        if x[0, 0] < 0:
            large = large - torch.tensor([0.0, 0.0, 0.0, float("inf")])
        return {"large": large, "empty": x[:0]}


def test_large_finite_outputs_are_no_alarm_and_an_infinite_one_is() -> None:
    model = LargeButFinite()
    with nanwatch.watch(model, mode="sentinel") as handle:
        for _ in range(2):  # a check by sums would see inf here: 4 x 3e38 overflows float32
            assert not torch.isfinite(model(torch.ones(1, 2))["large"].sum())
            handle.step()
        model(-torch.ones(1, 2))
        with pytest.raises(NonFiniteError) as caught:
            handle.step()
    assert caught.value.batch_number == 2
    assert "the sentinel saw inf/nan in output.large of the model" in caught.value.report
    assert REPLAYED in caught.value.report


def test_large_finite_eval_outputs_are_no_alarm_and_an_infinite_one_is() -> None:
    # Evaluation outputs are summed and kept until their check: a sum that overflowed is told from an inf.
    model = LargeButFinite().eval()
    with nanwatch.watch(model, mode="sentinel", watch_eval=True) as handle, torch.no_grad():
        for _ in range(2):
            model(torch.ones(1, 2))
        with pytest.raises(NonFiniteError) as caught:
            model(-torch.ones(1, 2))
    assert (caught.value.phase, caught.value.batch_number) == ("eval", 2)
    assert handle.watcher.counters.eval_batch_number == 2
    assert "the sentinel saw inf/nan in output.large of the model" in caught.value.report


# ------------------------------------------------------------------------------ bad input, failing replays


def test_a_mode_that_is_not_one_of_the_two_names_the_field() -> None:
    with pytest.raises(ConfigError, match="mode"):
        nanwatch.watch(nn.Linear(2, 2), mode="fast")
    with pytest.raises(ConfigError, match="trace_batch_nums"):
        nanwatch.watch(nn.Linear(2, 2), mode="sentinel", trace_batch_nums=[1])
    assert WatchConfig(mode="sentinel").mode == "sentinel"


class ReturnsAPlainValue(nn.Module):
    """A model whose forward returns a Python float or None: nothing sentinel mode can look at."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.returns = returns

    def forward(self, x: torch.Tensor) -> float | None:
        value = self.fc(x).sum()
        return float(value.detach()) if self.returns == "float" else None


@pytest.mark.parametrize(("returns", "said"), [("float", "returned a float ("), ("none", "returned None, ")])
def test_an_output_the_sentinel_cannot_read_is_said_once(returns: str, said: str) -> None:
    # Before: no check at all (no tensor output, no optimizer step), and not a word about it.
    model = ReturnsAPlainValue(returns)
    x = torch.full((1, 2), float("inf"))  # an inf or nan output, and nobody looks
    with nanwatch.watch(model, mode="sentinel") as handle:
        with pytest.warns(nanwatch.NanwatchWarning) as record:
            model(x)
        handle.step()
        model(x)  # said once
        handle.step()
    assert len(record) == 1
    message = str(record[0].message)
    assert f"the forward of ReturnsAPlainValue {said}" in message
    assert "so its output is not checked" in message
    assert "with no optimizer guarded, nothing else is either" in message
    for remedy in ("optimizer=", "watch_loss", "mode='full'"):
        assert remedy in message


def test_an_unreadable_output_with_a_guarded_optimizer_says_the_gradients_are_still_checked() -> None:
    model = ReturnsAPlainValue("none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode="sentinel", optimizer=optimizer) as handle:
        with pytest.warns(nanwatch.NanwatchWarning, match="only the gradients are checked, before each optimizer step"):
            model(torch.ones(1, 2))
        handle.step()


class TakesAnIterator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, xs: Iterator[torch.Tensor]) -> torch.Tensor:
        return torch.stack([self.fc(x) for x in xs]).sum(0)


def test_inputs_the_forward_uses_up_are_refused_with_a_clear_error() -> None:
    model = TakesAnIterator()
    with nanwatch.watch(model, mode="sentinel"), pytest.raises(TypeError, match="generator is used up by the forward"):
        model(x for x in [torch.ones(2), torch.ones(2)])
    with nanwatch.watch(model):  # full mode keeps no inputs: an iterator is fine
        assert model(iter([torch.ones(2)])).shape == (2,)


class FailsWhenRunAgain(nn.Module):
    """inf at its third call, and an error of its own at any later call (a replay's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 3:
            raise RuntimeError("cannot run twice")
        return self.fc(x) * (float("inf") if self.calls == 3 else 1.0)


def test_a_replay_that_raises_keeps_the_detection_and_adds_its_error(tmp_path: Path) -> None:
    model = FailsWhenRunAgain()
    rng_before: list[torch.Tensor] = []

    def run() -> None:
        with nanwatch.watch(model, mode="sentinel", report_dir=tmp_path) as handle:
            for _ in range(3):
                model(torch.ones(1, 2))
                rng_before[:] = [torch.get_rng_state()]
                handle.step()

    with pytest.raises(NonFiniteError) as caught:
        run()
    error = caught.value
    assert error.batch_number == 2
    assert "the sentinel saw inf/nan in output of the model" in error.report
    assert "the replay of this micro-batch failed: RuntimeError('cannot run twice')" in error.report
    assert "RuntimeError('cannot run twice')" in (tmp_path / "nanwatch-report-rank0-batch2.txt").read_text("utf-8")
    assert torch.equal(torch.get_rng_state(), rng_before[0]), "the replay left the generator moved"


# ------------------------------------------------------------------------------ torch.compile


@pytest.mark.slow
def test_a_compiled_model_is_watched_outside_its_graph_and_replayed_eagerly(tmp_path: Path) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = small_mlp(scale=False)
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train() -> None:
        with nanwatch.watch(compiled, optimizer=optimizer, mode="sentinel", report_dir=tmp_path) as handle:
            for index in range(5):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(index))
                if index == 3:
                    x[0, 0] = float("inf")
                compiled(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                handle.step()

    with pytest.raises(NonFiniteError) as caught:
        train()
    error = caught.value
    assert (error.batch_number, error.module_name) == (3, "0")  # no `_orig_mod.` in any name
    assert REPLAYED in error.report
    assert "_orig_mod" not in error.report
    assert "OptimizedModule" not in error.report
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert [frame["module"] for frame in _report_frames(tmp_path, 3)] == ["0"]


class RaisesInForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError("the user's own error")


def test_a_forward_that_raises_is_not_said_to_return_an_unreadable_output() -> None:
    # The sentinel's always-called hook also runs when the forward raised, with output None: the user's error is what
    # they see, with no word of an output that was never returned (and no warning torch has to silence).
    model = RaisesInForward()
    with warnings.catch_warnings(record=True) as caught, nanwatch.watch(model, mode="sentinel"):
        warnings.simplefilter("always")
        with pytest.raises(KeyError, match="the user's own error"):
            model(torch.ones(2))
    assert [str(w.message) for w in caught] == []


class OddOutput(nn.Module):
    """A model whose output is a float8, a jagged nested or a sparse tensor, scaled by `factor` (nan: non-finite;
    float8_e4m3fn has no inf: a cast saturates it to 448)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.kind = kind
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * self.factor
        if self.kind == "float8":
            return y.to(torch.float8_e4m3fn)
        if self.kind == "nested":
            return torch.nested.nested_tensor([y[0], y[1, :1]], layout=torch.jagged)
        return y.to_sparse()


@pytest.mark.parametrize("kind", ["float8", "nested", "sparse"])
def test_an_odd_output_type_is_read_and_its_inf_found_not_raised_in_the_forward(kind: str) -> None:
    # Before: torch.aminmax in the sentinel's output hook raised NotImplementedError inside the user's forward.
    torch.manual_seed(0)
    model = OddOutput(kind)
    x = torch.ones(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanwatch.NanwatchWarning)  # nothing to say of a readable output
        handle = nanwatch.watch(model, mode="sentinel")
        for _ in range(2):
            model(x)  # never raises here
            handle.step()
    model.factor = float("nan")
    model(x)
    with pytest.raises(NonFiniteError) as caught:
        handle.step()
    assert caught.value.batch_number == 2
    handle.close()


def test_a_failure_inside_the_sentinels_hooks_stops_watching_and_the_forward_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in nanwatch's sentinel")

    monkeypatch.setattr(nanwatch.core.features.sentinel.feature, "look_at", broken)
    model = small_mlp(scale=False)
    with nanwatch.watch(model, mode="sentinel") as handle:
        with pytest.warns(nanwatch.NanwatchWarning, match="stopped watching .*a bug in nanwatch's sentinel"):
            out = model(torch.ones(2, 4))  # the user's forward returns as if unwatched
        assert out.shape == (2, 1)
        handle.step()
        assert handle.watcher.disabled_reason is not None
        model(torch.ones(2, 4))  # watching is off: nothing raised, nothing said again
        handle.step()


class NumpyDice(nn.Module):
    """Draws from numpy's global generator in forward; the draw decides whether the output goes nan. Counts its calls
    in a plain Python attribute, as user code does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(self.calls)
        y = self.fc(x)
        return y * float("nan") if np.random.rand() > 0.8 else y


def _until_nan(model: NumpyDice, handle: Any) -> NonFiniteError:
    for _ in range(50):
        model(torch.ones(1, 2))
        try:
            handle.step()
        except NonFiniteError as error:
            return error
    raise AssertionError("the dice never came up nan")


def test_numpys_generator_drawn_in_forward_is_replayed_and_left_as_it_was() -> None:
    # Before: numpy's state was not kept, so the replay drew again from a moved generator and said "not reproduced".
    # Seed 7: the fifth draw comes up (> 0.8) and the sixth does not, so a replay that drew from the moved generator
    # would come out finite.
    np.random.seed(7)
    model = NumpyDice()
    handle = nanwatch.watch(model, mode="sentinel")
    error = _until_nan(model, handle)
    handle.close()
    after = np.random.get_state()
    assert error.batch_number == 4
    assert REPLAYED in error.report
    np.random.seed(7)
    for _ in range(5):  # the user's five draws, and not one more
        np.random.rand()
    expected = np.random.get_state()
    assert after[2] == expected[2], "the replay moved numpy's generator"
    assert np.array_equal(after[1], expected[1]), "the replay moved numpy's generator"


def test_the_replay_leaves_the_models_python_attributes_as_the_run_left_them() -> None:
    # Before: the replay ran the live model, so a forward's own counters advanced once more for every replayed call.
    np.random.seed(7)
    model = NumpyDice()
    handle = nanwatch.watch(model, mode="sentinel")
    error = _until_nan(model, handle)
    handle.close()
    assert REPLAYED in error.report
    assert model.calls == error.batch_number + 1  # the user's forwards, not one more
    assert model.seen == list(range(1, model.calls + 1))


class NormalisesItsInput(nn.Module):
    """Goes nan when its input is large, then scales the input in place (`x.div_(...)`) as some forwards do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        large = bool(x.abs().max() > 100)
        x.div_(x.abs().max())
        y = self.fc(x)
        return y * float("nan") if large else y


def _normalising_run(**options: Any) -> NonFiniteError:
    torch.manual_seed(0)
    model = NormalisesItsInput()
    handle = nanwatch.watch(model, mode="sentinel", **options)
    for value in (1.0, 2.0):
        model(torch.full((1, 2), value))
        handle.step()
    model(torch.full((1, 2), 1000.0))
    with pytest.raises(NonFiniteError) as caught:
        handle.step()
    handle.close()
    return caught.value


def test_an_input_the_forward_changed_in_place_is_not_replayable_and_never_blamed_on_the_hardware() -> None:
    # Before: the replay ran the changed input (already divided), came out finite and said "not reproduced: look for
    # a non-deterministic kernel, a race, or a hardware fault".
    error = _normalising_run(sentinel_copy_inputs="never")
    assert error.replay == "not_replayable"
    assert "not replayable: input[0] of micro-batch 2 changed since" in error.report
    assert "hardware fault" not in error.report
    assert "not reproduced" not in error.report
    assert "sentinel_copy_inputs='always'" in error.report


def test_a_small_input_is_copied_so_a_forward_that_changes_it_in_place_is_replayed() -> None:
    error = _normalising_run()  # sentinel_copy_inputs="auto": 8 bytes of input are copied when kept
    assert error.replay == "reproduced", error.report
    assert error.batch_number == 2  # the replay ran the input the forward was given, not the one it left behind
    assert "hardware" not in error.report


def test_an_input_over_the_copy_limit_is_kept_by_reference_under_auto() -> None:
    from nanwatch.core.features.sentinel.kept import COPY_LIMIT_BYTES, kept_inputs

    small, large = torch.ones(4), torch.ones(COPY_LIMIT_BYTES // 4 + 1)
    args, _, versions, copied, _ = kept_inputs((small,), {}, "auto")
    assert copied
    assert args[0] is not small
    assert torch.equal(args[0], small)
    assert not versions
    args, _, versions, copied, _ = kept_inputs((large,), {}, "auto")
    assert not copied
    assert args[0] is large
    assert [label for label, _, _ in versions] == ["input[0]"]
    _, kwargs, _, copied, _ = kept_inputs((), {"x": large}, "always")
    assert copied
    assert kwargs["x"] is not large


class RefilledBuffer(nn.Module):
    """A nan when the input's first value is above 100, as the loop's preallocated buffer holds it at that call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        y = self.fc(batch["x"])
        return y * float("nan") if bool(batch["x"][0, 0] > 100) else y


@pytest.mark.parametrize("refill", ["copy_", "new tensor in the same dict"])
def test_a_loop_that_refills_its_input_before_the_check_is_not_blamed_on_the_hardware(refill: str) -> None:
    # A loop that refills one input buffer (CUDA-graph style) and checks only after the next refill, as the Accelerate
    # adapter checks a micro-batch that does not step. Before: the replay ran the refilled values, said "not
    # reproduced" and blamed the hardware.
    torch.manual_seed(0)
    model = RefilledBuffer()
    batch = {"x": torch.full((1, 2), 1.0)}
    values = (1.0, 2.0, 1000.0, 3.0)

    def train() -> None:
        for index in range(len(values) - 1):
            model(batch)
            # the loader prefetches the next micro-batch into the same buffer before the step is checked
            if refill == "copy_":
                batch["x"].copy_(torch.full((1, 2), values[index + 1]))
            else:
                batch["x"] = torch.full((1, 2), values[index + 1])
            handle.step()

    handle = nanwatch.watch(model, mode="sentinel", sentinel_copy_inputs="never")
    with pytest.raises(NonFiniteError) as caught:
        train()
    handle.close()
    assert caught.value.replay == "not_replayable", caught.value.report
    assert caught.value.batch_number == 2
    assert "not replayable: input[0] of micro-batch 2 changed since" in caught.value.report
    assert "hardware fault" not in caught.value.report


class CountsLate(nn.Module):
    """A buffer the forward leaves alone in the first micro-batch and changes from the second on (a warm-up), and a
    nan when that buffer is 3 (so a replay that ran the buffer as it is after the forward would stay finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("seen", torch.zeros(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            self.seen += 1
        y = self.fc(x)
        return y * float("nan") if bool(self.seen == 3) else y


def test_a_buffer_that_starts_changing_after_the_first_micro_batch_is_kept_and_replayed() -> None:
    # Before: whether a buffer changes was decided once, after micro-batch 0; this one was kept by reference, and the
    # replay ran it as it is now (one more), then said "not reproduced" or reproduced the wrong micro-batch's state.
    torch.manual_seed(0)
    model = CountsLate()
    handle = nanwatch.watch(model, mode="sentinel")
    for _ in range(3):
        model(torch.ones(1, 2))
        handle.step()
    model(torch.ones(1, 2))
    with pytest.raises(NonFiniteError) as caught:
        handle.step()
    handle.close()
    error = caught.value
    assert error.batch_number == 3
    assert error.replay == "reproduced", error.report
    assert REPLAYED in error.report
    assert float(model.seen) == 3.0  # the replay put the buffer back as the run left it


def test_the_error_says_which_verdict_the_replay_reached() -> None:
    np.random.seed(7)
    model = NumpyDice()
    handle = nanwatch.watch(model, mode="sentinel")
    error = _until_nan(model, handle)
    handle.close()
    assert error.replay == "reproduced"
    model = small_mlp(scale=False)
    with nanwatch.watch(model) as handle:  # full mode: nothing replayed, nothing to say
        model[0].weight.data[0, 0] = float("nan")
        model(torch.ones(1, 4))
        with pytest.raises(NonFiniteError) as caught:
            handle.step()
    assert caught.value.replay is None


# ------------------------------------------------------------------------------ gradients in the replay


class WideHalf(nn.Module):
    """float16 on the CPU: a forward and the gradients w.r.t. the output and the input stay small, while the weight's
    gradient (a sum over 100 rows of 300 x 300) overflows float16: the classic fp16 weight-gradient overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4).half()
        with torch.no_grad():
            self.fc.weight.fill_(1e-3)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _weight_gradient_overflow(mode: str, deterministic: bool = False) -> NonFiniteError:
    torch.manual_seed(0)
    model = WideHalf()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    options: dict[str, Any] = {"watch_gradients": True} if mode == "full" else {}
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with nanwatch.watch(model, optimizer=optimizer, mode=mode, **options) as handle:
            for index in range(3):
                x = torch.full((100, 4), 300.0 if index == 2 else 0.01, dtype=torch.float16)
                (model(x) * 300).sum().backward()
                try:
                    optimizer.step()
                    optimizer.zero_grad()
                    handle.step()
                except NonFiniteError as error:
                    return error
    finally:
        torch.use_deterministic_algorithms(before)
    raise AssertionError(f"{mode}: nothing detected")


@pytest.mark.parametrize("deterministic", [False, True])
def test_an_fp16_weight_gradient_overflow_is_reproduced_at_its_parameter(deterministic: bool) -> None:
    # Before: the replay's backward went through torch.autograd.grad and threw the gradients away; it came out
    # finite and said "not reproduced: ... a hardware fault", also under deterministic algorithms.
    full = _weight_gradient_overflow("full", deterministic)
    sentinel = _weight_gradient_overflow("sentinel", deterministic)
    assert sentinel.replay == "reproduced", sentinel.report
    assert sentinel.batch_number == full.batch_number == 2
    assert sentinel.module_name == full.module_name == "fc"
    line = next(line for line in sentinel.report.splitlines() if line.endswith("grad weight"))
    assert "inf" in line
    assert "hardware fault" not in sentinel.report


def test_the_replay_leaves_the_runs_gradients_and_parameter_hooks_alone() -> None:
    torch.manual_seed(0)
    model = WideHalf()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    fired: list[str] = []
    model.fc.weight.register_post_accumulate_grad_hook(lambda param: fired.append("user"))  # as DDP's would be
    with nanwatch.watch(model, optimizer=optimizer, mode="sentinel"):
        (model(torch.full((100, 4), 300.0, dtype=torch.float16)) * 300).sum().backward()
        grad = model.fc.weight.grad.clone()
        with pytest.raises(NonFiniteError) as caught:
            optimizer.step()
    assert caught.value.replay == "reproduced"
    assert fired == ["user"], "the replay's backward fired a hook the run put on a parameter"
    assert torch.equal(model.fc.weight.grad, grad), "the replay changed the run's .grad"
    assert isinstance(model.fc.weight, nn.Parameter)
    assert model.fc.weight.grad_fn is None


class Scores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _loss_nan_gradient(out: torch.Tensor) -> torch.Tensor:
    # Finite in value (torch.where picks 0 wherever sqrt(out) is nan), nan in gradient (0 times sqrt's nan gradient):
    # the classic "safe sqrt" trap.
    return torch.where(out > 0, out.sqrt(), 0.0).sum()


def test_a_nan_born_in_the_loss_with_a_finite_output_is_said_to_be_born_in_the_loss() -> None:
    # Before: the kept output gradient was non-finite, dropped, and the verdict fell through to "not reproduced".
    torch.manual_seed(0)
    model = Scores()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, optimizer=optimizer, mode="sentinel"):
        loss = _loss_nan_gradient(model(torch.randn(4, 2)))
        assert torch.isfinite(loss)
        loss.backward()
        with pytest.raises(NonFiniteError) as caught:
            optimizer.step()
    error = caught.value
    assert error.replay == "born_in_the_loss", error.report
    assert error.module_name == "(loss)"
    assert "born in the loss: the gradient w.r.t. the model's output in micro-batch 0" in error.report
    assert "not reproduced" not in error.report
    assert "hardware fault" not in error.report


def test_output_gradients_are_summed_over_every_backward_pass() -> None:
    # Two losses on one output, the nan-gradient one first: keeping only the last gradient (finite) replayed a finite
    # backward and said "not reproduced".
    torch.manual_seed(0)
    model = Scores()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, optimizer=optimizer, mode="sentinel"):
        out = model(torch.randn(4, 2))
        _loss_nan_gradient(out).backward(retain_graph=True)
        out.pow(2).mean().backward()
        with pytest.raises(NonFiniteError) as caught:
            optimizer.step()
    assert caught.value.replay == "born_in_the_loss", caught.value.report


# ------------------------------------------------------------------------------ a second replay: which kind of fault

_FAULTS: list[bool] = []  # module state no replay can restore: a nan injected once, as a flipped bit would be


class FaultsOnce(nn.Module):
    """Goes nan once (the first call after a fault is armed), and adds noise from the operating system's entropy when
    `noisy`: a computation that differs from run to run."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.noisy = noisy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.noisy:
            y = y + int.from_bytes(os.urandom(4), "little") * 1e-12
        if _FAULTS and _FAULTS.pop():
            y = y * float("nan")
        return y


@pytest.mark.parametrize(("noisy", "cause"), [(False, "transient_fault"), (True, "non_deterministic")])
def test_two_finite_replays_tell_a_transient_fault_from_a_non_deterministic_computation(
    noisy: bool, cause: str
) -> None:
    torch.manual_seed(0)
    model = FaultsOnce(noisy)
    with nanwatch.watch(model, mode="sentinel") as handle:
        model(torch.ones(1, 2))
        handle.step()
        _FAULTS.append(True)
        model(torch.ones(1, 2))
        with pytest.raises(NonFiniteError) as caught:
            handle.step()
    error = caught.value
    assert error.replay == "not_reproduced"
    section = error.report
    assert "replayed twice with everything restored" in section
    if cause == "transient_fault":
        assert "the same bits both times" in section
        assert "transient fault" in section
        assert "non-deterministic" not in section
    else:
        assert "differ from one replay to the other" in section
        assert "torch.use_deterministic_algorithms(True)" in section
        assert "transient fault" not in section


class OwnDice(nn.Module):
    """Draws from a generator of its own in forward, adds the draw to the output, and goes nan on a high one."""

    def __init__(self, make_generator_late: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.gen: torch.Generator | None = None if make_generator_late else torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gen is None:
            self.gen = torch.Generator().manual_seed(3)
        draw = torch.rand((), generator=self.gen)
        y = self.fc(x) + draw * 1e-3
        return y * float("nan") if float(draw) > 0.8 else y


def _own_dice_until_nan(model: OwnDice) -> NonFiniteError:
    with nanwatch.watch(model, mode="sentinel") as handle:
        for _ in range(50):
            model(torch.ones(1, 2))
            try:
                handle.step()
            except NonFiniteError as error:
                return error
    raise AssertionError("the dice never came up nan")


def test_a_generator_the_model_holds_is_restored_for_the_replay_and_left_as_the_run_left_it() -> None:
    model = OwnDice()
    error = _own_dice_until_nan(model)
    assert error.replay == "reproduced", error.report
    draws = error.batch_number + 1
    expected = torch.Generator().manual_seed(3)
    for _ in range(draws):
        torch.rand((), generator=expected)
    assert model.gen is not None
    assert torch.equal(model.gen.get_state(), expected.get_state())


def test_a_generator_made_after_watching_began_is_named_as_not_restored() -> None:
    model = OwnDice(make_generator_late=True)
    error = _own_dice_until_nan(model)
    assert error.replay == "not_replayable", error.report
    assert "the generator 'gen' (made after watching began" in error.report
    assert "hardware" not in error.report.split("not replayable")[1].split("Nothing here")[0]


class KeepsACache:
    def __init__(self) -> None:
        self.hits = 0


class CachingForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.cache = KeepsACache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.hits += 1
        y = self.fc(x)
        return y * float("nan") if self.cache.hits == 3 else y


def test_an_object_the_model_holds_gets_its_attributes_back_after_the_replay() -> None:
    model = CachingForward()
    handle = nanwatch.watch(model, mode="sentinel")
    for _ in range(2):
        model(torch.ones(1, 2))
        handle.step()
    model(torch.ones(1, 2))
    with pytest.raises(NonFiniteError) as caught:
        handle.step()
    handle.close()
    # The replay's forward counted a fourth hit on the live object; it was put back to the run's three.
    assert model.cache.hits == 3
    assert caught.value.batch_number == 2


def test_a_nan_gradient_made_by_a_later_call_of_the_model_is_not_blamed_on_the_loss() -> None:
    # model(model(x) * 1000): the second call's backward makes the nan, and the gradient kept for the first call's
    # output holds it although the loss did nothing wrong. The replay runs both backwards and finds it there.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), BackwardFaultAt(50.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, optimizer=optimizer, mode="sentinel"):
        model(model(torch.ones(2, 4)) * 1000).sum().backward()
        with pytest.raises(NonFiniteError) as caught:
            optimizer.step()
    error = caught.value
    assert error.replay == "reproduced", error.report
    assert error.module_name == "1.nan"
