"""core/capture.py: what `capture_on_detect` copies, when, and what it writes. Real modules; no mocks.

The replay of these files (`nanwatch replay`) is tested end to end in tests/test_replay.py.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import sys
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nanwatch
from nanwatch import ConfigError, NanwatchWarning, NonFiniteError, WatchConfig
from nanwatch.core.features.capture import ReplayCapture
from nanwatch.core.formats.replay_file import load_replay_file, replay_file_name
from nanwatch.core.watcher import Watcher
from nanwatch.errors import ReplayError

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.engine_helpers import publish  # noqa: E402
from tests.replay_models import TinyNet  # noqa: E402

HUGE = 3e38  # 8 such inputs to a Linear: its output is inf in fp32


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def log() -> Iterator[_Records]:
    records = _Records()
    logger = logging.getLogger("nanwatch")
    logger.addHandler(records)
    yield records
    logger.removeHandler(records)


def _watcher(model: torch.nn.Module, report_dir: Path) -> Watcher:
    watcher = Watcher(model, WatchConfig(capture_on_detect=True, report_dir=report_dir))
    watcher.attach()
    return watcher


def _publish(watcher: Watcher) -> None:
    report = watcher.check()
    assert report is not None
    publish(watcher, report)


def _hook_names(hooks: dict[int, Any], keys: Iterable[int]) -> list[str]:
    """The qualified names of the methods behind the hooks `keys` of a module's hook dict (nanwatch wraps its own)."""
    return [getattr(hooks[key], "func", hooks[key]).__qualname__ for key in keys]


def test_off_it_adds_no_hook_and_writes_no_replay_file(tmp_path: Path) -> None:
    model = TinyNet()
    handle = nanwatch.watch(model, report_dir=tmp_path)
    assert handle.watcher.feature(ReplayCapture) is None
    # The only pre-hook with kwargs is the cause feature's (it keeps the forward's call by reference); none is the
    # capture's.
    assert _hook_names(model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs) == ["CallKeeper.before"]
    model(torch.full((4, 8), HUGE))
    with pytest.raises(NonFiniteError):
        handle.step()
    handle.close()
    assert [p.name for p in tmp_path.glob("replay-*")] == []
    assert [p.name for p in tmp_path.glob("nanwatch-report-*")] != []


def test_its_hooks_go_with_detach(tmp_path: Path) -> None:
    model = TinyNet()
    watcher = _watcher(model, tmp_path)
    # The capture's pre-hook, after the cause feature's (which keeps the forward's call by reference).
    assert _hook_names(model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs) == [
        "CallKeeper.before",
        "ReplayCapture._before_forward",
    ]
    # The root's frame, the cause feature's (always called), then the capture's label.
    assert _hook_names(model._forward_hooks, model._forward_hooks) == [
        "ModuleHook.forward_hook",
        "CallKeeper.after",
        "ReplayCapture._after_forward",
    ]
    watcher.close(check=False)
    assert not model._forward_pre_hooks_with_kwargs
    assert not model._forward_pre_hooks
    assert not model._forward_hooks


def test_it_needs_a_report_dir() -> None:
    with pytest.raises(ConfigError, match="capture_on_detect=True needs report_dir"):
        nanwatch.watch(TinyNet(), capture_on_detect=True)


def test_it_keeps_copies_from_when_the_latest_forward_began(tmp_path: Path) -> None:
    model = TinyNet()
    watcher = _watcher(model, tmp_path)
    model(torch.ones(4, 8))
    watcher.end_batch()
    with torch.no_grad():
        model.head.weight.mul_(2.0)  # as an optimizer step would, in place
    began_with = model.head.weight.detach().clone()
    inputs = torch.full((4, 8), HUGE)
    model(inputs, scale=torch.full((16,), 3.0))
    with torch.no_grad():
        model.head.weight.fill_(float("nan"))  # after the forward: must not reach the file
        inputs.zero_()
    _publish(watcher)

    data = load_replay_file(tmp_path / replay_file_name(0, 1))
    assert data["batch_number"] == 1
    assert torch.equal(data["parameters"]["head.weight"], began_with)
    assert torch.equal(data["args"][0], torch.full((4, 8), HUGE))
    assert torch.equal(data["kwargs"]["scale"], torch.full((16,), 3.0))
    assert data["buffers"]["norm.num_batches_tracked"].item() == 1  # one forward before this one
    assert data["training_modes"] == {name: True for name, _ in model.named_modules()}
    assert data["report"]["batch_number"] == 1
    assert data["layout"]["buffers"]["norm.running_var"] == {"shape": [16], "dtype": "float32"}


def test_an_eval_forward_without_watch_eval_does_not_replace_the_training_copy(tmp_path: Path) -> None:
    model = TinyNet()
    watcher = _watcher(model, tmp_path)
    model(torch.full((4, 8), HUGE))
    model.eval()
    model(torch.ones(2, 8))  # not watched: must not overwrite what the report is about
    model.train()
    _publish(watcher)
    assert load_replay_file(tmp_path / replay_file_name(0, 0))["args"][0].shape == (4, 8)


def test_close_lets_go_of_the_copied_weights_and_inputs(tmp_path: Path) -> None:
    # A closed handle stays referenced by the user's code: the copies it held (a model's worth of weights) must not.
    model = TinyNet()
    handle = nanwatch.watch(model, capture_on_detect=True, report_dir=tmp_path)
    capture = handle.watcher.feature(ReplayCapture)
    assert capture is not None
    inputs, scale = torch.ones(4, 8), torch.full((16,), 2.0)
    model(inputs, scale=scale)
    handle.step()
    # The feature holds copies, not the caller's tensors: follow the copies of what was passed in, and of a weight.
    copies = [
        weakref.ref(capture._args[0]),
        weakref.ref(capture._kwargs["scale"]),
        weakref.ref(capture._parameters["head.weight"]),
        weakref.ref(capture._buffers["norm.running_mean"]),
    ]
    passed_in = [weakref.ref(inputs), weakref.ref(scale)]
    del inputs, scale
    gc.collect()
    assert all(ref() is not None for ref in copies)  # held while watching, so the check below can fail
    handle.close()
    gc.collect()
    assert [ref() for ref in copies] == [None] * len(copies)
    assert [ref() for ref in passed_in] == [None] * len(passed_in)  # nor does anything else keep what was passed in
    assert capture.label is None


def test_a_forward_that_raised_is_not_saved_as_if_it_had_run(tmp_path: Path, log: _Records) -> None:
    model = TinyNet()
    watcher = _watcher(model, tmp_path)
    with pytest.raises(RuntimeError, match="size of tensor"):
        model(torch.full((4, 8), HUGE), scale=torch.ones(3))  # inf in `inp`, then the user's shape error
    _publish(watcher)
    assert [p.name for p in tmp_path.glob("replay-*")] == []
    assert any("saved no replay of batch_number=0" in message for message in log.messages)


def test_a_replay_file_that_cannot_be_written_never_hides_the_detection(tmp_path: Path, log: _Records) -> None:
    report_dir = tmp_path / "reports"
    model = TinyNet()
    handle = nanwatch.watch(model, capture_on_detect=True, report_dir=report_dir)
    report_dir.rmdir()  # taken away after watching began (a folder on a volume that went away, say) ...
    report_dir.write_text("a file where report_dir should be a folder\n")  # ... and a file in its place
    model(torch.full((4, 8), HUGE))
    with pytest.warns(NanwatchWarning) as warned, pytest.raises(NonFiniteError) as info:
        handle.step()
    handle.close()
    # Two warnings: the report itself, then the repro capsule of the culprit's call the report names (written once the
    # report is out); neither file could be written.
    exists = FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))
    capsule = report_dir / "nanwatch-capsule-rank0-batch0.pt"
    assert [str(warning.message) for warning in warned] == [
        f"nanwatch could not write the report to {report_dir}: {exists!r}",
        f"nanwatch could not write the repro capsule {capsule} that the report names: {exists!r}",
    ]
    assert info.value.capsule is None
    assert info.value.report.startswith("Detected inf/nan during batch_number=0")  # the report is in the error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reports"]  # no half-written or temporary file
    assert report_dir.read_text() == "a file where report_dir should be a folder\n"
    assert any("could not write the replay file" in message for message in log.messages)


def test_the_file_is_named_like_the_reports() -> None:
    assert replay_file_name(3, 150) == "replay-rank3-batch150.pt"
    assert replay_file_name(0, 2, "eval") == "replay-eval-rank0-batch2.pt"


def test_a_newer_format_is_refused_with_the_versions(tmp_path: Path) -> None:
    model = TinyNet()
    watcher = _watcher(model, tmp_path)
    model(torch.full((4, 8), HUGE))
    _publish(watcher)
    path = tmp_path / replay_file_name(0, 0)
    data = torch.load(path, weights_only=True)
    data["version"] = 99
    torch.save(data, path)
    with pytest.raises(ReplayError, match="format version 99; this nanwatch .* reads versions up to 1"):
        load_replay_file(path)
