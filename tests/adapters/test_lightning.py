"""`OverflowCallback` in real Lightning `Trainer` runs on the CPU: one process, a checkpoint resume, two DDP ranks."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from nanwatch import ConfigError, NanwatchWarning, NonFiniteError, WatchConfig  # noqa: E402
from nanwatch.adapters.lightning import OverflowCallback  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from lightning_run import (  # noqa: E402
    InjectingModule,
    Snapshots,
    hook_count,
    loaders,
    make_trainer,
    same_weights,
)

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*isinstance\\(treespec, LeafSpec\\).*",
    "ignore:.*smaller than the logging interval.*",
    "ignore:.*Checkpoint directory .* exists and is not empty.*",
)


def _report_frames(report_dir: Path, name: str) -> list[dict[str, object]]:
    frames: list[dict[str, object]] = json.loads((report_dir / name).read_text(encoding="utf-8"))["frames"]
    return frames


def test_stops_before_the_step_that_would_apply_the_bad_micro_batch(tmp_path: Path) -> None:
    # 2 micro-batches per epoch and per optimizer step: micro-batch 3 is the second of epoch 1, of step 1.
    model = InjectingModule(inject_at=3)
    snapshots = Snapshots()
    callback = OverflowCallback(report_dir=tmp_path / "reports")
    trainer = make_trainer(tmp_path, [snapshots, callback])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    assert hook_count(model) == 0

    with pytest.raises(NonFiniteError) as caught:
        trainer.fit(model, *loaders())

    error = caught.value
    assert (error.batch_number, error.optimizer_step, error.epoch, error.rank) == (3, 1, 1, 0)
    assert error.module_name == "blowup"
    assert error.phase == "train"
    assert error.report.startswith("Detected inf/nan during batch_number=3\n")
    # Step 0 ran; step 1, which would have applied micro-batches 2 and 3, did not.
    assert trainer.global_step == 1
    assert not same_weights(model, initial)
    assert same_weights(model, snapshots.weights[3])
    assert hook_count(model) == 0
    assert callback.watcher is None
    # Validation ran (sanity check, then after epoch 0) but was neither counted nor recorded.
    assert model.blowup.eval_count == 4
    assert callback.state_dict()["eval_batch_number"] == 0
    written = (tmp_path / "reports" / "nanwatch-report-rank0-batch3.txt").read_text(encoding="utf-8")
    assert written.rstrip("\n") == error.report
    frames = _report_frames(tmp_path / "reports", "nanwatch-report-rank0-batch3.json")
    assert {frame["phase"] for frame in frames} == {"train"}
    assert [frame["module"] for frame in frames[-3:]] == ["inp", "act", "blowup"]
    assert "" not in {frame["module"] for frame in frames}, "the LightningModule itself must not be hooked"


def test_manual_optimization_is_checked_before_each_optimizer_step(tmp_path: Path) -> None:
    model = InjectingModule(inject_at=3, manual=True)
    snapshots = Snapshots()
    trainer = make_trainer(tmp_path, [snapshots, OverflowCallback()], accumulate_grad_batches=1)

    with pytest.raises(NonFiniteError) as caught:
        trainer.fit(model, *loaders())

    assert (caught.value.batch_number, caught.value.optimizer_step, caught.value.epoch) == (3, 3, 1)
    assert trainer.global_step == 3
    assert same_weights(model, snapshots.weights[3])
    assert not same_weights(model, snapshots.weights[2])
    assert hook_count(model) == 0


class OwnOptimizerModule(InjectingModule):
    """Manual optimization with an optimizer of its own, which configure_optimizers() does not return."""

    def __init__(self) -> None:
        super().__init__(manual=True)
        self.own = torch.optim.SGD(self.parameters(), lr=0.1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.own.zero_grad()
        self.manual_backward(loss)
        self.own.step()
        return loss

    def configure_optimizers(self) -> None:  # type: ignore[override]
        return None


@pytest.mark.filterwarnings("ignore:.*configure_optimizers.* returned .None.*")
def test_an_optimizer_lightning_does_not_know_is_warned_about_once(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [OverflowCallback()], accumulate_grad_batches=1, num_sanity_val_steps=0)
    with pytest.warns(NanwatchWarning) as record:
        trainer.fit(OwnOptimizerModule(), *loaders())
    messages = [str(warning.message) for warning in record if warning.category is NanwatchWarning]
    assert len(messages) == 1, messages
    assert "this SGD steps the watched model's weights unguarded" in messages[0]
    assert "configure_optimizers()" in messages[0]


@pytest.mark.parametrize("watch_eval", [False, True])
def test_validation_is_counted_apart_and_watched_only_when_asked(tmp_path: Path, watch_eval: bool) -> None:
    # inf in the second sanity-check forward: ignored by default, caught as eval_batch_number=1 when watched.
    model = InjectingModule(inject_eval_at=1)
    callback = OverflowCallback(watch_eval=watch_eval, report_dir=tmp_path)
    trainer = make_trainer(tmp_path, [callback])

    if not watch_eval:
        trainer.fit(model, *loaders())
        assert callback.state_dict()["batch_number"] == 4
        assert callback.state_dict()["eval_batch_number"] == 0
        assert list(tmp_path.glob("nanwatch-report*")) == []
    else:
        with pytest.raises(NonFiniteError) as caught:
            trainer.fit(model, *loaders())
        assert (caught.value.phase, caught.value.batch_number) == ("eval", 1)
        assert caught.value.report.startswith("Detected inf/nan during eval_batch_number=1\n")
        assert callback.state_dict()["batch_number"] == 0
        assert (tmp_path / "nanwatch-report-eval-rank0-batch1.txt").is_file()
    assert hook_count(model) == 0


def test_watched_validation_is_counted_apart(tmp_path: Path) -> None:
    callback = OverflowCallback(watch_eval=True)
    make_trainer(tmp_path, [callback]).fit(InjectingModule(), *loaders())
    # 2 sanity-check batches, then 2 validation batches after each of the 2 epochs; 4 training micro-batches.
    assert callback.state_dict()["eval_batch_number"] == 6
    assert callback.state_dict()["batch_number"] == 4


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_stand_alone_evaluation_is_watched_only_when_asked(tmp_path: Path, stage: str) -> None:
    _, val = loaders()
    model = InjectingModule(inject_eval_at=1)
    getattr(make_trainer(tmp_path, [OverflowCallback()]), stage)(model, val)  # not watched: no error
    assert model.blowup.eval_count == 2

    model = InjectingModule(inject_eval_at=1)
    callback = OverflowCallback(watch_eval=True)
    with pytest.raises(NonFiniteError) as caught:
        getattr(make_trainer(tmp_path, [callback]), stage)(model, val)
    assert (caught.value.phase, caught.value.batch_number, caught.value.module_name) == ("eval", 1, "blowup")
    assert hook_count(model) == 0
    assert callback.watcher is None


def test_resume_from_a_checkpoint_keeps_counting(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    first = make_trainer(tmp_path, [OverflowCallback(), checkpoints], max_epochs=2, enable_checkpointing=True)
    first.fit(InjectingModule(), *loaders())
    after_epoch_0 = tmp_path / "ckpt" / "epoch=0-step=1.ckpt"
    saved = torch.load(after_epoch_0, weights_only=False)["callbacks"]["OverflowCallback"]
    assert saved["batch_number"] == 2

    # A fresh module and callback; the module's own count says its second micro-batch goes bad: global batch 3.
    model = InjectingModule(inject_at=1)
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    second = make_trainer(tmp_path, [OverflowCallback(), again], max_epochs=2, enable_checkpointing=True)
    with pytest.raises(NonFiniteError) as caught:
        second.fit(model, *loaders(), ckpt_path=after_epoch_0)

    assert (caught.value.batch_number, caught.value.optimizer_step, caught.value.epoch) == (3, 1, 1)
    assert model.blowup.count == 2
    assert hook_count(model) == 0


def test_abort_after_batch_num_stops_the_run_cleanly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = InjectingModule()
    callback = OverflowCallback(abort_after_batch_num=2)
    trainer = make_trainer(tmp_path, [callback], max_epochs=5)
    nanwatch_logger = logging.getLogger("nanwatch")  # it does not propagate to the root logger caplog listens on
    nanwatch_logger.addHandler(caplog.handler)
    nanwatch_logger.setLevel(logging.INFO)  # with only caplog's handler, get_logger() sets no level (conftest restores)
    try:
        trainer.fit(model, *loaders())  # returns normally, as with EarlyStopping
    finally:
        nanwatch_logger.removeHandler(caplog.handler)

    assert trainer.should_stop
    assert model.blowup.count == 3, "micro-batches 0, 1 and 2 ran, then the run stopped"
    assert callback.state_dict()["batch_number"] == 3
    assert "stopping after batch_number=2 as asked by abort_after_batch_num=2" in caplog.text
    assert hook_count(model) == 0


def test_the_users_own_exception_goes_through_and_the_last_batch_is_reported(tmp_path: Path) -> None:
    # The module raises on a non-finite loss before backward, so nanwatch's agreement point never runs.
    model = InjectingModule(inject_at=1, raise_on_nan=True)
    trainer = make_trainer(tmp_path, [OverflowCallback(report_dir=tmp_path / "reports")])

    with pytest.raises(RuntimeError, match="the user's own check") as caught:
        trainer.fit(model, *loaders())

    assert not isinstance(caught.value, NonFiniteError)
    assert (tmp_path / "reports" / "nanwatch-report-rank0-batch1.txt").is_file()
    assert hook_count(model) == 0


def test_config_forms(tmp_path: Path) -> None:
    path = tmp_path / "trace.yaml"
    path.write_text("max_frames_to_save: 7\ntrace_batch_nums: [1, 2]\n", encoding="utf-8")
    assert OverflowCallback(path).config.max_frames_to_save == 7
    assert OverflowCallback(str(path), max_frames_to_save=50).config.max_frames_to_save == 50
    assert OverflowCallback({"watch_eval": True}).config.watch_eval
    assert OverflowCallback(WatchConfig(max_frames_to_save=3)).config.max_frames_to_save == 3
    assert OverflowCallback().config == WatchConfig()
    with pytest.raises(ConfigError, match="max_frame_to_save"):
        OverflowCallback(max_frame_to_save=3)


@pytest.mark.slow
def test_lightning_is_imported_only_when_used_and_its_absence_is_explained() -> None:
    code = """
import sys
import nanwatch
assert "lightning" not in sys.modules, "import nanwatch imported lightning"
sys.modules["lightning"] = None  # as if it were not installed
sys.modules["lightning.pytorch"] = None
from nanwatch.adapters.lightning import OverflowCallback
try:
    OverflowCallback()
except ImportError as error:
    assert isinstance(error.__cause__, ImportError), error.__cause__
    print(error)
else:
    raise SystemExit("no ImportError")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "OverflowCallback" in done.stdout
    assert "`lightning`" in done.stdout
    assert 'pip install "nanwatch[lightning]"' in done.stdout


def _run_bounded(command: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run `command` in its own process group; kill the whole group (Lightning's children too) on timeout."""
    with log.open("w", encoding="utf-8") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"{command} still running after {timeout} s:\n{log.read_text(encoding='utf-8')[-3000:]}")
    return code, time.time()


@pytest.mark.multiprocess
def test_ddp_rank_1_detects_and_every_rank_stops(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    script = str(SCRIPTS / "lightning_run.py")
    code, rank0_exited = _run_bounded([sys.executable, script, "--out", str(out)], tmp_path / "log.txt", 150)
    log = (tmp_path / "log.txt").read_text(encoding="utf-8")

    records = {rank: json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)}
    children = json.loads((out / "children.json").read_text(encoding="utf-8"))
    assert code != 0, log[-3000:]
    assert children["exit_codes"] == [1], log[-3000:]
    detected = min(record["raised_at"] for record in records.values())
    assert max(rank0_exited, children["at"]) - detected < 60
    for record in records.values():
        assert record["error"] == "NonFiniteError"
        assert (record["batch_number"], record["rank"], record["optimizer_step"], record["epoch"]) == (3, 1, 1, 1)
        assert record["global_step"] == 1
        assert record["weights_unchanged"]
        assert record["hooks_left"] == 0
    assert records[1]["module_name"] == "blowup"
    assert records[1]["report"].startswith("Detected inf/nan during batch_number=3 on rank 1\n")
    assert records[0]["report"] == ""
    # Only the detecting rank writes a report (text, JSON and whatever other forms the core writes).
    # Rank 1's report, and the capsule of its culprit's call.
    written = {path.name.split(".")[0] for path in (out / "reports").iterdir()}
    assert written == {"nanwatch-report-rank1-batch3", "nanwatch-capsule-rank1-batch3"}
    assert (out / "reports" / "nanwatch-report-rank1-batch3.json").is_file()
    text = (out / "reports" / "nanwatch-report-rank1-batch3.txt").read_text(encoding="utf-8")
    assert text.rstrip("\n") == records[1]["report"]
    assert "Detected inf/nan during batch_number=3 on rank 1" in log


@pytest.mark.slow
def test_example_overflows_in_float16_and_shows_the_report(tmp_path: Path) -> None:
    example = REPO / "examples" / "lightning_fp16.py"
    command = [sys.executable, str(example), "--report-dir", str(tmp_path), "--max-frames-to-save", "9"]
    code, _ = _run_bounded(command, tmp_path / "log.txt", 120)
    output = (tmp_path / "log.txt").read_text(encoding="utf-8")

    assert code == 1, output[-3000:]
    assert "Detected inf/nan during batch_number=12\nLast 9 forward frames:" in output
    assert (
        "stopped: inf/nan in batch_number=12 (optimizer step 6, epoch 3) on rank 0, first in module 'loss_fn'" in output
    )
    assert "weights still finite: True" in output
    report = json.loads((tmp_path / "nanwatch-report-rank0-batch12.json").read_text(encoding="utf-8"))
    last = report["frames"][-1]
    assert (last["module"], last["entries"][-1]["label"], last["entries"][-1]["abs_max"]) == (
        "loss_fn",
        "output",
        "inf",
    )
    assert {entry["dtype"] for frame in report["frames"] for entry in frame["entries"]} == {"float16"}
