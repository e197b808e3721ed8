"""The repro capsule's file: written whole or not at all, read back with a weights-only load, the module rebuilt with
its tensors (tied weights tied, non-persistent buffers kept) and without nanwatch's hooks, the inputs as they were;
every file that is not a capsule this nanwatch reads refused in one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.capsule_models import (
    HoldsLock,
    Options,
    ScaledMLP,
    Tied,
    doubles_output,
    linear_case,
    mlp_case,
)
from torch import nn

import nanwatch
from nanwatch.core.formats.capsule import (
    CAPSULE_FORMAT,
    CAPSULE_VERSION,
    CapsuleError,
    capsule_file_name,
    read_capsule,
    write_capsule,
)
from nanwatch.core.runstate import autocast_state

KEYS = {
    "format",
    "version",
    "torch_version",
    "nanwatch_version",
    "module_name",
    "module_class",
    "training",
    "module_pickle",
    "state",
    "args",
    "kwargs",
    "objects",
    "dropped",
    "dtype",
    "autocast",
    "compile_backend",
    "compile_mode",
    "device",
    "batch_number",
    "rank",
    "note",
}


def _write(
    path: Path, module: nn.Module, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **extra: Any
) -> Path:
    options: dict[str, Any] = {
        "dtype": torch.float16,
        "autocast": {},
        "compile_backend": None,
        "compile_mode": None,
        "module_name": "encoder.fc",
        "batch_number": 7,
        "rank": 0,
    }
    return write_capsule(path, module, args, kwargs or {}, **{**options, **extra})


def _rewrite(path: Path, **changes: Any) -> Path:
    """The capsule at `path` with some of its keys changed (or removed, given None as `...`)."""
    data = torch.load(path, weights_only=True)
    data.update(changes)
    torch.save(data, path)
    return path


def _one_line_error(path: Path) -> str:
    with pytest.raises(CapsuleError) as caught:
        read_capsule(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------------ writing


def test_the_file_loads_weights_only_and_holds_the_call(tmp_path: Path) -> None:
    case = linear_case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = autocast_state()
    path = _write(
        tmp_path / capsule_file_name(0, 7),
        case.module,
        case.args,
        autocast=autocast,
        compile_backend="inductor",
        compile_mode="max-autotune",
        note="precision: float16 overflowed",
    )
    assert path == tmp_path / "nanwatch-capsule-rank0-batch7.pt"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left beside it
    data = torch.load(path, weights_only=True)  # the whole outer file, without running any code from it
    assert set(data) == KEYS
    assert (data["format"], data["version"]) == (CAPSULE_FORMAT, CAPSULE_VERSION)
    assert (data["torch_version"], data["nanwatch_version"]) == (torch.__version__, nanwatch.__version__)
    assert (data["module_name"], data["module_class"]) == ("encoder.fc", "torch.nn.modules.linear:Linear")
    assert (data["dtype"], data["autocast"], data["device"]) == ("float16", {"cpu": "bfloat16"}, "cpu")
    assert (data["compile_backend"], data["compile_mode"]) == ("inductor", "max-autotune")
    assert (data["batch_number"], data["rank"], data["note"]) == (7, 0, "precision: float16 overflowed")
    assert isinstance(data["module_pickle"], bytes)
    assert set(data["state"]) == {"weight", "bias"}
    assert torch.equal(data["state"]["weight"], case.module.weight)
    assert data["state"]["weight"].dtype == torch.float16
    assert torch.equal(data["args"][0], case.args[0])
    assert (data["kwargs"], data["objects"], data["dropped"]) == ({}, [], [])


def test_the_module_pickle_holds_no_tensor_data(tmp_path: Path) -> None:
    # The weights are in the state, once: the pickled module holds meta tensors in their place.
    big = nn.Linear(256, 256)
    data = torch.load(_write(tmp_path / "c.pt", big, (torch.ones(1, 256),)), weights_only=True)
    assert len(data["module_pickle"]) < 8_000
    assert (tmp_path / "c.pt").stat().st_size < 256 * 257 * 4 * 1.1


def test_the_module_is_rebuilt_fresh_each_time(tmp_path: Path) -> None:
    case = linear_case()
    capsule = read_capsule(_write(tmp_path / "c.pt", case.module, case.args))
    first, second = capsule.build_module(), capsule.build_module()
    assert isinstance(first, nn.Linear)
    assert first is not case.module
    assert torch.equal(first.weight, case.module.weight)
    assert first.weight.requires_grad
    with torch.no_grad():
        first.weight.zero_()
    assert torch.equal(second.weight, case.module.weight)  # each its own tensors
    inputs = capsule.inputs()
    assert torch.isinf(second(*inputs.args)).all()  # the float16 overflow, again


def test_tied_weights_and_non_persistent_buffers_come_back(tmp_path: Path) -> None:
    model = Tied()
    with torch.no_grad():
        model.mask.mul_(3)
    module = read_capsule(_write(tmp_path / "c.pt", model)).build_module()
    assert isinstance(module, Tied)
    assert module.b.weight is module.a.weight
    assert torch.equal(module.mask, torch.tensor([3.0, 0.0, 3.0, 0.0]))
    x = torch.randn(2, 4)
    assert torch.equal(module(x), model(x))


def test_a_compiled_module_is_kept_unwrapped(tmp_path: Path) -> None:
    case = mlp_case()
    compiled = torch.compile(case.module, backend="eager")
    capsule = read_capsule(_write(tmp_path / "c.pt", compiled, case.args, case.kwargs, compile_backend="eager"))
    assert (capsule.module_class, capsule.compile_backend) == ("tests.capsule_models:ScaledMLP", "eager")
    in_place = ScaledMLP()
    in_place.compile(backend="eager")  # module.compile(): the compiled call is left out, the backend recorded
    rebuilt = read_capsule(_write(tmp_path / "d.pt", in_place, (torch.ones(1, 8),))).build_module()
    assert rebuilt._compiled_call_impl is None


def test_nanwatchs_hooks_are_left_out_and_the_users_kept(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].register_forward_hook(doubles_output)
    model[1].register_forward_pre_hook(lambda module, args: None)  # a lambda: not picklable
    with nanwatch.watch(model):
        watched = model[1]._forward_hooks, model[1]._forward_pre_hooks
        assert len(watched[0]) + len(watched[1]) > 2  # nanwatch's hooks are on it now
        capsule = read_capsule(_write(tmp_path / "c.pt", model[1], (torch.ones(1, 2),), module_name="1"))
    rebuilt = capsule.build_module()
    assert list(rebuilt._forward_hooks.values()) == [doubles_output]
    assert not rebuilt._forward_pre_hooks
    assert not rebuilt._forward_pre_hooks_with_kwargs
    assert len(capsule.dropped) == 1
    assert re.fullmatch(
        r"forward pre hook test_nanwatchs_hooks_are_left_out_and_the_users_kept\.<locals>\.<lambda> of \(the module\): "
        r"not picklable \(.+\)",
        capsule.dropped[0],
    ), capsule.dropped[0]
    x = torch.ones(1, 2)
    assert torch.equal(rebuilt(x), model[1](x))  # doubled by the hook kept, in both


def test_inputs_keep_plain_values_pickle_objects_and_drop_what_cannot_be_pickled(tmp_path: Path) -> None:
    x = torch.randn(2, 2, requires_grad=True)
    args = (x, 3, "mean", None, [x, (1.5, torch.float16)], {"k": torch.ones(1)}, Options(gain=2.0))
    kwargs = {"scale": torch.Size([2]), "callback": lambda: None}
    path = _write(tmp_path / "c.pt", nn.Identity(), args, kwargs)
    data = torch.load(path, weights_only=True)  # the objects are bytes: still a weights-only file
    assert len(data["objects"]) == 1
    assert data["dropped"] == [
        "kwargs['callback']: a function, not picklable (AttributeError: Can't pickle local object "
        "'test_inputs_keep_plain_values_pickle_objects_and_drop_what_cannot_be_pickled.<locals>.<lambda>')"
    ]
    inputs = read_capsule(path).inputs()
    got, number, text, nothing, listed, mapping, options = inputs.args
    assert torch.equal(got, x)
    assert not got.requires_grad
    assert listed[0] is got  # one tensor given twice is one tensor again
    assert (number, text, nothing, listed[1], options) == (3, "mean", None, (1.5, torch.float16), Options(gain=2.0))
    assert torch.equal(mapping["k"], torch.ones(1))
    assert inputs.kwargs == {"scale": torch.Size([2]), "callback": None}


def test_a_module_that_cannot_be_pickled_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    path.write_bytes(b"the capsule of an earlier detection")
    with pytest.raises(CapsuleError) as caught:
        _write(path, HoldsLock(), (torch.ones(1, 2),))
    assert str(caught.value).startswith(
        "module 'encoder.fc' (tests.capsule_models:HoldsLock) cannot be saved in a capsule: TypeError: "
    )
    assert path.read_bytes() == b"the capsule of an earlier detection"
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_capsule_file_names() -> None:
    assert capsule_file_name(3, 12) == "nanwatch-capsule-rank3-batch12.pt"
    assert capsule_file_name(0, 4, phase="eval") == "nanwatch-capsule-eval-rank0-batch4.pt"


# ------------------------------------------------------------------------------------------------ reading: refusals


@pytest.fixture
def capsule(tmp_path: Path) -> Path:
    case = linear_case()
    return _write(tmp_path / "nanwatch-capsule-rank0-batch7.pt", case.module, case.args)


def test_what_is_not_a_file_is_refused(tmp_path: Path) -> None:
    assert _one_line_error(tmp_path / "nope.pt") == (
        f"'{tmp_path / 'nope.pt'}' does not exist; nanwatch repro reads the nanwatch-capsule-rank{{R}}-batch{{N}}.pt "
        "files a detection writes in report_dir"
    )
    assert _one_line_error(tmp_path).startswith(f"'{tmp_path}' is not a file; ")


def test_a_file_that_is_not_a_capsule_is_refused(tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(2), "bias": torch.zeros(2)}, weights)
    assert _one_line_error(weights) == (
        f"'{weights}' is a torch file but not a nanwatch capsule (it holds a dict with keys ['bias', 'weight']); "
        "nanwatch repro reads the nanwatch-capsule-rank{R}-batch{N}.pt files a detection writes in report_dir"
    )
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.ones(2), tensor)
    assert "is a torch file but not a nanwatch capsule (it holds a Tensor)" in _one_line_error(tensor)
    objects = tmp_path / "objects.pt"
    torch.save({"options": Options(gain=1.0)}, objects)  # a weights-only load refuses it: no capsule holds one
    assert _one_line_error(objects).startswith(
        f"'{objects}' is not a nanwatch capsule (it holds Python objects: tests.capsule_models.Options); "
    )
    text = tmp_path / "notes.pt"
    text.write_text("not a torch file\n")
    assert _one_line_error(text).startswith(f"'{text}' is not a nanwatch capsule (not a file torch.save wrote")


def test_a_capsule_cut_short_is_refused(capsule: Path) -> None:
    capsule.write_bytes(capsule.read_bytes()[: capsule.stat().st_size // 2])  # a full disk, a copy taken too early
    assert _one_line_error(capsule).startswith(f"'{capsule}' is not a nanwatch capsule (not a file torch.save wrote")


def test_a_capsule_of_a_newer_format_is_refused(capsule: Path) -> None:
    _rewrite(capsule, version=CAPSULE_VERSION + 1)
    assert _one_line_error(capsule) == (
        f"capsule '{capsule}' has format version {CAPSULE_VERSION + 1}; this nanwatch ({nanwatch.__version__}) reads "
        f"versions up to {CAPSULE_VERSION}; upgrade nanwatch (pip install -U nanwatch)"
    )


def test_a_damaged_capsule_is_refused(capsule: Path) -> None:
    data = torch.load(capsule, weights_only=True)
    del data["state"]
    data["rank"] = "0"
    torch.save(data, capsule)
    assert _one_line_error(capsule) == (
        f"capsule '{capsule}' is damaged: bad or missing entries 'state' (missing), 'rank' (a str); the file was "
        "changed after it was written: use the one nanwatch wrote"
    )


@pytest.mark.parametrize(
    ("module_class", "expected"),
    [
        (
            "tests.no_such_models:Net",
            "its module's class tests.no_such_models:Net cannot be imported here (ModuleNotFoundError: No module "
            "named 'tests.no_such_models'); run nanwatch repro where the code that defines it imports (its "
            "project's folder, or with it on PYTHONPATH)",
        ),
        (
            "tests.capsule_models:Renamed",
            "its module's class tests.capsule_models:Renamed cannot be imported here: tests.capsule_models has no "
            "Renamed; run nanwatch repro with the code the capsule was written from (the class was renamed or moved "
            "since)",
        ),
        (
            "__main__:Net",
            "its module's class __main__:Net cannot be imported here: it was defined in the script that ran "
            "(__main__), which another process cannot import; define the class in a module the script imports, and "
            "write the capsule again",
        ),
        ("tests.capsule_models:Options", "its module's class tests.capsule_models:Options cannot be imported here: "),
    ],
)
def test_a_class_that_does_not_import_is_refused(capsule: Path, module_class: str, expected: str) -> None:
    _rewrite(capsule, module_class=module_class)
    assert _one_line_error(capsule).startswith(f"capsule '{capsule}': {expected}")
