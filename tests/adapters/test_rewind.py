"""`on_detect="rewind"` with the real frameworks: a detection puts the last checkpoint nanwatch certified back in
place (the model's and the optimizer's state right after the rewind are the checkpoint's, byte for byte), the step
of the bad micro-batch is left out, and the run goes on; past `max_rewinds`, with no certified checkpoint yet, or when
a restore fails, the run stops with `NonFiniteError` saying which; a checkpoint a rewind could not restore in full is
refused as it is saved; every DDP rank rewinds to the same checkpoint."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.adapters.long_runs import FRAMEWORK_NOISE, batches, lightning_trainer
from tests.models import small_mlp
from torch import nn

from nanwatch import ConfigError, NonFiniteError, WatchConfig, watch
from nanwatch.core.rewinds import Rewind

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from rewind_ddp_run import same_state  # noqa: E402  (the scripts' folder is on the path only from here)

pytestmark = FRAMEWORK_NOISE


def _rewind_list(report_dir: Path) -> list[dict[str, Any]]:
    lines = (report_dir / "rewinds.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


# ------------------------------------------------------------------------------------------- the plain loop


def _plain_run(
    folder: Path, inf_at: set[int], *, count: int = 10, save_every: int = 3, whole: bool = False, **config: Any
) -> dict[str, Any]:
    """A plain loop (Adam, a StepLR given to watch()) saving through the handle after every `save_every` steps, with
    the loop's own epoch beside the parts; the Scale module multiplies by inf in the micro-batches `inf_at`. What the
    state is right after each rewinding step is kept."""
    model = small_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    after: dict[int, dict[str, Any]] = {}
    config = {"on_detect": "rewind", "report_dir": folder / "reports", **config}
    with watch(model, optimizer=optimizer, scheduler=scheduler, **config) as handle:
        for index, (x, y) in enumerate(batches(count)):
            model[2].factor = math.inf if index in inf_at else 1.0
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            rewinds = len(handle.rewinds)
            optimizer.step()
            if len(handle.rewinds) > rewinds:  # right after the rewind, before the loop's scheduler steps
                after[index] = {
                    "model": {name: value.clone() for name, value in model.state_dict().items()},
                    "optimizer": copy.deepcopy(optimizer.state_dict()),
                    "scheduler": copy.deepcopy(scheduler.state_dict()),
                }
            scheduler.step()
            handle.step()
            if index % save_every == save_every - 1:
                parts = (model, optimizer) if whole else (model.state_dict(), optimizer.state_dict())
                state = {"model": parts[0], "optimizer": parts[1], "scheduler": scheduler.state_dict(), "epoch": index}
                handle.save_checkpoint(state, folder / f"checkpoint-{index + 1}.pt")
        rewinds = handle.rewinds
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return {"after": after, "rewinds": rewinds, "weights": weights, "lr": scheduler.get_last_lr()}


def test_plain_a_bad_micro_batch_rewinds_to_the_last_checkpoint_and_the_run_goes_on(tmp_path: Path) -> None:
    run = _plain_run(tmp_path, inf_at={7})

    path = str(tmp_path / "checkpoint-6.pt")
    assert run["rewinds"] == [Rewind(7, 0, path, 6, ("model", "optimizer", "scheduler"))]
    saved = torch.load(path, weights_only=True)
    after = run["after"][7]
    assert same_state(after["model"], saved["model"]), "the weights right after the rewind are not the checkpoint's"
    assert same_state(after["optimizer"], saved["optimizer"]), "nor the optimizer's state"
    assert same_state(after["scheduler"], saved["scheduler"]), "nor the scheduler's"
    assert after["optimizer"]["state"][0]["step"] == 6, "Adam's step count is the checkpoint's"
    assert all(torch.isfinite(value).all() for value in run["weights"].values()), "the run went on, finite"
    assert run["lr"] == pytest.approx([0.01 * 0.9**9]), "the checkpoint's 6 scheduler steps, then 3 more"
    assert _rewind_list(tmp_path / "reports") == [run["rewinds"][0].to_json()]
    assert (tmp_path / "reports" / "nanwatch-report-rank0-batch7.txt").exists()


def test_plain_parts_saved_whole_are_restored_too(tmp_path: Path) -> None:
    # The model and the optimizer themselves in the checkpoint (pickled whole), not their state dicts.
    run = _plain_run(tmp_path, inf_at={7}, whole=True)

    saved = torch.load(tmp_path / "checkpoint-6.pt", weights_only=False)
    after = run["after"][7]
    assert same_state(after["model"], saved["model"].state_dict())
    assert same_state(after["optimizer"], saved["optimizer"].state_dict())
    assert run["rewinds"][0].restored == ("model", "optimizer", "scheduler")


def test_plain_past_max_rewinds_raises_saying_so(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError) as caught:
        _plain_run(tmp_path, inf_at={4, 8}, max_rewinds=1)

    error = caught.value
    assert error.batch_number == 8
    assert "on_detect='rewind' rewound 1 times already (max_rewinds=1; at batch_number 4)" in str(error)
    assert [entry["batch_number"] for entry in _rewind_list(tmp_path / "reports")] == [4]


def test_plain_max_rewinds_0_raises_at_the_first_detection(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=r"rewound 0 times already \(max_rewinds=0\)"):
        _plain_run(tmp_path, inf_at={4}, max_rewinds=0)


def test_plain_with_no_certified_checkpoint_yet_raises_saying_so(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError) as caught:
        _plain_run(tmp_path, inf_at={1})

    assert caught.value.batch_number == 1
    assert "on_detect='rewind' has no checkpoint to rewind to: none was verified finite and written yet" in str(
        caught.value
    )
    assert not (tmp_path / "reports" / "rewinds.jsonl").exists()


def test_plain_a_checkpoint_that_cannot_be_read_back_stops_the_run(tmp_path: Path) -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batches(1)[0]

    def train() -> None:
        with watch(model, optimizer=optimizer, on_detect="rewind") as handle:
            handle.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            path.unlink()  # gone before the rewind needs it
            model[2].factor = math.inf
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

    path = tmp_path / "checkpoint.pt"
    with pytest.raises(NonFiniteError) as caught:
        train()
    message = str(caught.value)
    assert f"on_detect='rewind' went back to {str(path)!r} (optimizer step 0), and restoring it failed:" in message
    assert "the run stops here rather than go on from half-restored state" in message


def test_plain_save_refuses_a_checkpoint_a_rewind_could_not_restore_in_full(tmp_path: Path) -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    path = tmp_path / "checkpoint.pt"
    with watch(model, optimizer=optimizer, on_detect="rewind") as handle:
        refused = {
            "no optimizer": {"model": model.state_dict()},
            "no model": {"optimizer": optimizer.state_dict()},
            "a scheduler watch() was not given": {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            },
            "not a dict": model.state_dict,
        }
        messages = {}
        for case, state in refused.items():
            with pytest.raises(ConfigError) as caught:
                handle.save_checkpoint(state, path)
            messages[case] = str(caught.value)
            assert not path.exists(), f"{case}: written anyway"
    assert all("\n" not in message for message in messages.values())
    assert "was given no state of the optimizer nanwatch guards" in messages["no optimizer"]
    assert "was given no state of the watched model" in messages["no model"]
    assert messages["a scheduler watch() was not given"] == (
        "nanwatch: on_detect='rewind': handle.save_checkpoint() entry 'scheduler' is an LR scheduler's state, and "
        "watch() was given none to restore it into: pass it, nanwatch.watch(model, optimizer=optimizer, "
        "scheduler=scheduler, on_detect='rewind')"
    )
    assert messages["not a dict"].startswith("nanwatch: on_detect='rewind' restores what handle.save_checkpoint()")


def test_plain_rewind_without_an_optimizer_is_refused_at_watch() -> None:
    with pytest.raises(ConfigError) as caught:
        watch(small_mlp(), on_detect="rewind")
    assert str(caught.value) == (
        "nanwatch: on_detect='rewind' rewinds at the optimizer step of a micro-batch that holds inf/nan, and watch() "
        "has no optimizer whose steps it can skip: pass it, nanwatch.watch(model, optimizer=optimizer, "
        "on_detect='rewind')"
    )


def test_bad_rewind_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="field 'on_detect': Input should be 'raise', 'skip' or 'rewind'"):
        WatchConfig(on_detect="rewinds")
    for bad in (-1, True, 1.5, "three"):
        with pytest.raises(ConfigError, match="^WatchConfig: field 'max_rewinds': ") as caught:
            WatchConfig(max_rewinds=bad)
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        WatchConfig(on_detect="rewind", checkpoint_guard="off")
    assert str(caught.value) == (
        "WatchConfig: on_detect='rewind' restores the last checkpoint the checkpoint guard verified finite, and "
        "checkpoint_guard='off' verifies none: use checkpoint_guard='refuse' (the default) or 'quarantine'"
    )
    assert WatchConfig(on_detect="rewind").max_rewinds == 3
    with pytest.raises(TypeError, match="^watch\\(\\) needs scheduler= a torch.optim.lr_scheduler.LRScheduler"):
        watch(small_mlp(), optimizer=torch.optim.SGD(small_mlp().parameters(), lr=0.1), scheduler="step")


# ---------------------------------------------------------------------------------------------- Lightning


@pytest.mark.slow
def test_lightning_rewinds_to_its_own_checkpoint_and_finishes(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nanwatch.adapters.lightning import OverflowCallback

    class RewoundRegressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = small_mlp()
            self.after: dict[str, Any] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.net[2].factor = math.inf if batch_idx == 7 else 1.0
            return nn.functional.mse_loss(self.net(x), y)

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            if batch_idx == 7:  # right after the rewind, before Lightning steps the scheduler
                self.after = {
                    "state_dict": {name: value.clone() for name, value in self.state_dict().items()},
                    "optimizer": copy.deepcopy(optimizer.state_dict()),
                }

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module = RewoundRegressor()
    callback = OverflowCallback(on_detect="rewind", report_dir=tmp_path / "reports")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = lightning_trainer(10, [callback, checkpoints], checkpointing=True)
    trainer.fit(module, torch.utils.data.DataLoader(batches(10), batch_size=None))

    path = str(tmp_path / "ckpt" / "epoch=0-step=6.ckpt")
    assert callback.rewinds == [Rewind(7, 0, path, 6, ("state_dict", "optimizer_states", "lr_schedulers"))]
    saved = torch.load(path, weights_only=False)
    assert same_state(module.after["state_dict"], saved["state_dict"])
    assert same_state(module.after["optimizer"], saved["optimizer_states"][0])
    assert trainer.global_step == 10, "the run went on to its end, counting every step"
    assert all(torch.isfinite(value).all() for value in module.state_dict().values())
    assert [entry["batch_number"] for entry in _rewind_list(tmp_path / "reports")] == [7]


# ---------------------------------------------------------------------------------------------- Accelerate


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_rewinds_through_load_state_and_keeps_counting(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from nanwatch.adapters.accelerate import OverflowTracker

    tracker = OverflowTracker(on_detect="rewind", report_dir=tmp_path / "reports")
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    model = small_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(tracker)  # its counters are saved, and not rewound
    tracker.attach(accelerator, model)
    after: dict[str, Any] = {}
    for index, (x, y) in enumerate(batches(10)):
        model[2].factor = math.inf if index == 7 else 1.0
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if index == 7:
            after = {
                "model": {name: value.clone() for name, value in model.state_dict().items()},
                "optimizer": copy.deepcopy(optimizer.state_dict()),
            }
        scheduler.step()
        optimizer.zero_grad()
        if index % 3 == 2:
            accelerator.save_state(str(tmp_path / f"state-{index + 1}"))
    tracker.detach()

    folder = str(tmp_path / "state-6")
    assert tracker.rewinds == [Rewind(7, 0, folder, 6, ("models", "optimizers", "schedulers", "random states"))]
    assert same_state(after["model"], load_file(str(tmp_path / "state-6" / "model.safetensors")))
    assert same_state(after["optimizer"], torch.load(tmp_path / "state-6" / "optimizer.bin", weights_only=True))
    assert tracker.watcher is not None
    assert tracker.watcher.counters.batch_number == 9, "the tracker's counters went on"


@pytest.mark.slow
def test_hf_trainer_refuses_rewind_at_set_up() -> None:
    pytest.importorskip("transformers")
    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    with pytest.raises(ConfigError) as caught:
        OverflowTrainerCallback(on_detect="rewind")
    assert str(caught.value) == (
        "nanwatch: on_detect='rewind' is not available with the transformers Trainer: it loads a checkpoint only when "
        "train(resume_from_checkpoint=...) starts, never in place mid-run. Use on_detect='skip', or resume from the "
        "last checkpoint verified finite, which every report names"
    )


# ------------------------------------------------------------------------------------------- two DDP ranks


@pytest.mark.multiprocess
def test_two_ddp_ranks_rewind_to_the_same_checkpoint_when_only_rank_1_sees_inf(tmp_path: Path) -> None:
    # Rank 0 alone saves (rank 1 learns the checkpoint through the store), and rank 0 sees nothing itself: the inf is
    # in rank 1's diagnostic probe, which never reaches the gradients.
    from torchrun_launch import run_torchrun

    args = ("--out", str(tmp_path), "--inject-at", "5", "--inject-rank", "1")
    result = run_torchrun("rewind_ddp_run.py", *args, timeout=240)

    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    path = str(tmp_path / "checkpoint-4.pt")
    for outcome in outcomes:
        assert outcome["error"] is None
        assert [(r["batch_number"], r["rank"], r["path"], r["optimizer_step"]) for r in outcome["rewinds"]] == [
            (5, 1, path, 4)
        ], "micro-batch 5 on rank 1, rewound to the checkpoint of step 4 on both ranks"
        assert outcome["model_as_saved"], "the weights right after the rewind are not the checkpoint's"
        assert outcome["optimizer_as_saved"], "nor the optimizer's state"
        assert outcome["finite"]
    assert outcomes[0]["weights"] == outcomes[1]["weights"], "the replicas differ"
    assert [entry["batch_number"] for entry in _rewind_list(tmp_path / "reports")] == [5]
    assert "did not reach the vote" not in result.stderr, "no rank waited out rank_wait_s"
