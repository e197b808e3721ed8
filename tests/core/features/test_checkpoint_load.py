"""`nanwatch.verify_checkpoint`: a checkpoint file or folder read back is refused when a tensor holds inf/nan, named by
its key path; masks, integer tensors and the frameworks' pickled bookkeeping are let through; bad input is one line."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.models import small_mlp
from torch import nn

from nanwatch import NonFiniteCheckpoint, verify_checkpoint
from nanwatch.errors import CheckpointReadError


def _trained() -> tuple[nn.Sequential, torch.optim.Adam]:
    """`small_mlp` after one Adam step: weights, and Adam's moments and step counts for each of its 4 parameters."""
    model = small_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _saved(tmp_path: Path, state: Any, name: str = "checkpoint.pt") -> Path:
    path = tmp_path / name
    torch.save(state, path)
    return path


def _refused(path: Path, **options: Any) -> NonFiniteCheckpoint:
    with pytest.raises(NonFiniteCheckpoint) as caught:
        verify_checkpoint(path, **options)
    assert "\n" not in str(caught.value)
    return caught.value


class Causal(nn.Module):
    """A linear layer beside an additive causal mask kept as a buffer, -inf above the diagonal, as GPT-style models
    register it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), -math.inf).triu(1))


# ----------------------------------------------------------------------------------------------- what is checked


def test_a_finite_checkpoint_returns_what_was_checked(tmp_path: Path) -> None:
    model, optimizer = _trained()
    path = _saved(tmp_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3})

    verified = verify_checkpoint(path)

    assert verified.path == str(path)
    assert verified.files == (str(path),)
    assert verified.tensors == 4 + 4 * 3  # the weights; Adam's exp_avg, exp_avg_sq and step (a float tensor) each
    assert (verified.masks, verified.allowed, verified.skipped) == ((), (), ())


def test_a_poisoned_weight_is_named_by_its_key_path_with_its_count(tmp_path: Path) -> None:
    model, optimizer = _trained()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    state["model"]["0.weight"][1, 2] = math.inf
    state["model"]["3.bias"].fill_(math.nan)
    path = _saved(tmp_path, state)

    error = _refused(path)

    assert error.path == str(path)
    assert error.non_finite == [("model.0.weight", "inf"), ("model.3.bias", "nan")]
    assert error.quarantine_path is None
    assert error.last_good is None
    assert str(error) == (
        f"nanwatch: the checkpoint '{path}' holds inf/nan: model.0.weight inf (1 of 32 values), model.3.bias nan "
        "(1 of 1 values) (2 of 16 floating-point tensors, 2 values in all); do not load it: resume from an earlier "
        "checkpoint."
    )


def test_a_poisoned_optimizer_state_is_named_by_its_key_path(tmp_path: Path) -> None:
    model, optimizer = _trained()
    state = optimizer.state_dict()
    state["state"][3]["exp_avg"][0] = -math.inf
    error = _refused(_saved(tmp_path, {"optimizer_states": [state]}))
    assert error.non_finite == [("optimizer_states[0].state.3.exp_avg", "inf")]


def test_nested_dicts_lists_and_tuples_are_walked(tmp_path: Path) -> None:
    state = {"runs": [{"w": torch.ones(3)}, (torch.zeros(2), torch.tensor([1.0, math.nan, math.nan]))]}
    error = _refused(_saved(tmp_path, state))
    assert error.non_finite == [("runs[1][1]", "nan")]
    assert "runs[1][1] nan (2 of 3 values) (1 of 3 floating-point tensors, 2 values in all)" in str(error)


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float64], ids=str
)
def test_every_floating_dtype_is_checked(tmp_path: Path, dtype: torch.dtype) -> None:
    # float8 has no finiteness kernels on the CPU: its values are checked in float32, where each is exact.
    finite = torch.tensor([1.0, -2.0, 0.5]).to(dtype)
    assert verify_checkpoint(_saved(tmp_path, {"w": finite}, "good.pt")).tensors == 1
    poisoned = torch.tensor([1.0, math.nan, 0.5]).to(dtype)
    assert _refused(_saved(tmp_path, {"w": finite, "v": poisoned}, "bad.pt")).non_finite == [("v", "nan")]


def test_an_overflowed_bfloat16_weight_is_inf(tmp_path: Path) -> None:
    weight = torch.full((4,), 3e38, dtype=torch.bfloat16) * 10  # past bfloat16's range: inf
    assert _refused(_saved(tmp_path, {"w": weight})).non_finite == [("w", "inf")]


def test_integer_tensors_are_skipped(tmp_path: Path) -> None:
    state = {"ids": torch.tensor([1, 2, 3]), "flags": torch.tensor([True]), "w": torch.ones(2), "step": 7}
    assert verify_checkpoint(_saved(tmp_path, state)).tensors == 1


def test_a_lightning_checkpoint_is_checked_where_the_guard_checks_it(tmp_path: Path) -> None:
    # A ModelCheckpoint's state keeps an inf on purpose (its kth_value): only the weights and optimizers count.
    model, optimizer = _trained()
    state = {
        "pytorch-lightning_version": "2.6.0",
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "callbacks": {"ModelCheckpoint{}": {"kth_value": torch.tensor(math.inf)}},
    }
    assert verify_checkpoint(_saved(tmp_path, state, "last.ckpt")).tensors == 16
    state["state_dict"]["0.bias"][0] = math.inf
    assert _refused(_saved(tmp_path, state, "bad.ckpt")).non_finite == [("state_dict.0.bias", "inf")]


# ---------------------------------------------------------------------------------------------- safetensors, folders


def test_a_safetensors_file_is_read(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2, dtype=torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    assert verify_checkpoint(tmp_path / "model.safetensors").tensors == 2
    tensors["fc.bias"][1] = math.inf
    save_file(tensors, tmp_path / "bad.safetensors")
    assert _refused(tmp_path / "bad.safetensors").non_finite == [("fc.bias", "inf")]


def _accelerate_like(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What `accelerator.save_state(folder)` writes: the weights as safetensors, the optimizer's state, and its RNG
    states pickled with numpy's (which weights_only=True refuses)."""
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({name: value.contiguous() for name, value in model.state_dict().items()}, folder / "model.safetensors")
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    torch.save({"numpy_random_seed": np.random.get_state()}, folder / "random_states_0.pkl")
    (folder / "notes.json").write_text("{}", encoding="utf-8")


def test_a_folder_has_every_checkpoint_file_in_it_checked(tmp_path: Path) -> None:
    model, optimizer = _trained()
    folder = tmp_path / "checkpoint_0"
    _accelerate_like(folder, model, optimizer)

    verified = verify_checkpoint(folder)

    assert verified.files == ("model.safetensors", "optimizer.bin")
    assert verified.tensors == 16
    assert len(verified.skipped) == 1
    assert verified.skipped[0].startswith("random_states_0.pkl (pickled framework state that weights_only=True ")

    state = torch.load(folder / "optimizer.bin", weights_only=True)
    state["state"][0]["exp_avg"][0, 0] = math.inf
    torch.save(state, folder / "optimizer.bin")
    error = _refused(folder)
    assert error.path == str(folder)
    assert error.non_finite == [("optimizer.bin:state.0.exp_avg", "inf")]


def test_a_folder_s_subfolders_are_checked_too(tmp_path: Path) -> None:
    (tmp_path / "global_step4").mkdir()
    torch.save({"w": torch.tensor([math.nan])}, tmp_path / "global_step4" / "optim_states.pt")
    torch.save({"w": torch.ones(1)}, tmp_path / "model.pt")
    assert _refused(tmp_path).non_finite == [("global_step4/optim_states.pt:w", "nan")]


def test_sharded_distcp_files_are_not_read_and_said(tmp_path: Path, nanwatch_log: pytest.LogCaptureFixture) -> None:
    (tmp_path / "pytorch_model_fsdp_0").mkdir()
    (tmp_path / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"shard")
    with pytest.raises(CheckpointReadError, match="holds no floating-point tensor: nothing to verify$"):
        verify_checkpoint(tmp_path)

    torch.save({"scale": torch.ones(1)}, tmp_path / "scaler.pt")
    verified = verify_checkpoint(tmp_path)
    assert verified.files == ("scaler.pt",)
    assert verified.skipped == (
        "pytorch_model_fsdp_0/__0_0.distcp (a torch.distributed.checkpoint shard, which nanwatch does not read)",
    )
    said = (
        f"nanwatch: the checkpoint '{tmp_path}': pytorch_model_fsdp_0/__0_0.distcp not checked (a "
        "torch.distributed.checkpoint shard, which nanwatch does not read)"
    )
    assert said in [record.getMessage() for record in nanwatch_log.records]


# ------------------------------------------------------------------------------------------------------- masks


def test_an_additive_mask_passes_without_a_model_and_is_said(
    tmp_path: Path, nanwatch_log: pytest.LogCaptureFixture
) -> None:
    path = _saved(tmp_path, {"model": Causal().state_dict()})

    verified = verify_checkpoint(path)

    assert verified.masks == ("model.mask",)
    assert verified.tensors == 3
    said = [record.getMessage() for record in nanwatch_log.records if record.levelno == logging.INFO]
    assert said == [
        f"nanwatch: the checkpoint '{path}': let through as additive masks (square, every value 0 or -inf): "
        "model.mask; allow= names them, model= knows them exactly"
    ]


def test_what_is_not_an_additive_mask_is_refused_without_a_model(tmp_path: Path) -> None:
    state = Causal().state_dict()
    state["mask"][0, 1] = math.nan  # nan where -inf was
    state["fc.weight"][0, 0] = -math.inf  # -inf among weights that are not zero
    state["fc.bias"].fill_(-math.inf)  # all -inf: no mask (an overflowed bias, or its Adam moment)
    state["zeros"] = torch.zeros(2, 3)
    state["zeros"][1, 1] = -math.inf  # 0 and -inf, but not square: no attention mask
    error = _refused(_saved(tmp_path, state))
    assert error.non_finite == [("mask", "nan"), ("fc.weight", "inf"), ("fc.bias", "inf"), ("zeros", "inf")]


def test_with_the_model_a_mask_may_hold_only_what_it_holds_as_built(tmp_path: Path) -> None:
    model = Causal()
    state = {"model": model.state_dict()}
    path = _saved(tmp_path, state, "good.pt")
    assert verify_checkpoint(path, model=model).masks == ()  # known from the model, not guessed

    poisoned = {"model": {name: value.clone() for name, value in model.state_dict().items()}}
    poisoned["model"]["mask"][3, 0] = -math.inf  # still 0 or -inf only, but not where the model's mask holds it
    error = _refused(_saved(tmp_path, poisoned, "bad.pt"), model=model)
    assert error.non_finite == [("model.mask", "inf")]
    assert "model.mask inf (1 of 16 values)" in str(error)


def test_allow_lets_tensors_through_by_key_path_tail_or_pattern(tmp_path: Path) -> None:
    state = {"h": [{"attn": {"bias": torch.tensor([math.nan, 1.0])}}], "w": torch.tensor([math.inf])}
    path = _saved(tmp_path, state)

    assert _refused(path, allow="attn.bias").non_finite == [("w", "inf")]
    verified = verify_checkpoint(path, allow=["*.attn.bias", "w"])
    assert verified.allowed == ("h[0].attn.bias", "w")
    assert verified.tensors == 2


# --------------------------------------------------------------------------------------------------- bad input


def test_a_missing_path_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^nanwatch: no checkpoint at '.*nope\.pt': no such file or folder$"):
        verify_checkpoint(tmp_path / "nope.pt")


@pytest.mark.parametrize(
    ("name", "content"),
    [("notes.txt", b"hello\n"), ("empty.pt", b""), ("config.json", b'{"a": 1}'), ("broken.safetensors", b"xx")],
)
def test_a_file_that_is_not_a_checkpoint_is_one_line(tmp_path: Path, name: str, content: bytes) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(CheckpointReadError, match=r"is not a (checkpoint|safetensors file)") as caught:
        verify_checkpoint(tmp_path / name)
    assert "\n" not in str(caught.value)


def test_a_torch_file_without_a_floating_point_tensor_is_no_checkpoint(tmp_path: Path) -> None:
    path = _saved(tmp_path, {"ids": torch.tensor([1, 2]), "epoch": 3})
    with pytest.raises(CheckpointReadError, match="holds no floating-point tensor: nothing to verify$"):
        verify_checkpoint(path)


def test_a_folder_without_a_checkpoint_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "trainer_state.json").write_text("{}", encoding="utf-8")
    with pytest.raises(CheckpointReadError, match=r"holds no checkpoint file \(none named \*\.safetensors, \*\.bin"):
        verify_checkpoint(tmp_path)


class Opaque:
    """A Python object in a checkpoint: weights_only=True refuses to unpickle it."""

    def __init__(self) -> None:
        self.w = torch.tensor([math.inf])


def test_weights_only_refusal_is_one_line_and_false_opts_in(tmp_path: Path) -> None:
    path = _saved(tmp_path, {"model": torch.ones(2), "extra": Opaque()})
    with pytest.raises(CheckpointReadError) as caught:
        verify_checkpoint(path)
    assert str(caught.value) == (
        f"nanwatch: torch.load(weights_only=True) refuses '{path}': it holds {__name__}.Opaque, which unpickling "
        "would run; pass weights_only=False only if you trust where the file came from"
    )
    # Trusted, it is read: the object itself is not walked (only dicts, lists, tuples, modules, optimizers are).
    assert verify_checkpoint(path, weights_only=False).tensors == 1


def test_in_a_folder_a_refused_file_that_is_not_bookkeeping_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "model.pt")
    torch.save(Opaque(), tmp_path / "ema.pt")
    with pytest.raises(CheckpointReadError, match=r"refuses '.*ema\.pt': it holds "):
        verify_checkpoint(tmp_path)


def test_bad_arguments_are_one_line(tmp_path: Path) -> None:
    path = _saved(tmp_path, {"w": torch.ones(1)})
    with pytest.raises(TypeError, match=r"^nanwatch: verify_checkpoint\(model=\.\.\.\) takes a torch\.nn\.Module"):
        verify_checkpoint(path, model={"w": torch.ones(1)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^nanwatch: allow= takes key paths \(str\), got int 3$"):
        verify_checkpoint(path, allow=[3])  # type: ignore[list-item]
