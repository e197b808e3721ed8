"""Resuming through an adapter, with the real frameworks: a finite checkpoint resumes and trains on; one poisoned after
it was saved (a file loaded, one value set to inf, saved again) is refused before the first optimizer step, with the
key path of the poisoned tensor in the message. Lightning's `fit(ckpt_path=...)`, the HF Trainer's
`train(resume_from_checkpoint=...)`, Accelerate's `load_state(folder)`."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.adapters.long_runs import FRAMEWORK_NOISE, batches, lightning_trainer, same, snapshot
from tests.adapters.test_checkpoint_guard import masked_mlp
from tests.models import small_mlp
from torch import nn

from nanwatch import NonFiniteCheckpoint, verify_checkpoint

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

# What Lightning says on resuming inside an epoch with a plain DataLoader, and without the ModelCheckpoint that wrote
# the file: nothing these tests look at.
RESUME_NOISE = pytest.mark.filterwarnings(
    "ignore:.*resuming from a checkpoint that ended before the epoch ended.*",
    "ignore:.*callbacks used to create the checkpoint need to be provided.*",
)
pytestmark = [FRAMEWORK_NOISE, RESUME_NOISE, pytest.mark.slow]


class CountingAdam(torch.optim.Adam):
    """Adam that counts the steps it takes: a refused resume takes none."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.01)
        self.steps_taken = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.steps_taken += 1
        return super().step(closure)


def _poison(path: Path, change: Callable[[Any], None]) -> None:
    """Load the torch file at `path`, let `change` write an inf into it, save it again."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    change(state)
    torch.save(state, path)


# ---------------------------------------------------------------------------------------------------- Lightning


def _lit(make: Callable[[], nn.Module] = small_mlp) -> Any:
    import lightning.pytorch as pl

    class LitAdam(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make()
            self.optimizer: CountingAdam | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            self.optimizer = CountingAdam(self.parameters())
            return self.optimizer

    return LitAdam()


def _lightning_checkpoint(tmp_path: Path, make: Callable[[], nn.Module] = small_mlp) -> Path:
    """Two steps of a fit under the nanwatch callback, saved by a `ModelCheckpoint` (whose own state in the file holds
    an inf on purpose, its `kth_value`): the checkpoint to resume from."""
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nanwatch.adapters.lightning import OverflowCallback

    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = lightning_trainer(2, [OverflowCallback(), saving], checkpointing=True)
    trainer.fit(_lit(make), torch.utils.data.DataLoader(batches(2), batch_size=None))
    return tmp_path / "epoch=0-step=2.ckpt"


def _lightning_resume(path: Path, make: Callable[[], nn.Module] = small_mlp) -> tuple[Any, Any]:
    from nanwatch.adapters.lightning import OverflowCallback

    trainer = lightning_trainer(4, [OverflowCallback()])
    model = _lit(make)
    trainer.fit(model, torch.utils.data.DataLoader(batches(4), batch_size=None), ckpt_path=path)
    return trainer, model


def test_lightning_a_finite_checkpoint_resumes(tmp_path: Path) -> None:
    path = _lightning_checkpoint(tmp_path)
    assert verify_checkpoint(path).tensors == 4 + 4 * 3  # read back alone: the weights and Adam's state
    trainer, model = _lightning_resume(path)
    assert trainer.global_step == 4
    assert model.optimizer.steps_taken == 2
    assert "load_checkpoint" not in vars(trainer.strategy), "the strategy's own load_checkpoint is back"


def test_lightning_a_checkpoint_with_a_mask_buffer_resumes(tmp_path: Path) -> None:
    path = _lightning_checkpoint(tmp_path, masked_mlp)
    trainer, _ = _lightning_resume(path, masked_mlp)
    assert trainer.global_step == 4


def _inf_in_weight(state: Any) -> None:
    state["state_dict"]["net.0.weight"][2, 1] = math.inf


def _inf_in_adam(state: Any) -> None:
    state["optimizer_states"][0]["state"][3]["exp_avg"][0] = math.inf


@pytest.mark.parametrize(
    ("poison", "where"),
    [(_inf_in_weight, "state_dict.net.0.weight"), (_inf_in_adam, "optimizer_states[0].state.3.exp_avg")],
    ids=["weight", "optimizer-state"],
)
def test_lightning_a_poisoned_checkpoint_is_refused_before_the_first_step(
    tmp_path: Path, poison: Callable[[Any], None], where: str
) -> None:
    from nanwatch.adapters.lightning import OverflowCallback

    path = _lightning_checkpoint(tmp_path)
    _poison(path, poison)
    callback = OverflowCallback()
    trainer = lightning_trainer(4, [callback])
    model = _lit()
    fresh = snapshot(model)
    with pytest.raises(NonFiniteCheckpoint) as caught:
        trainer.fit(model, torch.utils.data.DataLoader(batches(4), batch_size=None), ckpt_path=path)

    error = caught.value
    assert error.path == str(path)
    assert error.non_finite == [(where, "inf")]
    assert str(error).startswith(
        f"nanwatch: the checkpoint '{path}' that trainer.fit() resumes from holds inf/nan: {where} inf (1 of "
    )
    assert str(error).endswith("nothing of it was restored, and the run stops before its first step.")
    assert trainer.global_step == 0
    assert model.optimizer is None or model.optimizer.steps_taken == 0
    assert same(snapshot(model), fresh), "nothing of the checkpoint was loaded into the model"
    assert callback.watcher is None
    assert "load_checkpoint" not in vars(trainer.strategy)


def test_lightning_guard_off_checks_no_resume(tmp_path: Path) -> None:
    from nanwatch.adapters.lightning import OverflowCallback

    path = _lightning_checkpoint(tmp_path)
    _poison(path, _inf_in_adam)  # an inf in a moment: the resumed run takes it as it is
    trainer = lightning_trainer(3, [OverflowCallback(checkpoint_guard="off")])
    trainer.fit(_lit(), torch.utils.data.DataLoader(batches(3), batch_size=None), ckpt_path=path)
    assert trainer.global_step == 3


# ---------------------------------------------------------------------------------------------------- HF Trainer


def _hf_trainer(tmp_path: Path, max_steps: int, callback: Any) -> tuple[Any, CountingAdam]:
    pytest.importorskip("transformers")
    from blowup_models import SumDataset, TinyRegressor
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = TinyRegressor()
    optimizer = CountingAdam(model.parameters())
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=arguments, train_dataset=SumDataset(), callbacks=[callback], optimizers=(optimizer, None)
    )
    return trainer, optimizer


def _hf_checkpoint(tmp_path: Path) -> Path:
    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    trainer, _ = _hf_trainer(tmp_path, 2, OverflowTrainerCallback())
    trainer.train()
    return tmp_path / "checkpoint-2"


def test_hf_trainer_a_finite_checkpoint_resumes_and_its_folder_verifies(tmp_path: Path) -> None:
    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    folder = _hf_checkpoint(tmp_path)
    verified = verify_checkpoint(folder)  # the folder as the Trainer wrote it, read back
    assert "model.safetensors" in verified.files
    assert "optimizer.pt" in verified.files
    assert any(skipped.startswith("training_args.bin (") for skipped in verified.skipped)

    trainer, optimizer = _hf_trainer(tmp_path, 4, OverflowTrainerCallback())
    trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.state.global_step == 4
    assert optimizer.steps_taken == 2


def _poison_hf_weight(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["inp.weight"][0, 0] = math.inf
    save_file(tensors, folder / "model.safetensors")


def _poison_hf_adam(folder: Path) -> None:
    def change(state: Any) -> None:
        state["state"][0]["exp_avg"][1, 1] = math.inf

    _poison(folder / "optimizer.pt", change)


@pytest.mark.parametrize(
    ("poison", "where"),
    [(_poison_hf_weight, "model.inp.weight"), (_poison_hf_adam, "optimizer.state.0.exp_avg")],
    ids=["weight", "optimizer-state"],
)
@pytest.mark.parametrize("how", ["folder", "last"])
def test_hf_trainer_a_poisoned_checkpoint_is_refused_before_the_first_step(
    tmp_path: Path, poison: Callable[[Path], None], where: str, how: str
) -> None:
    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    folder = _hf_checkpoint(tmp_path)
    poison(folder)
    callback = OverflowTrainerCallback()
    trainer, optimizer = _hf_trainer(tmp_path, 4, callback)
    with pytest.raises(NonFiniteCheckpoint) as caught:
        trainer.train(resume_from_checkpoint=str(folder) if how == "folder" else True)

    error = caught.value
    assert error.path == str(folder)
    assert error.non_finite == [(where, "inf")]
    assert str(error).startswith(
        f"nanwatch: the model and optimizer state train() resumed at optimizer step 2 (from '{folder}') holds "
        f"inf/nan: {where} inf (1 of "
    )
    assert str(error).endswith("train() stops before its first step.")
    assert optimizer.steps_taken == 0
    assert trainer.state.global_step == 2
    assert callback.watcher is None


def test_hf_trainer_a_mask_buffer_resumes(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from blowup_models import SumDataset
    from transformers import Trainer, TrainingArguments

    from nanwatch.adapters.hf_trainer import OverflowTrainerCallback

    class MaskedRegressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = masked_mlp()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.net(x)
            return {"logits": logits, "loss": nn.functional.mse_loss(logits, labels)}

    def run(max_steps: int, resume: bool) -> Any:
        arguments = TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=2,
            report_to=[],
            logging_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        callbacks = [OverflowTrainerCallback()]
        trainer = Trainer(model=MaskedRegressor(), args=arguments, train_dataset=SumDataset(), callbacks=callbacks)
        trainer.train(resume_from_checkpoint=True if resume else None)
        return trainer

    run(2, resume=False)
    assert run(4, resume=True).state.global_step == 4


# --------------------------------------------------------------------------------------------------- Accelerate


@pytest.fixture
def accelerate_run(fresh_accelerate_state: None) -> Callable[..., Any]:
    """A tracker attached to a fresh Accelerator on the CPU, the prepared `small_mlp` and Adam, and one step."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from nanwatch.adapters.accelerate import OverflowTracker

    def start(**config: Any) -> tuple[Any, Any, Any, Callable[[torch.Tensor, torch.Tensor], None]]:
        tracker = OverflowTracker(**config)
        accelerator = Accelerator(cpu=True, log_with=[tracker])
        model = small_mlp()
        model, optimizer = accelerator.prepare(model, CountingAdam(model.parameters()))
        tracker.attach(accelerator, model)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()

        return tracker, accelerator, model, step

    return start


def _poison_accelerate_weight(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["3.weight"][0, 5] = math.inf
    save_file(tensors, folder / "model.safetensors")


def _poison_accelerate_adam(folder: Path) -> None:
    def change(state: Any) -> None:
        state["state"][1]["exp_avg_sq"][4] = math.inf

    _poison(folder / "optimizer.bin", change)


@pytest.mark.parametrize(
    ("poison", "where"),
    [
        (None, None),
        (_poison_accelerate_weight, "model.safetensors:3.weight"),
        (_poison_accelerate_adam, "optimizer.bin:state.1.exp_avg_sq"),
    ],
    ids=["finite", "weight", "optimizer-state"],
)
def test_accelerate_load_state_refuses_a_poisoned_folder_before_loading_any_of_it(
    tmp_path: Path,
    accelerate_run: Callable[..., Any],
    poison: Callable[[Path], None] | None,
    where: str | None,
) -> None:
    tracker, accelerator, model, step = accelerate_run()
    data = batches(4)
    step(*data[0])
    step(*data[1])
    folder = tmp_path / "step-2"
    accelerator.save_state(str(folder))
    saved = snapshot(model)
    step(*data[2])
    moved = snapshot(model)

    if poison is None:
        accelerator.load_state(str(folder))
        assert same(snapshot(model), saved)
        step(*data[3])  # and the run goes on
        tracker.detach()
        return
    poison(folder)
    with pytest.raises(NonFiniteCheckpoint) as caught:
        accelerator.load_state(str(folder))
    tracker.detach()

    error = caught.value
    assert error.path == str(folder)
    assert error.non_finite == [(where, "inf")]
    assert str(error).startswith(
        f"nanwatch: the checkpoint '{folder}' that accelerator.load_state() was to load holds inf/nan: {where} inf "
    )
    assert str(error).endswith("load_state() loaded none of it.")
    assert same(snapshot(model), moved), "nothing of the folder was loaded"


def test_accelerate_detach_removes_the_load_check(tmp_path: Path, accelerate_run: Callable[..., Any]) -> None:
    tracker, accelerator, model, step = accelerate_run()
    step(*batches(1)[0])
    folder = tmp_path / "step-1"
    accelerator.save_state(str(folder))
    _poison_accelerate_adam(folder)
    tracker.detach()
    accelerator.load_state(str(folder))  # no tracker attached: nanwatch checks nothing
    assert not accelerator._load_model_state_pre_hook


class Settings:
    """A plain Python object in a registered object's state: weights_only=True refuses to unpickle it."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


class Registered:
    """An object registered for checkpointing (`accelerator.register_for_checkpointing`) whose state holds a
    `Settings`: Accelerate saves it as `custom_checkpoint_0.pkl` and loads it back with weights_only=False."""

    def __init__(self) -> None:
        self.settings = Settings(0.5)

    def state_dict(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.settings = state["settings"]


def test_accelerate_a_file_nanwatch_will_not_unpickle_is_left_to_accelerate(
    tmp_path: Path, accelerate_run: Callable[..., Any], nanwatch_log: pytest.LogCaptureFixture
) -> None:
    tracker, accelerator, model, step = accelerate_run()
    registered = Registered()
    accelerator.register_for_checkpointing(registered)
    step(*batches(1)[0])
    folder = tmp_path / "step-1"
    accelerator.save_state(str(folder))
    registered.settings = Settings(0.1)

    accelerator.load_state(str(folder))  # checked, all but the file nanwatch does not unpickle; loaded
    tracker.detach()

    assert registered.settings.lr == 0.5
    said = [record.getMessage() for record in nanwatch_log.records]
    assert (
        f"nanwatch: the checkpoint '{folder}' that accelerator.load_state() was to load: custom_checkpoint_0.pkl not "
        f"checked (it holds {__name__}.Settings, which weights_only=True refuses)" in said
    )
