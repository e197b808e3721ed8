"""The checkpoint guard in every adapter, with the real frameworks: a checkpoint whose weights an optimizer update
overflowed is refused before it is written (no framework rotates the last good one out), the error and every later
report name the last checkpoint verified finite, and "quarantine" writes the refused one aside."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.adapters.long_runs import (
    FRAMEWORK_NOISE,
    batches,
    lightning_regressor,
    lightning_trainer,
    same,
    snapshot,
)
from tests.models import OverflowingSGD, small_mlp
from torch import nn

from nanwatch import NonFiniteCheckpoint, NonFiniteError, watch
from nanwatch.core.stats.finite import non_finite_tensors

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

pytestmark = FRAMEWORK_NOISE


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


# ------------------------------------------------------------------------------------------ the check itself


def test_the_fused_check_names_each_non_finite_tensor_and_counts_the_rest() -> None:
    model = small_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert non_finite_tensors(_state(model, optimizer)) == ([], 4 + 4 * 2 + 4)  # weights, Adam's moments, its steps

    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
        model[3].bias.fill_(math.inf)
    optimizer.state[model[0].bias]["exp_avg"][1] = -math.inf
    bad, checked = non_finite_tensors(_state(model, optimizer))
    assert bad == [("model.0.weight", "nan"), ("model.3.bias", "inf"), ("optimizer.state.1.exp_avg", "inf")]
    assert checked == 16


def test_integers_empty_tensors_and_other_values_are_not_in_the_way() -> None:
    state = {
        "ids": torch.tensor([1, 2]),
        "empty": torch.empty(0),
        "epoch": 3,
        "name": "x",
        "half": torch.ones(2).half(),
    }
    assert non_finite_tensors(state) == ([], 1)
    assert non_finite_tensors({"half": torch.tensor([65504.0]).half() * 2}) == ([("half", "inf")], 1)


# ------------------------------------------------------------------------------------------- the plain loop


def _plain_run(tmp_path: Path, **config: Any) -> tuple[NonFiniteCheckpoint, list[Path]]:
    model = small_mlp()
    optimizer = OverflowingSGD(model.parameters(), at=3)
    paths = []
    with watch(model, optimizer=optimizer, **config) as handle:
        for step, (x, y) in enumerate(batches(5), start=1):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            handle.step()
            paths.append(tmp_path / f"ckpt-{step}.pt")
            try:
                handle.save_checkpoint(_state(model, optimizer), paths[-1])
            except NonFiniteCheckpoint as error:
                return error, paths
    raise AssertionError("the poisoned checkpoint was written")


def test_plain_a_poisoned_checkpoint_is_refused_and_the_last_good_one_named(tmp_path: Path) -> None:
    error, paths = _plain_run(tmp_path)

    assert len(paths) == 3
    assert paths[0].exists()
    assert paths[1].exists()
    assert not paths[2].exists()
    assert not Path(f"{paths[2]}.nonfinite").exists()
    assert error.path == str(paths[2])
    assert error.last_good == (str(paths[1]), 2)
    assert error.quarantine_path is None
    assert ("model.0.weight", "inf") in error.non_finite or ("model.0.weight", "nan") in error.non_finite
    assert f"'{paths[1]}' (optimizer step 2): resume from there" in str(error)
    assert "not written" in str(error)
    reloaded = torch.load(paths[1], weights_only=True)
    assert non_finite_tensors(reloaded)[0] == []


def test_plain_quarantine_writes_the_refused_checkpoint_aside(tmp_path: Path) -> None:
    error, paths = _plain_run(tmp_path, checkpoint_guard="quarantine")

    aside = tmp_path / "nanwatch-quarantine" / "ckpt-3.pt.nonfinite"  # in a folder of its own, beside the file
    assert error.quarantine_path == str(aside)
    assert aside.exists()
    assert not paths[2].exists()
    assert sorted(path.name for path in tmp_path.glob("*.pt*")) == ["ckpt-1.pt", "ckpt-2.pt"]
    assert non_finite_tensors(torch.load(aside, weights_only=True))[0] != []
    assert "written aside" in str(error)


def test_plain_guard_off_writes_whatever_it_is_given(tmp_path: Path) -> None:
    model = small_mlp()
    with torch.no_grad():
        model[0].weight.fill_(math.nan)
    with watch(model, checkpoint_guard="off") as handle:
        handle.save_checkpoint(model.state_dict(), tmp_path / "nan.pt")
    assert (tmp_path / "nan.pt").exists()


def test_plain_every_later_report_names_the_last_good_checkpoint(tmp_path: Path) -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    good = tmp_path / "good.pt"

    def train() -> None:
        with watch(model, optimizer=optimizer, report_dir=tmp_path) as handle:
            for index, (x, y) in enumerate(batches(4)):
                if index == 2:
                    model[2].factor = math.inf
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                handle.step()
                handle.save_checkpoint(_state(model, optimizer), good)

    with pytest.raises(NonFiniteError) as caught:
        train()
    line = f"Last checkpoint verified finite: '{good}' (optimizer step 2): resume from there."
    assert line in caught.value.report
    assert line in (tmp_path / "nanwatch-report-rank0-batch2.txt").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------- Lightning


def test_lightning_refuses_the_poisoned_checkpoint_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nanwatch.adapters.lightning import OverflowCallback

    directory = tmp_path / "checkpoints"
    # save_top_k=1 without a monitor keeps only the latest checkpoint: Lightning deletes the one before as it saves.
    keep_latest = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1)
    trainer = lightning_trainer(6, [OverflowCallback(), keep_latest], checkpointing=True)
    with pytest.raises(NonFiniteCheckpoint) as caught:
        trainer.fit(
            lightning_regressor(lambda params: OverflowingSGD(params, at=3), lambda _: 1.0),
            torch.utils.data.DataLoader(batches(6), batch_size=None),
        )

    error = caught.value
    assert [path.name for path in directory.iterdir()] == ["epoch=0-step=2.ckpt"], "the last good one was kept"
    assert Path(error.path).name == "epoch=0-step=3.ckpt"
    assert error.last_good is not None
    assert (Path(error.last_good[0]).name, error.last_good[1]) == ("epoch=0-step=2.ckpt", 2)
    assert any(where.startswith("state_dict.net.0.") for where, _ in error.non_finite)
    assert not hasattr(trainer.strategy, "__dict__") or "save_checkpoint" not in trainer.strategy.__dict__


# ---------------------------------------------------------------------------------------------- Accelerate


def _accelerate_quarantine(
    tmp_path: Path, make: Callable[[], nn.Module], *, total_limit: int
) -> tuple[Any, Any, Any, Any]:
    """A tracker whose guard quarantines, the Accelerator it watches (automatic checkpoint naming, `total_limit`), the
    prepared model (`make()`) and an SGD that writes nan into the weights at its third step."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from nanwatch.adapters.accelerate import OverflowTracker

    tracker = OverflowTracker(checkpoint_guard="quarantine")
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=total_limit)
    accelerator = Accelerator(cpu=True, log_with=[tracker], project_config=project)
    model = make()
    model, optimizer = accelerator.prepare(model, OverflowingSGD(model.parameters(), at=3))
    tracker.attach(accelerator, model)
    return tracker, accelerator, model, optimizer


def test_accelerate_save_state_refuses_before_rotating_anything(tmp_path: Path) -> None:
    # Automatic naming with a limit of one: save_state deletes the older checkpoint before it writes a new one.
    tracker, accelerator, model, optimizer = _accelerate_quarantine(tmp_path, small_mlp, total_limit=1)
    saved = tmp_path / "checkpoints"

    def train() -> None:
        for x, y in batches(5):
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            accelerator.save_state()

    with pytest.raises(NonFiniteCheckpoint) as caught:
        train()
    tracker.detach()

    error = caught.value
    assert sorted(path.name for path in saved.iterdir()) == ["checkpoint_1"]
    assert Path(error.path).name == "checkpoint_2"
    assert error.last_good is not None
    assert Path(error.last_good[0]).name == "checkpoint_1"
    assert error.quarantine_path == str(tmp_path / "nanwatch-quarantine" / "checkpoint_2.nonfinite")
    assert any(where.startswith("models[0].") for where, _ in error.non_finite)
    assert "save_state" not in accelerator.__dict__, "detach() put save_state back"


# ------------------------------------------------------------------------------------------ the HF Trainer


def test_hf_trainer_refuses_the_poisoned_checkpoint_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from blowup_models import SumDataset, TinyRegressor
    from transformers import Trainer, TrainingArguments

    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    torch.manual_seed(0)
    model = TinyRegressor()
    optimizer = OverflowingSGD(model.parameters(), at=3)
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=6,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,  # the Trainer deletes the older checkpoint after writing a new one
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = OverflowTrainerCallback()
    trainer = Trainer(
        model=model, args=arguments, train_dataset=SumDataset(), callbacks=[callback], optimizers=(optimizer, None)
    )
    with pytest.raises(NonFiniteCheckpoint) as caught:
        trainer.train()

    error = caught.value
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("checkpoint")) == ["checkpoint-2"]
    assert Path(error.path).name == "checkpoint-3"
    assert error.last_good == (str(tmp_path / "checkpoint-2"), 2)
    assert any(where.startswith("model.") for where, _ in error.non_finite)
    assert callback.watcher is None, "the hooks went before the error left the Trainer"


def test_plain_quarantine_on_a_full_disk_still_refuses_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = small_mlp()
    with torch.no_grad():
        model[0].weight.fill_(math.nan)

    def full_disk(state: Any, path: Any) -> None:
        raise OSError(28, "No space left on device")

    with watch(model, checkpoint_guard="quarantine") as handle:
        monkeypatch.setattr(torch, "save", full_disk)
        with pytest.raises(NonFiniteCheckpoint) as caught:
            handle.save_checkpoint(model.state_dict(), tmp_path / "nan.pt")
        monkeypatch.undo()
        assert handle.watcher.disabled_reason is None
    assert caught.value.quarantine_path is None
    assert "not written (writing it aside failed: OSError(28, 'No space left on device'))" in str(caught.value)
    assert not (tmp_path / "nan.pt").exists()


# ------------------------------------------------------------------------- buffers that hold inf by design


class ScalarCausalMix(nn.Module):
    """Attention over the 4 features of a row (a sequence of 4 scalars) under an additive causal mask kept as a
    buffer, -inf above the diagonal, as GPT-style models register it in `__init__`; its output is finite."""

    def __init__(self, length: int = 4) -> None:
        super().__init__()
        self.register_buffer("mask", torch.full((length, length), -math.inf).triu(1))
        self.register_buffer("scale", torch.ones(length))  # finite, as most buffers are

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x * self.scale).unsqueeze(-1)
        return ((h @ h.transpose(-1, -2) + self.mask).softmax(-1) @ h).squeeze(-1)


def masked_mlp() -> nn.Sequential:
    """`ScalarCausalMix` (its mask `0.mask`) -> Linear(4, 8) -> ReLU -> Linear(8, 1), built after
    `torch.manual_seed(0)`."""
    torch.manual_seed(0)
    return nn.Sequential(ScalarCausalMix(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, handle: Any) -> None:
    x, y = batches(1)[0]
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    handle.step()


def test_a_mask_is_told_apart_under_a_framework_prefix_and_when_modules_share_it() -> None:
    from nanwatch.core.features.buffer_masks import BufferMasks

    model = nn.Module()
    model.sub = ScalarCausalMix()
    model.other = ScalarCausalMix()
    model.other.mask = model.sub.mask  # one mask for every layer, as some models share it
    model.register_buffer("mask", torch.zeros(4, 4))  # finite, of a mask's shape, and a suffix of "sub.mask"
    masks = BufferMasks()
    masks.learn(model)
    known = masks.known(model)
    copies = {name: value.clone() for name, value in model.state_dict().items()}

    lightning = {"state_dict": {f"model.{name}": value for name, value in copies.items()}}
    ddp = {"models": [{f"module.{name}": value for name, value in copies.items()}]}
    assert non_finite_tensors(lightning, known) == ([], 5)
    assert non_finite_tensors(ddp, known) == ([], 5)
    copies["mask"].copy_(copies["sub.mask"])  # the same pattern as the masks, in the buffer that was finite
    copies["other.mask"][3, 0] = math.nan
    assert non_finite_tensors(lightning, known) == (
        [("state_dict.model.mask", "inf"), ("state_dict.model.other.mask", "nan")],
        5,
    )


def test_a_mask_every_layer_shares_is_kept_once() -> None:
    from nanwatch.core.features.buffer_masks import BufferMasks

    model = nn.Module()
    model.layers = nn.ModuleList([ScalarCausalMix() for _ in range(3)])
    for layer in model.layers[1:]:
        layer.mask = model.layers[0].mask
    masks = BufferMasks()
    masks.learn(model)
    kept = {id(mask.kinds) for mask in masks._masks.values()}
    assert set(masks._masks) == {f"layers.{index}.mask" for index in range(3)}
    assert len(kept) == 1  # one pattern for the one storage, not one per name


def test_plain_a_float8_buffer_neither_stops_watching_nor_is_refused_for_its_mask(tmp_path: Path) -> None:
    # float8 has no elementwise kernels for the finiteness test on the CPU: the buffers are read in float32.
    model = small_mlp()
    model.register_buffer("mask8", torch.full((4, 4), -math.inf).triu(1).to(torch.float8_e5m2))
    model.register_buffer("scale8", torch.ones(4).to(torch.float8_e4m3fn))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        _train_one_step(model, optimizer, handle)
        handle.save_checkpoint(_state(model, optimizer), tmp_path / "good.pt")
        assert handle.watcher is not None
        assert handle.watcher.disabled_reason is None
        model.scale8[1] = math.nan
        with pytest.raises(NonFiniteCheckpoint) as caught:
            handle.save_checkpoint(_state(model, optimizer), tmp_path / "bad.pt")
    assert (tmp_path / "good.pt").exists()
    assert caught.value.non_finite == [("model.scale8", "nan")]


def test_plain_a_mask_buffer_is_saved_and_only_new_inf_or_nan_in_a_buffer_refused(tmp_path: Path) -> None:
    model = masked_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    mask = model[0].mask
    with watch(model, optimizer=optimizer) as handle:
        _train_one_step(model, optimizer, handle)
        handle.save_checkpoint(_state(model, optimizer), tmp_path / "good.pt")  # the mask as it was: not poison
        assert (tmp_path / "good.pt").exists()

        refused = []
        for where, value in (((0, 1), math.nan), ((1, 0), -math.inf), ((2, 3), math.inf)):
            kept = mask[where].clone()
            mask[where] = value  # nan where -inf was, -inf where 0 was, +inf where -inf was
            with pytest.raises(NonFiniteCheckpoint) as caught:
                handle.save_checkpoint(_state(model, optimizer), tmp_path / "bad.pt")
            refused.append(caught.value.non_finite)
            mask[where] = kept
        model[0].scale[2] = math.inf  # finite when watching began
        with pytest.raises(NonFiniteCheckpoint) as caught:
            handle.save_checkpoint(_state(model, optimizer), tmp_path / "bad.pt")
    assert refused == [[("model.0.mask", "nan")], [("model.0.mask", "inf")], [("model.0.mask", "inf")]]
    assert caught.value.non_finite == [("model.0.scale", "inf")]
    assert caught.value.last_good == (str(tmp_path / "good.pt"), 1)
    assert not (tmp_path / "bad.pt").exists()


def test_plain_a_mask_is_known_in_a_copy_under_another_name_and_added_later(tmp_path: Path) -> None:
    model = masked_mlp()
    with watch(model) as handle:
        model.register_buffer("late", torch.tensor([-math.inf, 1.0]))  # after watching began: seen at the first save
        copied = {"weights": {name: value.clone() for name, value in model.state_dict().items()}}
        handle.save_checkpoint(copied, tmp_path / "copy.pt")  # another storage: known by its name, "0.mask"
        handle.save_checkpoint({"causal": model[0].mask}, tmp_path / "renamed.pt")  # its own storage, another name
        model.late[1] = math.nan
        with pytest.raises(NonFiniteCheckpoint) as caught:
            handle.save_checkpoint(model.state_dict(), tmp_path / "bad.pt")
        with pytest.raises(NonFiniteCheckpoint):  # a copy under another name is no buffer of the model's
            handle.save_checkpoint({"causal": model[0].mask.clone()}, tmp_path / "bad.pt")
    assert caught.value.non_finite == [("late", "nan")]
    assert (tmp_path / "copy.pt").exists()
    assert (tmp_path / "renamed.pt").exists()


def test_lightning_fit_with_a_mask_buffer_trains_through_its_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nanwatch.adapters.lightning import OverflowCallback

    class Masked(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = masked_mlp()  # its mask: "state_dict.model.0.mask" in Lightning's checkpoint

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    directory = tmp_path / "checkpoints"
    every_step = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)
    trainer = lightning_trainer(3, [OverflowCallback(), every_step], checkpointing=True)
    trainer.fit(Masked(), torch.utils.data.DataLoader(batches(3), batch_size=None))

    assert trainer.global_step == 3
    assert sorted(path.name for path in directory.iterdir()) == [f"epoch=0-step={n}.ckpt" for n in (1, 2, 3)]
    saved = torch.load(directory / "epoch=0-step=3.ckpt", weights_only=True)["state_dict"]["model.0.mask"]
    assert torch.equal(saved, torch.full((4, 4), -math.inf).triu(1))


def test_lightning_quarantine_writes_beside_the_checkpoint_folder(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nanwatch.adapters.lightning import OverflowCallback

    directory = tmp_path / "checkpoints"
    every_step = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)
    trainer = lightning_trainer(6, [OverflowCallback(checkpoint_guard="quarantine"), every_step], checkpointing=True)
    with pytest.raises(NonFiniteCheckpoint) as caught:
        trainer.fit(
            lightning_regressor(lambda params: OverflowingSGD(params, at=3), lambda _: 1.0),
            torch.utils.data.DataLoader(batches(6), batch_size=None),
        )

    aside = tmp_path / "nanwatch-quarantine" / "epoch=0-step=3.ckpt.nonfinite"
    assert caught.value.quarantine_path == str(aside)
    assert f"written aside as '{aside}'" in str(caught.value)
    assert sorted(path.name for path in directory.iterdir()) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert non_finite_tensors(torch.load(aside, weights_only=False)["state_dict"])[0] != []


@pytest.mark.parametrize("make", [small_mlp, masked_mlp], ids=["weights", "weights-and-a-mask"])
def test_accelerate_quarantine_leaves_the_checkpoints_folder_to_accelerate(
    tmp_path: Path, make: Callable[[], nn.Module]
) -> None:
    tracker, accelerator, model, optimizer = _accelerate_quarantine(tmp_path, make, total_limit=2)
    saved = tmp_path / "checkpoints"

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        accelerator.save_state()

    data = batches(5)
    step(*data[0])
    step(*data[1])
    good = snapshot(model)
    with pytest.raises(NonFiniteCheckpoint) as caught:
        step(*data[2])  # the third step overflows the weights: checkpoint_2 is refused

    accelerator.load_state()  # automatic naming: the latest entry of checkpoints/, which is the last good one
    assert same(snapshot(model), good)
    step(*data[3])  # checkpoint_2 again, finite now; total_limit=2 rotates checkpoint_0 out, nothing else
    tracker.detach()
    assert sorted(path.name for path in saved.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    aside = tmp_path / "nanwatch-quarantine" / "checkpoint_2.nonfinite"
    assert caught.value.quarantine_path == str(aside)
    assert non_finite_tensors(torch.load(aside, weights_only=True))[0] != []


def test_hf_trainer_a_mask_buffer_trains_through_and_quarantine_is_out_of_the_rotation(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from blowup_models import SumDataset
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    class MaskedRegressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = masked_mlp()

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            logits = self.net(x)
            return {"logits": logits, "loss": nn.functional.mse_loss(logits, labels)} if labels is not None else {}

    model = MaskedRegressor()
    optimizer = OverflowingSGD(model.parameters(), at=3)
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=6,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = OverflowTrainerCallback(checkpoint_guard="quarantine")
    trainer = Trainer(
        model=model, args=arguments, train_dataset=SumDataset(), callbacks=[callback], optimizers=(optimizer, None)
    )
    with pytest.raises(NonFiniteCheckpoint) as caught:
        trainer.train()

    aside = tmp_path / "nanwatch-quarantine" / "checkpoint-3.nonfinite"
    assert caught.value.quarantine_path == str(aside)
    assert aside.exists()
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
