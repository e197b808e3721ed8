"""core/torch_glue/gcpause.py and its use by the engine: automatic garbage collection pauses from a watched full-mode
micro-batch's start to its check, and comes back however the micro-batch ends (a clean step, a detection at the
optimizer step, close, the next watcher's check after one was abandoned mid-batch); the collector's switch is the
user's (a `gc.disable()` or `gc.enable()` made before or during a micro-batch holds after it), and `pause_gc=False`
or sentinel mode never touch the collector."""

from __future__ import annotations

import gc
import multiprocessing
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import nanwatch
import nanwatch.core.engine.recording.recorder
import nanwatch.core.torch_glue.gcpause
from nanwatch import NonFiniteError
from nanwatch.core.torch_glue.gcpause import collection_paused, pause_collection, resume_collection


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.enable()
    yield
    assert not collection_paused(), "a test left the collector paused"
    assert gc.get_threshold() == thresholds, "a test left the thresholds changed"
    gc.enable()


def collecting() -> bool:
    """Whether automatic collection runs now: the collector's switch on, and not paused (threshold 0)."""
    return gc.isenabled() and gc.get_threshold()[0] != 0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))


class SeesTheCollector(nn.Module):
    """Notes, at each forward, whether automatic collection was enabled; an inf output when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.enabled: list[bool] = []
        self.inf = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.enabled.append(collecting())
        return self.fc(x) * (float("inf") if self.inf else 1.0)


def test_a_watched_micro_batch_runs_paused_and_the_collector_comes_back_at_its_check() -> None:
    model = SeesTheCollector()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, optimizer=optimizer) as handle:
        for _ in range(2):
            model(torch.ones(2, 3)).sum().backward()
            assert not collecting()  # still paused through backward and the step
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
            assert collecting()
    assert model.enabled == [False, False]


def test_a_detection_at_the_optimizer_step_resumes_the_collector() -> None:
    model = SeesTheCollector()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nanwatch.watch(model, optimizer=optimizer)
    model.inf = True
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(NonFiniteError):
        optimizer.step()
    assert collecting()
    handle.close()


def test_close_resumes_the_collector() -> None:
    model = _model()
    handle = nanwatch.watch(model)
    model(torch.ones(1, 3))  # a micro-batch left open (the user's loop raised, say)
    assert not collecting()
    handle.close()
    assert collecting()


def test_a_watcher_abandoned_mid_batch_holds_the_pause_only_until_the_next_check() -> None:
    # A notebook: the first run raised inside the forward and its handle was never closed; a new watch() of another
    # model goes on, and its first check resumes the collector whatever the first one does.
    first = SeesTheCollector()
    abandoned = nanwatch.watch(first)
    first(torch.ones(2, 3))
    assert not collecting()
    second = _model()
    with nanwatch.watch(second) as handle:
        second(torch.ones(1, 3))
        handle.step()
        assert collecting()
    abandoned.close()


def test_pause_and_resume_are_one_switch() -> None:
    pause_collection()
    pause_collection()
    assert not collecting()
    resume_collection()
    assert collecting()
    resume_collection()  # nothing to resume: the collector stays as it is
    assert collecting()


def test_a_collector_the_user_disabled_stays_disabled() -> None:
    gc.disable()
    model = _model()
    with nanwatch.watch(model) as handle:
        model(torch.ones(1, 3))
        handle.step()
    assert not gc.isenabled()


class SwitchesTheCollector(nn.Module):
    """User code inside a watched micro-batch: notes the collector's switch, then flips it (`gc.disable`/`gc.enable`,
    or nothing); an inf output when told to."""

    def __init__(self, switch: Callable[[], None] | None) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.switch = switch
        self.enabled: list[bool] = []
        self.inf = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.enabled.append(gc.isenabled())
        if self.switch is not None:
            self.switch()
        return self.fc(x) * (float("inf") if self.inf else 1.0)


@pytest.mark.parametrize("ending", ["step", "close", "detection"])
@pytest.mark.parametrize(
    ("enabled_before", "switch", "enabled_after"),
    [
        (True, gc.disable, False),  # disabled during the micro-batch: stays disabled after its check
        (False, None, False),  # disabled before it: stays disabled
        (False, gc.enable, True),  # disabled before, enabled during: enabled after
        (True, None, True),
    ],
    ids=["disabled during", "disabled before", "enabled during", "untouched"],
)
def test_the_collector_switch_is_the_users(
    enabled_before: bool, switch: Callable[[], None] | None, enabled_after: bool, ending: str
) -> None:
    # Before: nanwatch paused with gc.disable() and resumed with gc.enable(), so a gc.disable() made during a watched
    # micro-batch was undone at its check, and the micro-batch saw the collector off whatever the user had set.
    if not enabled_before:
        gc.disable()
    model = SwitchesTheCollector(switch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nanwatch.watch(model, optimizer=optimizer)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    handle.step()
    assert gc.isenabled() is enabled_after
    if ending == "detection":
        model.inf = True
    model(torch.ones(2, 3)).sum().backward()
    assert collection_paused()
    if ending == "step":
        optimizer.step()
        handle.step()
    elif ending == "close":
        handle.close()
    else:
        with pytest.raises(NonFiniteError):
            optimizer.step()
    assert not collection_paused()
    assert gc.isenabled() is enabled_after
    handle.close()
    assert gc.isenabled() is enabled_after
    assert model.enabled == [enabled_before, enabled_after]  # the micro-batch sees the user's switch, not ours


def test_thresholds_the_user_sets_during_a_pause_stay() -> None:
    before = gc.get_threshold()
    model = _model()
    try:
        with nanwatch.watch(model) as handle:
            model(torch.ones(1, 3))
            assert gc.get_threshold() == (0, *before[1:])  # the pause
            gc.set_threshold(5000, 20, 20)
            handle.step()
            assert gc.get_threshold() == (5000, 20, 20)
            model(torch.ones(1, 3))
            handle.step()
            assert gc.get_threshold() == (5000, 20, 20)
    finally:
        gc.set_threshold(*before)


def test_no_automatic_collection_runs_while_paused() -> None:
    started: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    def cycles() -> None:
        for _ in range(20 * max(gc.get_threshold()[0], 700)):
            a: list[object] = []
            a.append(a)

    model = _model()
    gc.callbacks.append(note)
    try:
        with nanwatch.watch(model) as handle:
            model(torch.ones(1, 3))
            paused_at = len(started)
            cycles()  # far past the youngest generation's threshold
            during = len(started) - paused_at
            handle.step()
            resumed_at = len(started)
            cycles()
            after = len(started) - resumed_at
    finally:
        gc.callbacks.remove(note)
    assert during == 0
    assert after > 0


@pytest.mark.parametrize("overrides", [{"pause_gc": False}, {"mode": "sentinel"}])
def test_pause_gc_false_and_sentinel_mode_leave_the_collector_alone(overrides: dict[str, object]) -> None:
    model = SeesTheCollector()
    with nanwatch.watch(model, **overrides) as handle:  # type: ignore[arg-type]
        model(torch.ones(2, 3))
        handle.step()
    assert model.enabled == [True]


def test_a_loop_that_never_ends_its_micro_batch_gets_the_collector_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nanwatch.core.engine.recording.recorder, "MAX_PENDING_FRAMES", 20)
    model = _model()
    seen = []
    with nanwatch.watch(model):  # step() never called: one micro-batch that goes on and on
        for _ in range(12):  # 4 frames a forward: past 20 pending, a check mid-batch lets the pause go
            model(torch.ones(1, 3))
            seen.append(collecting())
    assert seen[:5] == [False] * 5  # 20 frames pending: still paused
    assert True in seen[5:]  # the pause never outlasts 20 pending frames


def test_a_pause_no_micro_batch_renews_is_resumed_by_the_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    # A handle abandoned mid-batch in a notebook (the user's loop raised), and nanwatch never used again.
    monkeypatch.setattr(nanwatch.core.torch_glue.gcpause, "PAUSE_LIMIT_S", 0.4)
    model = _model()
    handle = nanwatch.watch(model)
    model(torch.randn(2, 3))
    assert collection_paused()
    deadline = time.monotonic() + 10
    while collection_paused() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not collection_paused()
    assert collecting()
    handle.close()


def _report_collector(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    queue.put((collecting(), collection_paused()))


def test_a_child_forked_during_a_pause_starts_with_the_collector_on() -> None:
    pause_collection()
    try:
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_report_collector, args=(queue,))
        child.start()
        found = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        resume_collection()
    assert found == (True, False)
    assert child.exitcode == 0
