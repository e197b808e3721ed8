"""Capture on detection (`capture_on_detect=True`) and `nanwatch replay`, end to end with real training runs.

A TinyNet (tests/replay_models.py) is trained by gradient ascent with a big learning rate until an fp32 activation
overflows; nanwatch detects it and writes the report and the replay file. The replay, on a freshly built model with
other initial weights, through the command line in a subprocess and through the Python API, must give the frames of
the original report value for value: that needs the captured weights (training changed them, the optimizer even
after the failing forward), the BatchNorm buffers, the Dropout's RNG state and the keyword input.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

import nanwatch
from nanwatch import NanwatchWarning, NonFiniteError
from nanwatch.core.formats.replay_file import load_replay_file
from nanwatch.replay import ReplayError, replay

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # so that `tests.replay_models` imports here as it does in the subprocess
    sys.path.insert(0, str(REPO))

from tests.replay_models import WIDTH, TinyNet, factory  # noqa: E402
from tests.report_lines import capsule_line  # noqa: E402

FACTORY = "tests.replay_models:factory"
MAX_FRAMES = 8


@dataclass
class Captured:
    replay_file: Path
    report_json: dict[str, Any]
    error: NonFiniteError
    report_dir: Path


def _train_until_inf(report_dir: Path, *, guard: bool) -> NonFiniteError:
    """Gradient ascent with a big learning rate: the weights grow until an fp32 activation is inf (~40 steps)."""
    # One thread: this model's kernels gain nothing from more, and on a busy machine OpenMP threads waiting for each
    # other make every step many times slower. The count is captured, so the replays run with one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(report_dir, guard=guard)
    finally:
        torch.set_num_threads(threads)


def _train(report_dir: Path, *, guard: bool) -> NonFiniteError:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = nanwatch.watch(
        model,
        optimizer=optimizer if guard else None,
        capture_on_detect=True,
        report_dir=report_dir,
        max_frames_to_save=MAX_FRAMES,
    )
    # Unguarded on purpose (the weights go nan, as the replay file must show): nanwatch says so at the first step.
    unguarded = contextlib.nullcontext() if guard else pytest.warns(NanwatchWarning, match="weights unguarded")
    with unguarded, pytest.raises(NonFiniteError) as caught, handle:
        _loop(model, optimizer, handle)
    return caught.value


def _loop(model: TinyNet, optimizer: torch.optim.Optimizer, handle: nanwatch.WatchHandle) -> None:
    generator = torch.Generator().manual_seed(1)
    scale = torch.full((WIDTH,), 2.0)
    for _ in range(200):
        output = model(torch.randn(32, 8, generator=generator), scale=scale)
        optimizer.zero_grad()
        (-output.mean()).backward()
        optimizer.step()  # without the guard this runs first: the weights are nan before step() checks
        handle.step()


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Captured:
    report_dir = tmp_path_factory.mktemp("reports")
    error = _train_until_inf(report_dir, guard=False)
    replay_file = report_dir / f"replay-rank0-batch{error.batch_number}.pt"
    report_json = json.loads((report_dir / f"nanwatch-report-rank0-batch{error.batch_number}.json").read_text())
    return Captured(replay_file, report_json, error, report_dir)


def _frames_of_batch(report: dict[str, Any], batch_number: int) -> list[dict[str, Any]]:
    return [frame for frame in report["frames"] if frame["batch_number"] == batch_number]


def _cause_lines(error: NonFiniteError) -> list[str]:
    """The original report's cause and repro capsule lines, just before its culprit line. A replay reads the frames
    again and tests no cause, so its report has neither; every other line is the same."""
    assert error.culprit is not None
    lines = error.report.splitlines()
    culprit = lines.index(error.culprit.message)
    expected = [f"cause: {error.cause}"] + ([capsule_line(error.capsule)] if error.capsule is not None else [])
    assert lines[culprit - len(expected) : culprit] == expected
    return expected


def _overflow_in_one_step(model: torch.nn.Module, handle: nanwatch.WatchHandle) -> None:
    model(torch.full((4, 8), 3e38))  # 8 inputs near fp32's maximum: the first Linear's output is inf
    handle.step()


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nanwatch", "replay", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# ------------------------------------------------------------------------------------------------ capturing


def test_the_replay_file_holds_the_failing_forward(captured: Captured) -> None:
    assert captured.error.batch_number > 10  # the weights had to grow: batch 0's state would not overflow
    names = {p.name for p in captured.report_dir.iterdir()}
    assert {f"nanwatch-report-rank0-batch{captured.error.batch_number}.json", captured.replay_file.name} <= names
    assert [name for name in names if name.startswith("replay-") or ".tmp" in name] == [captured.replay_file.name]
    data = load_replay_file(captured.replay_file)
    assert data["batch_number"] == captured.error.batch_number
    assert data["rank"] == 0
    assert data["model_class"].endswith("replay_models.TinyNet")
    assert data["report"] == captured.report_json
    assert data["config"]["capture_on_detect"] is True
    assert data["config"]["max_frames_to_save"] == MAX_FRAMES
    assert set(data["parameters"]) == {name for name, _ in TinyNet().named_parameters()}
    assert set(data["buffers"]) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    assert data["layout"]["parameters"]["inp.weight"] == {"shape": [WIDTH, 8], "dtype": "float32"}
    assert list(data["args"][0].shape) == [32, 8]
    assert torch.equal(data["kwargs"]["scale"], torch.full((WIDTH,), 2.0))
    assert set(data["rng"]) == {"python", "torch"}
    # The weights as the failing forward began: finite, although the optimizer step after it made them nan.
    assert all(bool(torch.isfinite(t).all()) for t in data["parameters"].values())
    # ... and they are the ones the report shows for that batch.
    head = next(f for f in _frames_of_batch(captured.report_json, data["batch_number"]) if f["module"] == "head")
    weight = next(e for e in head["entries"] if e["label"] == "weight")
    assert weight["abs_max"] == data["parameters"]["head.weight"].abs().max().item()


def test_with_the_optimizer_guard_the_replay_matches_too(tmp_path: Path) -> None:
    error = _train_until_inf(tmp_path, guard=True)  # detected before the optimizer step, in its pre-hook
    assert error.optimizer_step == error.batch_number
    result = replay(tmp_path / f"replay-rank0-batch{error.batch_number}.pt", factory)
    assert result.matches_original, result.differences
    assert result.report is not None
    # The original also names the gradients the step would have applied (the guard's line): a forward's replay has
    # no optimizer step to say that of. Nor does it test a cause (the original's cause and capsule lines). Every
    # other line is the same.
    assert error.cause is not None
    assert (error.cause.kind, error.cause.module_name) == ("precision", "head")
    assert error.capsule == str(tmp_path / f"nanwatch-capsule-rank0-batch{error.batch_number}.pt")
    guard_line = "non-finite gradients about to be applied by optimizer step"
    cause_lines = _cause_lines(error)
    original = [
        line for line in error.report.splitlines() if not line.startswith(guard_line) and line not in cause_lines
    ]
    assert len(original) == len(error.report.splitlines()) - 3
    assert result.report.to_text().splitlines() == original


# -------------------------------------------------------------------------------------------------- replaying


@pytest.mark.slow
def test_cli_replay_gives_the_frames_of_the_original_report(captured: Captured, tmp_path: Path) -> None:
    out = tmp_path / "replayed"
    result = _cli(str(captured.replay_file), "--model", FACTORY, "--report-dir", str(out), "--max-frames-to-save", "8")
    assert result.returncode == 0, result.stderr
    batch = captured.error.batch_number
    expected = _frames_of_batch(captured.report_json, batch)
    assert len(expected) == MAX_FRAMES  # the whole report lies in the failing batch, so all of it is compared
    assert f"The replay matches the original report: its {MAX_FRAMES} frames of batch_number={batch}" in result.stdout
    assert f"of 14: module {captured.error.module_name!r}" in result.stdout  # "inf/nan first appears in frame k"
    # The trace printed is every frame of the batch, and the original report's frames are its lines, in order.
    original_text = (captured.report_dir / f"nanwatch-report-rank0-batch{batch}.txt").read_text().splitlines()
    trace = result.stdout.splitlines()
    # After the header, "Last 8 forward frames:" and the table header; up to the blank line before the culprit line.
    frame_lines = original_text[3 : original_text.index("")]
    start = trace.index(frame_lines[0])
    assert trace[start : start + len(frame_lines)] == frame_lines
    assert f" *** Starting batch number={batch} ***" in result.stdout
    # --report-dir (a generated config option) also writes the replay, named apart from the original report.
    stem = f"nanwatch-replay-rank0-batch{batch}"
    assert sorted(p.name for p in out.iterdir()) == [f"{stem}.json", f"{stem}.txt"]
    written = json.loads((out / f"{stem}.json").read_text())
    assert written["report"]["frames"] == captured.report_json["frames"]
    assert written["matches_original"] is True
    assert len(written["frames"]) == 14
    assert (out / f"{stem}.txt").read_text() == result.stdout.split("written: ")[0]


def test_python_replay_equals_the_original_frames_value_for_value(captured: Captured) -> None:
    fresh = factory()
    assert not torch.equal(fresh.head.weight, load_replay_file(captured.replay_file)["parameters"]["head.weight"])
    result = replay(captured.replay_file, fresh)
    assert result.matches_original, result.differences
    assert result.report is not None
    assert result.report.to_dict()["frames"] == captured.report_json["frames"]
    # The original's cause and capsule lines aside (a replay tests no cause), the same text.
    cause_lines = _cause_lines(captured.error)
    assert result.report.to_text().splitlines() == [
        line for line in captured.error.report.splitlines() if line not in cause_lines
    ]
    # The same forward as the guarded run's (test_with_the_optimizer_guard_the_replay_matches_too), whose cause is
    # precision. Here the optimizer stepped before the check (no guard): the weights are no longer those the forward
    # used, so the cause is not tested (a test on other weights would say something false), and no capsule is written.
    assert captured.error.cause is not None
    assert (captured.error.cause.kind, captured.error.cause.module_name) == ("unknown", "head"), captured.error.cause
    assert (
        "the weights changed after the forward (an optimizer step ran before this check"
        in captured.error.cause.evidence
    )
    assert captured.error.capsule is None
    assert result.report.module_name == captured.error.module_name
    assert [frame.batch_number for frame in result.frames] == [captured.error.batch_number] * len(result.frames)
    assert len(result.frames) == 14  # every module of TinyNet once, the root last
    # The restored model holds the captured weights and is left in training mode, as the forward ran.
    assert torch.equal(fresh.head.weight, load_replay_file(captured.replay_file)["parameters"]["head.weight"])
    assert fresh.training


def test_replay_by_factory_name_and_callable_agree(captured: Captured) -> None:
    by_name = replay(captured.replay_file, FACTORY)
    by_callable = replay(captured.replay_file, factory)
    assert by_name.frames == by_callable.frames
    assert by_name.matches_original


def test_replay_restores_the_generators_and_puts_the_callers_back(captured: Captured) -> None:
    torch.manual_seed(99)
    expected_next = torch.rand(3)
    torch.manual_seed(99)
    replay(captured.replay_file, factory)
    assert torch.equal(torch.rand(3), expected_next)


@pytest.mark.slow
def test_a_replay_with_another_dropout_mask_is_reported_as_different(captured: Captured, tmp_path: Path) -> None:
    data = torch.load(captured.replay_file, weights_only=True)
    data["rng"]["torch"] = torch.Generator().manual_seed(7).get_state()  # Dropout draws another mask
    tampered = tmp_path / "tampered.pt"
    torch.save(data, tampered)
    result = replay(tampered, factory)
    assert not result.matches_original
    assert result.differences
    cli = _cli(str(tampered), "--model", FACTORY)
    assert cli.returncode == 1
    assert "The replay differs from the original report:" in cli.stdout


def test_replay_of_an_eval_forward(tmp_path: Path) -> None:
    model = factory().eval()
    with (
        pytest.raises(NonFiniteError) as caught,
        nanwatch.watch(model, capture_on_detect=True, watch_eval=True, report_dir=tmp_path),
    ):
        model(torch.full((4, 8), 3e38))
    assert caught.value.phase == "eval"
    result = replay(tmp_path / "replay-eval-rank0-batch0.pt", factory)
    assert result.phase == "eval"
    assert result.matches_original, result.differences
    assert result.report is not None
    # The original's cause and capsule lines aside (a replay tests no cause), the same text.
    assert caught.value.cause is not None
    assert (caught.value.cause.kind, caught.value.cause.module_name) == ("precision", "inp")
    assert caught.value.capsule == str(tmp_path / "nanwatch-capsule-eval-rank0-batch0.pt")
    cause_lines = _cause_lines(caught.value)
    assert result.report.to_text().splitlines() == [
        line for line in caught.value.report.splitlines() if line not in cause_lines
    ]


def test_replay_runs_under_the_autocast_of_the_capture(tmp_path: Path) -> None:
    model = factory()
    handle = nanwatch.watch(model, capture_on_detect=True, report_dir=tmp_path)
    with pytest.raises(NonFiniteError), torch.autocast("cpu", dtype=torch.bfloat16):
        _overflow_in_one_step(model, handle)
    handle.close()
    assert load_replay_file(tmp_path / "replay-rank0-batch0.pt")["autocast"] == {"cpu": "bfloat16"}
    result = replay(tmp_path / "replay-rank0-batch0.pt", factory)
    assert result.matches_original, result.differences
    assert result.report is not None
    assert result.report.frames[-1].entries[-1].dtype == "bfloat16"  # the Linear's output, cast by autocast
    assert not torch.is_autocast_enabled("cpu")


def test_replay_applies_the_captured_determinism_and_puts_the_callers_back(tmp_path: Path) -> None:
    model = factory()
    handle = nanwatch.watch(model, capture_on_detect=True, report_dir=tmp_path)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(NonFiniteError):
            _overflow_in_one_step(model, handle)
    finally:
        torch.use_deterministic_algorithms(False)
        handle.close()
    path = tmp_path / "replay-rank0-batch0.pt"
    assert load_replay_file(path)["determinism"]["deterministic_algorithms"] is True
    seen: list[bool] = []
    replayed = factory()
    replayed.head.register_forward_hook(lambda *_: seen.append(torch.are_deterministic_algorithms_enabled()))
    assert replay(path, replayed).matches_original
    assert seen == [True]
    assert not torch.are_deterministic_algorithms_enabled()


# -------------------------------------------------------------------------------------------------- bad input


def _unchanged(directory: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in directory.iterdir())


def test_a_file_from_another_model_names_the_mismatching_parameters(captured: Captured) -> None:
    before = _unchanged(captured.report_dir)
    with pytest.raises(ReplayError) as caught:
        replay(captured.replay_file, "tests.replay_models:other_factory")
    message = str(caught.value)
    assert "does not fit the model built by tests.replay_models:other_factory" in message
    assert "parameters in the model but not in the file: extra.weight, extra.bias" in message
    assert "inp.weight (file [16, 8], model [32, 8])" in message
    assert "norm.running_mean (file [16], model [32])" in message
    assert _unchanged(captured.report_dir) == before


def test_a_model_of_another_dtype_is_named(captured: Captured) -> None:
    with pytest.raises(ReplayError, match=r"of another dtype: inp\.weight \(file float32, model float16\)"):
        replay(captured.replay_file, "tests.replay_models:half_factory")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            "tests.replay_models:fatcory",
            "module 'tests.replay_models' has no attribute 'fatcory'.*factory, half_factory",
        ),
        (
            "tests.replay_modls:factory",
            "cannot import module 'tests.replay_modls'.*no module named 'tests.replay_modls'",
        ),
        ("tests.replay_models", "--model must be 'package.module:factory'"),
        ("tests.replay_models:NOT_CALLABLE", "names an object of type int, not a callable"),
        ("tests.replay_models:broken_factory", "raised RuntimeError: the config file train.yaml is missing"),
    ],
)
def test_a_bad_factory_is_named(captured: Captured, spec: str, expected: str) -> None:
    with pytest.raises(ReplayError, match=expected):
        replay(captured.replay_file, spec)


@pytest.mark.slow
def test_cli_typo_in_the_module_path(captured: Captured) -> None:
    cli = _cli(str(captured.replay_file), "--model", "tests.replay_modls:factory")
    assert cli.returncode == 2
    assert "nanwatch replay: cannot import module 'tests.replay_modls'" in cli.stderr
    assert "Traceback" not in cli.stderr
    assert cli.stdout == ""


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"abs min  abs max  metadata\n", "is not a nanwatch replay file"),
        (bytes(range(256)) * 4, "is not a nanwatch replay file"),
        (b"", "is not a nanwatch replay file"),
    ],
)
def test_not_a_replay_file(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "replay-rank0-batch3.pt"
    path.write_bytes(content)
    with pytest.raises(ReplayError, match=expected):
        replay(path, factory)
    assert _unchanged(tmp_path) == [(path.name, len(content))]


def test_a_torch_file_that_is_not_a_replay_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save(TinyNet().state_dict(), path)
    with pytest.raises(ReplayError, match="is a torch file but not a nanwatch replay file.*'blocks.0.bias'"):
        replay(path, factory)


def test_inputs_that_are_python_objects_need_a_trusted_load(captured: Captured, tmp_path: Path) -> None:
    data = torch.load(captured.replay_file, weights_only=True)
    data["kwargs"]["scale"] = Fraction(3, 2)
    path = tmp_path / "objects.pt"
    torch.save(data, path)
    with pytest.raises(ReplayError, match=r"holds Python objects .*\(fractions\.Fraction, .*trusted=True"):
        replay(path, factory)
    assert load_replay_file(path, trusted=True)["kwargs"]["scale"] == Fraction(3, 2)


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="does not exist"):
        replay(tmp_path / "replay-rank0-batch1.pt", factory)


def test_a_damaged_replay_file_is_named(captured: Captured, tmp_path: Path) -> None:
    data = torch.load(captured.replay_file, weights_only=True)
    del data["args"]
    data["parameters"]["head.bias"] = "not a tensor"
    path = tmp_path / "damaged.pt"
    torch.save(data, path)
    with pytest.raises(ReplayError, match=r"damaged: .*'args' \(missing\).*parameters\['head.bias'\]"):
        replay(path, factory)
