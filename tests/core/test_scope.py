"""Scope: modules chosen by glob at attach (the others carry no hook), and training batches chosen by schedule."""

from __future__ import annotations

import logging

import pytest
import torch

import nanwatch
from nanwatch import ConfigError, NonFiniteError, WatchConfig
from nanwatch.core.scope import BatchSchedule, select_modules
from nanwatch.core.watcher import Watcher

ALL = {"", "encoder", "encoder.0", "encoder.1", "encoder.2", "head", "head.dropout", "head.proj"}


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(0.0)
        self.proj = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.dropout(x))


class EncoderAndHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def hooked(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if module._forward_hooks}


# ------------------------------------------------------------------------------------------------------- modules


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ([], [], ALL),
        (["*"], [], ALL),
        (["encoder.*"], [], {"encoder.0", "encoder.1", "encoder.2"}),
        (["encoder", "encoder.*"], [], {"encoder", "encoder.0", "encoder.1", "encoder.2"}),
        ([""], [], {""}),
        ([], ["*dropout"], ALL - {"head.dropout"}),
        ([], ["encoder.?"], ALL - {"encoder.0", "encoder.1", "encoder.2"}),
        (["encoder.*", "head.proj"], ["encoder.1"], {"encoder.0", "encoder.2", "head.proj"}),
        (["*.[02]"], [], {"encoder.0", "encoder.2"}),
    ],
)
def test_the_hooked_modules_are_exactly_those_the_globs_choose(
    include: list[str], exclude: list[str], expected: set[str]
) -> None:
    model = EncoderAndHead()
    handle = nanwatch.watch(model, include_modules=include, exclude_modules=exclude, max_frames_to_save=100)
    try:
        # The plain handle adds its own phase hooks on the root; the root's frame hook is there only if chosen.
        assert hooked(model) - {""} == expected - {""}
        model(torch.randn(2, 4)).sum().backward()
        handle.step()
        assert {frame.module_name for frame in handle.watcher.recent_frames()} == expected
    finally:
        handle.close()
    assert hooked(model) == set()


def test_globs_are_case_sensitive_and_cross_dots() -> None:
    pairs = list(EncoderAndHead().named_modules())
    assert [name for name, _ in select_modules(pairs, ["head*"], [])] == ["head", "head.dropout", "head.proj"]
    with pytest.raises(ConfigError, match="'Head\\*'"):
        select_modules(pairs, ["Head*"], [])


@pytest.mark.parametrize("field", ["include_modules", "exclude_modules"])
def test_a_pattern_that_matches_no_module_is_an_error_at_attach_naming_it(field: str) -> None:
    model = EncoderAndHead()
    with pytest.raises(ConfigError) as caught:
        nanwatch.watch(model, **{field: ["encoder.*", "encodr.1"]})
    message = str(caught.value)
    assert field in message
    assert "'encodr.1'" in message
    assert "did you mean 'encoder.1'" in message
    assert "'encoder.*'" not in message  # the pattern that matched is not blamed
    assert hooked(model) == set(), "a failed attach must leave no hook behind"


def test_patterns_that_leave_nothing_to_watch_are_an_error() -> None:
    with pytest.raises(ConfigError, match="leave none of the model.s"):
        nanwatch.watch(EncoderAndHead(), include_modules=["head.*"], exclude_modules=["head.*"])


def test_the_adapter_given_modules_are_the_ones_matched() -> None:
    # Adapters may pass their own (name, module) pairs, as Lightning does without the LightningModule itself.
    model = EncoderAndHead()
    watcher = Watcher(model, WatchConfig(include_modules=["*"], exclude_modules=["encoder*"]))
    watcher.attach((name, module) for name, module in model.named_modules() if name)
    try:
        # And the root: the cause feature's always-called hook, which keeps the forward's call (it records no frame).
        assert hooked(model) == {"", "head", "head.dropout", "head.proj"}
        assert set(model._forward_hooks) == set(model._forward_hooks_always_called)
        model(torch.randn(2, 4))
        assert {frame.module_name for frame in watcher.recent_frames()} == {"head", "head.dropout", "head.proj"}
    finally:
        watcher.close(check=False)
    assert hooked(model) == set()
    with pytest.raises(ConfigError, match="pattern ''"):
        Watcher(model, WatchConfig(include_modules=[""])).attach(
            (name, module) for name, module in model.named_modules() if name
        )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"include_modules": "encoder.*"}, "single string 'encoder.*'"),
        ({"exclude_modules": [3]}, "exclude_modules"),
        ({"watch_every_n_batches": 0}, "watch_every_n_batches"),
        ({"watch_every_n_batches": True}, "not a boolean"),
        ({"watch_first_batch": -1}, "watch_first_batch"),
        ({"watch_first_batch": 5, "watch_last_batch": 4}, "watch_last_batch \\(4\\) comes before"),
        ({"summary_every_n_batches": 0}, "summary_every_n_batches"),
    ],
)
def test_bad_scope_settings_name_the_field(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WatchConfig.from_dict(values)


# ------------------------------------------------------------------------------------------------------- batches


def recorded_batches(config: dict[str, object], batches: int = 10) -> tuple[set[int], int]:
    model = EncoderAndHead()
    seen_recording: list[int] = []
    with nanwatch.watch(model, max_frames_to_save=10_000, **config) as handle:
        for _ in range(batches):
            if handle.watcher.recording:
                seen_recording.append(handle.batch_number)
            model(torch.randn(2, 4)).sum().backward()
            handle.step()
        frames = handle.watcher.recent_frames()
        assert {frame.batch_number for frame in frames} == set(seen_recording)
        # A recorded batch holds every module's frame, an unrecorded one none.
        for batch in seen_recording:
            assert {f.module_name for f in frames if f.batch_number == batch} == ALL
        return set(seen_recording), handle.batch_number


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, set(range(10))),
        ({"watch_every_n_batches": 3}, {0, 3, 6, 9}),
        ({"watch_first_batch": 2, "watch_last_batch": 5}, {2, 3, 4, 5}),
        ({"watch_first_batch": 7}, {7, 8, 9}),
        ({"watch_first_batch": 2, "watch_last_batch": 8, "watch_every_n_batches": 3}, {2, 5, 8}),
        ({"watch_every_n_batches": 3, "trace_batch_nums": [4]}, {0, 3, 4, 6, 9}),  # traced batches always are
        ({"watch_last_batch": 0}, {0}),
    ],
)
def test_only_scheduled_batches_are_recorded_but_all_are_counted(config: dict[str, object], expected: set[int]) -> None:
    recorded, counted = recorded_batches(config)
    assert recorded == expected
    assert counted == 10


def test_an_inf_in_an_unwatched_batch_is_not_seen_there() -> None:
    # The documented limit: nothing is recorded in batch 1, so its inf goes unnoticed; batch 2's is caught.
    model = EncoderAndHead()
    with nanwatch.watch(model, watch_every_n_batches=2) as handle:
        model(torch.randn(2, 4)).sum()
        handle.step()
        model(torch.full((2, 4), float("inf")))  # batch 1: not watched
        handle.step()
        model(torch.full((2, 4), float("inf")))  # batch 2: watched
        with pytest.raises(NonFiniteError) as caught:
            handle.step()
    assert caught.value.batch_number == 2


def test_a_detection_after_unwatched_batches_says_which_were_missed(
    nanwatch_log: pytest.LogCaptureFixture,
) -> None:
    # The weights go inf in unwatched batch 4; the next watched batch, 6, finds them so and says what it cannot know.
    model = EncoderAndHead()
    with nanwatch.watch(model, watch_every_n_batches=3) as handle:
        for batch in range(7):
            if batch == 4:
                with torch.no_grad():
                    model.encoder[0].weight[0, 0] = float("inf")
            if batch < 6:
                model(torch.randn(2, 4))
                handle.step()
        model(torch.randn(2, 4))
        with pytest.raises(NonFiniteError) as caught:
            handle.step()
    assert caught.value.batch_number == 6
    warnings = [r.getMessage() for r in nanwatch_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "batch_numbers 4..5 before this one were not watched" in warnings[0]
    assert "watch_first_batch=4 and watch_every_n_batches=1" in warnings[0]


def test_no_missed_note_when_the_previous_batch_was_watched(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = EncoderAndHead()
    with nanwatch.watch(model, watch_first_batch=1) as handle:
        model(torch.randn(2, 4))
        handle.step()
        model(torch.randn(2, 4))
        handle.step()
        model(torch.full((2, 4), float("nan")))
        with pytest.raises(NonFiniteError):
            handle.step()
    assert not [r for r in nanwatch_log.records if r.levelno == logging.WARNING]


def test_evaluation_follows_watch_eval_not_the_batch_schedule() -> None:
    model = EncoderAndHead()
    with nanwatch.watch(model, watch_eval=True, watch_first_batch=100):
        model.eval()
        with pytest.raises(NonFiniteError) as caught:
            model(torch.full((2, 4), float("inf")))
    assert caught.value.phase == "eval"


def test_the_schedule_survives_a_resume() -> None:
    model = EncoderAndHead()
    watcher = Watcher(model, WatchConfig(watch_every_n_batches=4))
    assert watcher.recording
    watcher.load_state_dict({"batch_number": 5})
    assert not watcher.recording
    watcher.load_state_dict({"batch_number": 8})
    assert watcher.recording


@pytest.mark.parametrize(
    ("config", "batch", "gap"),
    [
        ({"watch_every_n_batches": 10}, 20, (11, 19)),
        ({"watch_every_n_batches": 10}, 21, None),  # 20 was watched
        ({"watch_every_n_batches": 10}, 0, None),
        ({"watch_first_batch": 5}, 5, (0, 4)),
        ({"watch_first_batch": 5, "watch_last_batch": 7}, 12, (8, 11)),
        ({"watch_every_n_batches": 10, "trace_batch_nums": [15]}, 20, (16, 19)),
        ({"watch_first_batch": 3, "watch_every_n_batches": 4}, 11, (8, 10)),
    ],
)
def test_the_unwatched_stretch_before_a_batch(
    config: dict[str, object], batch: int, gap: tuple[int, int] | None
) -> None:
    schedule = BatchSchedule(WatchConfig.from_dict(config))
    assert schedule.unwatched_before(batch) == gap
    # The same answer, found the slow way.
    previous = max((b for b in range(batch) if schedule.watched(b)), default=None)
    assert schedule.previous_watched(batch) == previous
