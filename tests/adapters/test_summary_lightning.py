"""Summary mode and scope with a real Lightning `Trainer`: the abs max per module reaches the Trainer's loggers."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from nanwatch import NonFiniteError  # noqa: E402
from nanwatch.adapters.lightning import OverflowCallback  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from lightning_run import InjectingModule, hook_count, loaders, make_trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*isinstance\\(treespec, LeafSpec\\).*",
    "ignore:.*smaller than the logging interval.*",
)

MODULES = ["act", "blowup", "inp", "out"]


def test_the_summary_reaches_a_csv_logger(tmp_path: Path) -> None:
    # 2 epochs of 2 micro-batches, 2 per optimizer step: a summary after every 2nd micro-batch, i.e. every step.
    logger = CSVLogger(tmp_path, name="run")
    callback = OverflowCallback(summary_every_n_batches=2)
    model = InjectingModule()
    trainer = make_trainer(tmp_path, [callback], logger=logger)
    trainer.fit(model, *loaders())

    with open(Path(logger.log_dir) / "metrics.csv", newline="", encoding="utf-8") as file:
        rows = [row for row in csv.DictReader(file) if row.get("nanwatch/batch_number")]
    assert [(row["step"], row["nanwatch/batch_number"]) for row in rows] == [("1", "1.0"), ("2", "3.0")]
    for row in rows:
        per_module = {name: float(row[f"nanwatch/absmax/{name}"]) for name in MODULES}
        assert all(value > 0 for value in per_module.values())
        # The global is the largest of every summarised frame's, the loss's own frame `(loss)` included.
        every = {key: float(value) for key, value in row.items() if key.startswith("nanwatch/absmax/") and value}
        assert set(every) <= {f"nanwatch/absmax/{name}" for name in [*MODULES, "(loss)"]}
        assert float(row["nanwatch/absmax_global"]) == max(every.values())
        # The ReLU passes the largest positive value through; its abs max cannot exceed its input's (inp's output).
        assert per_module["act"] <= per_module["inp"]
    assert "nanwatch/absmax/(root)" not in rows[0]  # the LightningModule itself is never hooked
    assert hook_count(model) == 0


def test_without_a_logger_the_summary_goes_to_the_nanwatch_logger(
    tmp_path: Path, nanwatch_log: pytest.LogCaptureFixture
) -> None:
    trainer = make_trainer(tmp_path, [OverflowCallback(summary_every_n_batches=4)], logger=False)
    trainer.fit(InjectingModule(), *loaders())
    summaries = [r.getMessage() for r in nanwatch_log.records if r.getMessage().startswith("nanwatch summary")]
    assert len(summaries) == 1
    assert summaries[0].startswith("nanwatch summary of batch_number=3: largest abs max ")


def test_scope_globs_apply_to_the_lightning_modules_names(tmp_path: Path) -> None:
    hooked: list[set[str]] = []
    recorded: list[set[str]] = []

    class Probe(OverflowCallback):
        def on_train_start(self, trainer: object, pl_module: torch.nn.Module) -> None:
            hooked.append({name for name, m in pl_module.named_modules() if m._forward_hooks})
            # The hooks that record frames; the others are always called: the cause feature's, which keep the
            # micro-batch's forward calls on the LightningModule and its direct children (its training_step calls
            # them), whatever the scope.
            recorded.append(
                {
                    name
                    for name, m in pl_module.named_modules()
                    if set(m._forward_hooks) - set(m._forward_hooks_always_called)
                }
            )

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            assert self.watcher is not None
            framed.update(frame.module_name for frame in self.watcher.recent_frames())
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    framed: set[str] = set()
    trainer = make_trainer(tmp_path, [Probe(include_modules=["*"], exclude_modules=["act", "blowup"])], max_epochs=1)
    trainer.fit(InjectingModule(), *loaders())
    assert recorded == [{"inp", "out"}]
    # The cause feature keeps the forward calls of a LightningModule's children (its training_step calls them), not of
    # the LightningModule itself.
    assert hooked == [{"act", "blowup", "inp", "out"}]
    assert framed == {"inp", "out", "(loss)"}  # the cause feature's hooks add no frame


def test_a_glob_matching_nothing_stops_fit_before_training(tmp_path: Path) -> None:
    model = InjectingModule()
    trainer = make_trainer(tmp_path, [OverflowCallback(include_modules=["encoder.*"])])
    with pytest.raises(ValueError, match="include_modules: the pattern 'encoder.\\*' matches none"):
        trainer.fit(model, *loaders())
    assert trainer.global_step == 0
    assert hook_count(model) == 0


def test_an_unwatched_micro_batch_is_not_recorded_but_its_step_is_guarded(tmp_path: Path) -> None:
    # Micro-batch 1 goes inf but is not watched: no frame of it is recorded, but the guard reads the gradients
    # before every optimizer step, watched or not, so step 1 never runs.
    model = InjectingModule(inject_at=1)
    callback = OverflowCallback(watch_every_n_batches=2)
    trainer = make_trainer(tmp_path, [callback], accumulate_grad_batches=1)
    with pytest.raises(NonFiniteError) as caught:
        trainer.fit(model, *loaders())
    assert caught.value.batch_number == 1
    assert caught.value.module_name == "inp"  # the first parameter whose gradient is not finite
    assert "non-finite gradients about to be applied by optimizer step 1" in caught.value.report
    assert trainer.global_step == 1
