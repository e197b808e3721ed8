"""core/watcher.py: the engine every adapter drives. Real modules and real optimizers; no mocks."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest
import torch
from tests.models import Scale, small_mlp
from torch import nn

import nanwatch.core.engine.checker
import nanwatch.core.engine.publisher
import nanwatch.core.engine.recording.recorder
import nanwatch.core.features.headroom
import nanwatch.core.report
import nanwatch.core.scope
import nanwatch.core.stats.cache
import nanwatch.core.stats.grouped
import nanwatch.core.stats.measure
from nanwatch import BatchLimitReached, ConfigError, NanwatchWarning, NonFiniteError, WatchConfig
from nanwatch.core.frames import ResolvedFrame, resolve
from nanwatch.core.watcher import Watcher


def _resolved(watcher: Watcher) -> list[ResolvedFrame]:
    return resolve(watcher.recent_frames())


def _entry(frame: ResolvedFrame, label: str) -> tuple[float | int | None, float | int | None]:
    entry = next(e for e in frame.entries if e.label == label)
    return entry.abs_min, entry.abs_max


def _our_hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# --------------------------------------------------------------------------------------------------------- hooks


def test_attach_hooks_every_module_once_and_detach_removes_them() -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    assert watcher.attached
    for name, module in model.named_modules():
        # The root also carries the cause feature's 2 hooks, which keep the micro-batch's forward call: a pre-hook
        # and an always-called forward hook.
        assert len(module._forward_hooks) == (2 if name == "" else 1)
        assert len(module._forward_hooks_always_called) == len(module._forward_pre_hooks) == (1 if name == "" else 0)
    with pytest.raises(RuntimeError, match="already attached"):
        watcher.attach()
    watcher.close(check=False)
    assert not watcher.attached
    assert _our_hook_count(model) == 0
    watcher.close(check=False)  # twice is fine


def test_frames_are_named_by_qualified_name_in_hook_order() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), nn.Linear(2, 1))
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    model(torch.randn(3, 2))
    frames = _resolved(watcher)
    assert [(f.module_name, f.class_name) for f in frames] == [
        ("0.0", "Linear"),
        ("0.1", "Tanh"),
        ("0", "Sequential"),
        ("1", "Linear"),
        ("", "Sequential"),
    ]
    assert [e.label for e in frames[0].entries] == ["weight", "bias", "input[0]", "output"]
    assert [e.label for e in frames[1].entries] == ["input[0]", "output"]


def test_a_shared_module_takes_the_first_name_and_records_each_call() -> None:
    class TwoNames(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(3, 3)
            self.second = self.first  # the same module under a second name

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x))

    model = TwoNames()
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    x = torch.randn(2, 3)
    model(x)
    frames = _resolved(watcher)
    assert [f.module_name for f in frames] == ["first", "first", ""]
    assert len(model.first._forward_hooks) == 1
    once = model.first(x)
    assert _entry(frames[0], "output") == (once.abs().min().item(), once.abs().max().item())


@pytest.mark.parametrize("change", ["in place", "replaced", "data assigned"])
def test_a_weight_changed_between_two_calls_of_one_batch_is_measured_again(change: str) -> None:
    class NewWeightForSecondCall(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first = self.layer(x)
            with torch.no_grad():  # what the module's second call sees is another weight
                if change == "in place":
                    self.layer.weight.mul_(10)
                elif change == "replaced":
                    self.layer.weight = nn.Parameter(self.layer.weight * 10)
                else:
                    self.layer.weight.data = self.layer.weight.data * 10
            return self.layer(first)

    torch.manual_seed(0)
    model = NewWeightForSecondCall()
    before = _abs_range(model.layer.weight)
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    model(torch.randn(2, 3))
    first, second, _root = _resolved(watcher)
    assert _entry(first, "weight") == before
    assert _entry(second, "weight") == _abs_range(model.layer.weight)
    assert _entry(second, "weight")[1] == pytest.approx(10 * before[1])
    assert _entry(second, "bias") == _entry(first, "bias")


def test_a_sparse_parameter_gets_its_line_at_every_call_and_watching_goes_on() -> None:
    class SparseWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.eye(3).to_sparse())  # no storage of its own to fingerprint

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(self.weight, x)

    model = SparseWeight()
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    for _batch in range(2):
        model(torch.randn(3, 2))
        model(torch.randn(3, 2))
        frames = _resolved(watcher)
        watcher.end_batch()
    assert watcher.disabled_reason is None
    weight = next(entry for entry in frames[-1].entries if entry.label == "weight")
    assert (weight.abs_min, weight.abs_max, weight.note) == (1.0, 1.0, "sparse_coo: values")  # its stored values


def test_recorded_numbers_are_exact_and_survive_an_in_place_relu() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    x = torch.randn(5, 4)
    with torch.no_grad():
        before_relu = model[0](x)
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    model(x)
    linear0, relu, linear1, _root = _resolved(watcher)
    # The Linear's output was measured before ReLU overwrote it: what transformers reports for that frame.
    assert _entry(linear0, "output") == (before_relu.abs().min().item(), before_relu.abs().max().item())
    after_relu = before_relu.relu()
    assert _entry(relu, "input[0]") == (after_relu.abs().min().item(), after_relu.abs().max().item())
    assert _entry(relu, "output") == (after_relu.abs().min().item(), after_relu.abs().max().item())
    assert _entry(linear1, "input[0]") == _entry(relu, "output")
    assert _entry(linear0, "weight") == (
        model[0].weight.abs().min().item(),
        model[0].weight.abs().max().item(),
    )


# ----------------------------------------------------------------------------------------- counting and checking


def test_batch_number_advances_only_at_end_batch() -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    x = torch.randn(2, 4)
    model(x)
    model(x)
    assert watcher.counters.batch_number == 0
    assert {f.batch_number for f in watcher.recent_frames()} == {0}
    watcher.end_batch()
    assert watcher.counters.batch_number == 1
    model(x)
    assert watcher.recent_frames()[-1].batch_number == 1


def test_detection_reports_the_frames_ending_at_the_first_inf() -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig(max_frames_to_save=6))
    watcher.attach()
    x = torch.randn(2, 4)
    model(x)  # batch 0: five clean frames go to the ring
    watcher.end_batch()
    model[2].factor = math.inf
    model(x)
    report = watcher.check()
    assert report is not None
    assert report.batch_number == 1
    assert report.module_name == "2"
    names = [(f.module_name, f.batch_number) for f in report.frames]
    # 6 frames: the last three of batch 0, then batch 1 up to and including the Scale that made the inf.
    assert names == [("2", 0), ("3", 0), ("", 0), ("0", 1), ("1", 1), ("2", 1)]
    assert report.frames[-1].non_finite
    assert not any(f.non_finite for f in report.frames[:-1])
    assert report.to_text().startswith("Detected inf/nan during batch_number=1\nLast 6 forward frames:\n")


def test_frames_before_the_first_inf_are_cut_to_max_frames() -> None:
    model = nn.Sequential(*[Scale() for _ in range(10)], Scale(math.inf), Scale())
    watcher = Watcher(model, WatchConfig(max_frames_to_save=3))
    watcher.attach()
    model(torch.ones(2))
    report = watcher.check()
    assert report is not None
    assert [f.module_name for f in report.frames] == ["8", "9", "10"]


def test_clean_check_moves_frames_to_the_ring_and_returns_none() -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig(max_frames_to_save=3))
    watcher.attach()
    for _ in range(4):
        model(torch.randn(2, 4))
        assert watcher.check() is None
        watcher.end_batch()
    assert len(watcher.recent_frames()) == 3


def test_rank_and_world_size_appear_in_the_report() -> None:
    model = nn.Sequential(Scale(math.nan))
    watcher = Watcher(model, WatchConfig(), rank=3, world_size=4)
    watcher.attach()
    model(torch.ones(1))
    with pytest.raises(NonFiniteError) as info:
        watcher.end_batch()  # not initialised: the collective is skipped, this rank decides alone
    error = info.value
    assert (error.batch_number, error.rank, error.module_name) == (0, 3, "0")
    assert error.report.startswith("Detected inf/nan during batch_number=0 on rank 3\n")


def test_set_phase_rejects_unknown_phases() -> None:
    watcher = Watcher(small_mlp(out_features=2), WatchConfig())
    with pytest.raises(ValueError, match=r"phase can be one of \('train', 'eval'\), got 'test'"):
        watcher.start_batch("test")


def test_eval_phase_is_recorded_only_with_watch_eval_and_counted_apart() -> None:
    for watch_eval in (False, True):
        model = small_mlp(out_features=2)
        watcher = Watcher(model, WatchConfig(watch_eval=watch_eval))
        watcher.attach()
        watcher.start_batch("eval")
        assert watcher.recording is watch_eval
        model(torch.randn(2, 4))
        assert len(watcher.recent_frames()) == (5 if watch_eval else 0)
        watcher.end_batch()
        assert watcher.counters.batch_number == 0
        assert watcher.counters.eval_batch_number == 1
        watcher.start_batch("train")
        assert watcher.recording


def test_state_dict_round_trip_restores_counters_and_tracing() -> None:
    watcher = Watcher(small_mlp(out_features=2), WatchConfig(trace_batch_nums=[5]))
    watcher.load_state_dict({"batch_number": 5, "eval_batch_number": 2, "optimizer_step": 4, "epoch": 1})
    restored = Watcher(small_mlp(out_features=2), WatchConfig(trace_batch_nums=[5]))
    restored.load_state_dict(watcher.state_dict())
    assert restored.state_dict() == {"batch_number": 5, "eval_batch_number": 2, "optimizer_step": 4, "epoch": 1}
    assert restored.tracing  # batch 5 is traced, so resuming at 5 traces it


def test_trace_ranks_choose_who_traces(nanwatch_log: pytest.LogCaptureFixture) -> None:
    cases = [("zero", 0, True), ("zero", 1, False), ("all", 1, True), ([1, 2], 2, True), ([1, 2], 0, False)]
    for trace_ranks, rank, traces in cases:
        nanwatch_log.clear()
        model = nn.Sequential(Scale())
        watcher = Watcher(model, WatchConfig(trace_batch_nums=[0], trace_ranks=trace_ranks), rank=rank, world_size=4)
        watcher.attach()
        model(torch.ones(1))
        traced = [r for r in nanwatch_log.records if "*** Starting batch number=0" in r.getMessage()]
        assert bool(traced) is traces, (trace_ranks, rank)
        if traces:
            assert f"*** Starting batch number=0 on rank {rank} ***" in traced[0].getMessage()


def test_abort_after_batch_num() -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig(abort_after_batch_num=1))
    watcher.attach()
    model(torch.randn(1, 4))
    watcher.end_batch()
    model(torch.randn(1, 4))
    with pytest.raises(BatchLimitReached, match="abort_after_batch_num=1") as info:
        watcher.end_batch()
    assert info.value.batch_number == 1
    assert isinstance(info.value, ValueError)


def test_a_report_dir_nanwatch_cannot_use_is_an_error_at_attach(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the report directory should be")
    model = nn.Sequential(Scale(math.inf))
    for report_dir, message in ((blocker, "is a file, not a folder"), (blocker / "reports", "cannot be created")):
        watcher = Watcher(model, WatchConfig(report_dir=report_dir))
        with pytest.raises(ConfigError, match=message):
            watcher.attach()
        assert not watcher.attached
        assert _our_hook_count(model) == 0
    with pytest.raises(ConfigError, match="report_dir.*NUL byte"):
        WatchConfig.from_dict({"report_dir": "reports\x00x"})


def test_a_report_that_cannot_be_written_is_still_logged_and_raised(
    tmp_path: Path, nanwatch_log: pytest.LogCaptureFixture
) -> None:
    report_dir = tmp_path / "reports"
    model = nn.Sequential(Scale(math.inf))
    watcher = Watcher(model, WatchConfig(report_dir=report_dir))
    watcher.attach()
    report_dir.rmdir()
    report_dir.write_text("a file where the report directory was")  # the folder went away after attach
    model(torch.ones(1))
    with pytest.warns(NanwatchWarning) as warned, pytest.raises(NonFiniteError) as info:
        watcher.end_batch()  # the detection is still raised: a full disk must not hide it
    assert info.value.report.startswith("Detected inf/nan during batch_number=0")
    # Two files could not be written: the report, then the repro capsule of the culprit's call (the Scale's) that
    # the report names, tried once the report is out.
    exists = FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))
    path = report_dir / "nanwatch-capsule-rank0-batch0.pt"
    capsule = f"nanwatch could not write the repro capsule {path} that the report names"
    report = f"nanwatch could not write the report to {report_dir}"
    assert [str(warning.message) for warning in warned] == [f"{report}: {exists!r}", f"{capsule}: {exists!r}"]
    assert info.value.capsule is None
    messages = [r.getMessage() for r in nanwatch_log.records]
    logged = next(i for i, m in enumerate(messages) if "Detected inf/nan during batch_number=0" in m)
    assert logged < messages.index(f"{report}: {exists!r}")  # logged before any file is tried
    assert logged < messages.index(f"{capsule}: {exists!r}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reports"]  # no temporary file left behind
    watcher.close(check=False)


# --------------------------------------------------------------------------- parameters changed between batches


def _weight_line(watcher: Watcher, module_name: str) -> tuple[float | int | None, float | int | None]:
    frame = [f for f in _resolved(watcher) if f.module_name == module_name][-1]
    return _entry(frame, "weight")


def _abs_range(tensor: torch.Tensor) -> tuple[float, float]:
    return tensor.detach().abs().min().item(), tensor.detach().abs().max().item()


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.AdamW(params, lr=0.3, fused=True),
        lambda params: torch.optim.AdamW(params, lr=0.3, foreach=True),
        lambda params: torch.optim.SGD(params, lr=0.3, foreach=False),
    ],
    ids=["adamw-fused", "adamw-foreach", "sgd"],
)
def test_weights_are_remeasured_after_an_optimizer_step(make_optimizer: object) -> None:
    model = small_mlp(out_features=2)
    optimizer = make_optimizer(model.parameters())  # type: ignore[operator]
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    for _ in range(3):
        model(torch.randn(4, 4)).pow(2).sum().backward()
        assert _weight_line(watcher, "0") == _abs_range(model[0].weight)
        optimizer.step()
        optimizer.zero_grad()
        watcher.end_batch()


def test_weights_written_through_data_are_remeasured_next_batch() -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig())
    watcher.attach()
    x = torch.randn(2, 4)
    model(x)
    watcher.end_batch()
    for param in model.parameters():  # a hand-written SGD step, as old training loops do it
        param.data.add_(5.0)
    model(x)
    assert _weight_line(watcher, "0") == _abs_range(model[0].weight)
    assert _weight_line(watcher, "3") == _abs_range(model[3].weight)


def test_weights_are_remeasured_after_half_and_to_in_eval() -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig(watch_eval=True))
    watcher.attach()
    watcher.start_batch("eval")
    x = torch.randn(2, 4)
    model(x)
    watcher.end_batch()
    model.to(torch.float64)
    model(x.double())
    frame = [f for f in _resolved(watcher) if f.module_name == "0"][-1]
    weight = next(e for e in frame.entries if e.label == "weight")
    assert weight.dtype == "float64"
    assert (weight.abs_min, weight.abs_max) == _abs_range(model[0].weight)


def test_weights_changed_between_train_and_eval_are_remeasured() -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig(watch_eval=True))
    watcher.attach()
    x = torch.randn(2, 4)
    model(x)
    watcher.start_batch("eval")  # e.g. swap in EMA weights for evaluation, through `.data`
    model[0].weight.data.mul_(-3.0)
    model(x)
    assert _weight_line(watcher, "0") == _abs_range(model[0].weight)
    watcher.end_batch()
    model[0].weight.data.mul_(0.5)
    watcher.start_batch("train")
    model(x)
    assert _weight_line(watcher, "0") == _abs_range(model[0].weight)


# ----------------------------------------------------------------------------------------------- robustness


def test_pending_frames_stay_bounded_when_batches_never_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read once by the recorder, for its `append` and the modules' hooks (core/engine/recording/module_hook.py) alike.
    monkeypatch.setattr(nanwatch.core.engine.recording.recorder, "MAX_PENDING_FRAMES", 20)
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig(max_frames_to_save=7))
    watcher.attach()
    x = torch.randn(2, 4)
    for _ in range(30):
        model(x)
        assert len(watcher.recent_frames()) <= 7 + 21
    model[2].factor = math.inf
    for _ in range(10):  # the inf is found by a bounded check mid-batch and held for end_batch
        model(x)
    with pytest.raises(NonFiniteError) as info:
        watcher.end_batch()
    assert info.value.module_name == "2"
    assert info.value.batch_number == 0


@pytest.mark.cpu_path  # measure() as each call returns: the CPU's way
def test_a_failure_in_measuring_disables_watching_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    model = small_mlp(out_features=2)
    x = torch.randn(2, 4)
    expected = model(x)
    watcher = Watcher(model, WatchConfig())
    watcher.attach()

    def broken(tensor: torch.Tensor, kernels: object = ()) -> nanwatch.core.stats.measure.Measurement:
        raise RuntimeError("simulated bookkeeping bug")

    # Every module that calls measure(): the cache (activations, losses, untracked parameters) and the stacks
    # (the tracked parameters measured one by one).
    for module in (nanwatch.core.stats.cache, nanwatch.core.stats.grouped):
        monkeypatch.setattr(module, "measure", broken)
    with pytest.warns(NanwatchWarning, match="simulated bookkeeping bug"):
        output = model(x)
    assert torch.equal(output, expected)  # the user's forward ran and returned its own result
    assert watcher.disabled_reason is not None
    assert "simulated bookkeeping bug" in watcher.disabled_reason
    assert not watcher.recording
    model[2].factor = math.inf
    model(x)  # no second warning, nothing recorded
    watcher.end_batch()
    assert watcher.counters.batch_number == 1
    watcher.start_batch("train")
    assert not watcher.recording  # a phase change does not switch a disabled watcher back on


@pytest.mark.parametrize("headroom", [None, 0.125], ids=["plain-check", "headroom-check"])
def test_a_failure_in_checking_disables_watching(monkeypatch: pytest.MonkeyPatch, headroom: float | None) -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig(headroom_warn_fraction=headroom))
    watcher.attach()
    model(torch.randn(2, 4))

    def broken(*args: object) -> bool:
        raise RuntimeError("simulated check bug")

    # The batch check's fold (what its one read reads), or with headroom checks on (the default) the feature's flags.
    if headroom is None:
        monkeypatch.setattr(nanwatch.core.engine.checker, "fold", broken)
    else:
        monkeypatch.setattr(nanwatch.core.features.headroom.HeadroomMonitor, "screen", broken)
    with pytest.warns(NanwatchWarning, match="simulated check bug"):
        watcher.end_batch()
    assert watcher.counters.batch_number == 1
    assert watcher.disabled_reason is not None


# ------------------------------------------------------------------------------------- nanwatch's own failures


def test_numpy_and_tensor_counters_reach_the_report_as_whole_numbers(tmp_path: Path) -> None:
    # Before: a numpy int64 epoch made publish() raise TypeError before logging: no report anywhere.
    numpy = pytest.importorskip("numpy")
    model = nn.Sequential(Scale(math.inf))
    watcher = Watcher(model, WatchConfig(report_dir=tmp_path))
    watcher.attach()
    watcher.set_counters(epoch=numpy.int64(3), optimizer_step=torch.tensor(7))
    model(torch.ones(1))
    with pytest.raises(NonFiniteError) as info:
        watcher.end_batch()
    watcher.close(check=False)
    assert (info.value.epoch, info.value.optimizer_step) == (3, 7)
    document = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text())
    assert (document["epoch"], document["optimizer_step"]) == (3, 7)


def test_a_counter_that_is_no_number_is_left_out_not_fatal(nanwatch_log: pytest.LogCaptureFixture) -> None:
    watcher = Watcher(nn.Sequential(nn.Identity()), WatchConfig())
    watcher.set_counters(epoch="one")  # type: ignore[arg-type]
    assert watcher.counters.epoch is None
    assert any("epoch must be a whole number, got 'one'" in r.getMessage() for r in nanwatch_log.records)


@pytest.mark.parametrize("broken", ["to_text", "write_report"])
def test_a_bug_on_the_publish_path_still_ends_in_the_error_with_its_report(
    broken: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"simulated bug in {broken}")

    if broken == "to_text":
        monkeypatch.setattr(nanwatch.core.report.Report, "to_text", bug)
    else:
        monkeypatch.setattr(nanwatch.core.engine.publisher, "write_report", bug)
    model = nn.Sequential(Scale(math.inf))
    watcher = Watcher(model, WatchConfig(report_dir=tmp_path))
    watcher.attach()
    model(torch.ones(1))
    with pytest.warns(NanwatchWarning, match=f"simulated bug in {broken}"), pytest.raises(NonFiniteError) as info:
        watcher.end_batch()
    watcher.close(check=False)
    assert info.value.report.startswith("Detected inf/nan during batch_number=0")
    assert info.value.module_name == "0"


def test_a_bug_in_deciding_what_to_watch_disables_watching_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = small_mlp(out_features=2)
    watcher = Watcher(model, WatchConfig(watch_every_n_batches=2))
    watcher.attach()
    model(torch.randn(2, 4))

    def bug(self: object, batch_number: int) -> bool:
        raise RuntimeError("simulated bug in BatchSchedule.watched")

    monkeypatch.setattr(nanwatch.core.scope.BatchSchedule, "watched", bug)
    with pytest.warns(NanwatchWarning, match="simulated bug in BatchSchedule.watched"):
        watcher.end_batch()
    assert watcher.disabled_reason is not None
    model(torch.randn(2, 4))
    watcher.end_batch()  # the run goes on
    assert watcher.counters.batch_number == 2
    watcher.close(check=False)
