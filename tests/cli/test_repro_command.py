"""`nanwatch repro CAPSULE`: the precision case reproduced in float16 and finite with `--dtype float32`, in a fresh
process, for a Linear, a transformers GPT-2 block and a compiled module; every bad input one line with exit 2.

The capsules are written with `write_capsule` directly (no detection needed); the modules' classes are torch's,
transformers' and tests/capsule_models.py's, which the subprocess imports from the repository's root, its cwd.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.capsule_models import RefusesFloat64, gpt2_block_case, linear_case, mlp_case
from torch import nn

from nanwatch.cli import main
from nanwatch.core.formats.capsule import CAPSULE_VERSION, capsule_file_name, write_capsule

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()  # the capsules are written on the CPU: they run there, but for one recorded on CUDA


@dataclass(frozen=True)
class Capsules:
    linear: Path
    gpt2: Path
    compiled: Path


def _write(path: Path, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], **extra: Any) -> Path:
    options: dict[str, Any] = {
        "dtype": torch.float16,
        "autocast": {},
        "compile_backend": None,
        "compile_mode": None,
        "module_name": "fc",
        "batch_number": 7,
        "rank": 0,
    }
    return write_capsule(path, module, args, kwargs, **{**options, **extra})


@pytest.fixture(scope="module")
def capsules(tmp_path_factory: pytest.TempPathFactory) -> Capsules:
    folder = tmp_path_factory.mktemp("capsules")
    linear, gpt2, mlp = linear_case(), gpt2_block_case(), mlp_case()
    compiled = torch.compile(mlp.module, backend="aot_eager")  # the capsule keeps the module, and the backend
    return Capsules(
        linear=_write(
            folder / "linear" / capsule_file_name(0, 7),
            linear.module,
            linear.args,
            linear.kwargs,
            note="cause: precision",
        ),
        gpt2=_write(folder / "gpt2" / capsule_file_name(0, 7), gpt2.module, gpt2.args, gpt2.kwargs, module_name="h.0"),
        compiled=_write(
            folder / "compiled" / capsule_file_name(1, 3),
            compiled,
            mlp.args,
            mlp.kwargs,
            module_name="",
            rank=1,
            batch_number=3,
            compile_backend="aot_eager",
        ),
    )


def _repro(*argv: str | Path, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m nanwatch repro ...` in a fresh process, from the repository's root (where `tests.*` imports)."""
    environment = {key: value for key, value in os.environ.items() if key != "NANWATCH_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "nanwatch", "repro", *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**environment, **(env or {})},
    )


def _lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return result.stdout.splitlines()


# ------------------------------------------------------------------------------------------------ the precision case


@pytest.mark.slow
def test_a_linear_overflows_in_float16_and_not_in_float32(capsules: Capsules) -> None:
    header = (
        f"nanwatch repro of module 'fc' (torch.nn.modules.linear:Linear), batch 7 on rank 0, from {capsules.linear}"
    )
    recorded = "as recorded: float16, autocast off, eager, on cpu: not finite (8 inf, 0 nan of 8 values), abs max inf"
    result = _repro(capsules.linear)
    assert (result.returncode, result.stderr) == (1, "")
    assert _lines(result) == [header, "note: cause: precision", recorded]
    result = _repro(capsules.linear, "--dtype", "float32")
    assert (result.returncode, result.stderr) == (0, "")
    assert _lines(result) == [
        header,
        "note: cause: precision",
        recorded,
        "requested: float32, autocast off, eager, on cpu: finite (8 values), abs max 8.00e+04",
    ]


@pytest.mark.slow
def test_a_gpt2_block_overflows_in_float16_and_not_in_float32(capsules: Capsules) -> None:
    header = (
        "nanwatch repro of module 'h.0' (transformers.models.gpt2.modeling_gpt2:GPT2Block), batch 7 on rank 0, "
        f"from {capsules.gpt2}"
    )
    result = _repro(capsules.gpt2)
    assert result.returncode == 1, result.stderr
    assert _lines(result)[0] == header
    assert re.fullmatch(
        r"as recorded: float16, autocast off, eager, on cpu: not finite \(\d+ inf, 0 nan of 128 values\), "
        r"abs max inf",
        _lines(result)[1],
    ), result.stdout
    assert len(_lines(result)) == 2
    result = _repro(capsules.gpt2, "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    requested = re.fullmatch(
        r"requested: float32, autocast off, eager, on cpu: finite \(128 values\), abs max (\S+)",
        _lines(result)[2],
    )
    assert requested is not None, result.stdout
    assert 65504 < float(requested.group(1)) < 1e6  # past float16's largest value, well inside float32's


@pytest.mark.slow
def test_a_compiled_module_overflows_compiled_and_eager_in_float16_only(capsules: Capsules) -> None:
    header = (
        f"nanwatch repro of the model (tests.capsule_models:ScaledMLP), batch 3 on rank 1, from {capsules.compiled}"
    )
    overflow = "not finite (16 inf, 0 nan of 16 values), abs max inf"
    recorded = f"as recorded: float16, autocast off, compiled (aot_eager), on cpu: {overflow}"
    result = _repro(capsules.compiled)
    assert (result.returncode, result.stderr) == (1, "")
    assert _lines(result) == [header, recorded]
    result = _repro(capsules.compiled, "--dtype", "float32")
    assert (result.returncode, result.stderr) == (0, "")
    assert _lines(result) == [
        header,
        recorded,
        "requested: float32, autocast off, compiled (aot_eager), on cpu: finite (16 values), abs max 1.02e+05",
    ]
    # Eager overflows too: the dtype's range, not the compiler.
    result = _repro(capsules.compiled, "--backend", "eager")
    assert (result.returncode, result.stderr) == (1, "")
    assert _lines(result)[2] == f"requested: float16, autocast off, eager, on cpu: {overflow}"
    result = _repro(capsules.compiled, "--backend", "aot_eager", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert _lines(result)[2].startswith("requested: float32, autocast off, compiled (aot_eager), on cpu: finite")


@pytest.mark.slow
def test_inductor_overflows_in_float16_and_not_in_float32(capsules: Capsules) -> None:
    # Inductor on the CPU compiles C++ (a compiler is needed, and seconds): the slowest of the three backends.
    result = _repro(capsules.compiled, "--backend", "inductor")
    assert result.returncode == 1, result.stderr
    assert _lines(result)[2] == (
        "requested: float16, autocast off, compiled (inductor), on cpu: not finite (16 inf, 0 nan of 16 values), "
        "abs max inf"
    )
    result = _repro(capsules.compiled, "--backend", "inductor", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert _lines(result)[2] == (
        "requested: float32, autocast off, compiled (inductor), on cpu: finite (16 values), abs max 1.02e+05"
    )


@pytest.mark.slow
def test_autocast_is_run_as_recorded_and_off_with_a_dtype(tmp_path: Path) -> None:
    # A float32 Linear under CUDA autocast to float16, recorded on cuda:0: without a GPU the runs go on the CPU,
    # autocast with them.
    case = linear_case()
    module = case.module.float()
    path = _write(tmp_path / "c.pt", module, (case.args[0].float(),), {}, dtype="float32", autocast={"cuda": "float16"})
    data = torch.load(path, weights_only=True)
    data["device"] = "cuda:0"
    torch.save(data, path)
    result = _repro(path, "--dtype", "float32")
    assert (result.returncode, result.stderr) == (0, "")
    cpu_note = "recorded on cuda:0, which this process cannot use: the runs go on the cpu, whose kernels may round"
    note = [] if CUDA else [f"{cpu_note} otherwise"]
    autocast = "cuda float16" if CUDA else "cpu float16"
    where = "cuda:0" if CUDA else "cpu"
    assert _lines(result)[1:] == [
        *note,
        f"as recorded: float32, autocast {autocast}, eager, on {where}: not finite (8 inf, 0 nan of 8 values), abs "
        "max inf",
        f"requested: float32, autocast off, eager, on {where}: finite (8 values), abs max 8.00e+04",
    ]


# ------------------------------------------------------------------------------------------------ bad input: exit 2


def _in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["repro", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def _bumped(source: Path, target: Path, **changes: Any) -> Path:
    data = torch.load(source, weights_only=True)
    data.update(changes)
    torch.save(data, target)
    return target


WHAT_TO_GIVE = "repro reads the nanwatch-capsule-rank{R}-batch{N}.pt file a detection writes in report_dir"


def test_a_file_that_is_not_a_capsule_is_one_line(
    capsules: Capsules, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tmp_path / "weights.pt"
    torch.save({"weight": torch.randn(3, 3)}, weights)
    assert _in_process([str(weights)], capsys) == (
        2,
        "",
        f"nanwatch repro: '{weights}' is a torch file but not a nanwatch capsule (it holds a dict with keys "
        "['weight']); nanwatch repro reads the nanwatch-capsule-rank{R}-batch{N}.pt files a detection writes in "
        "report_dir\n",
    )
    report = tmp_path / "nanwatch-report-rank0-batch7.jsonl"
    report.write_text('{"version": 2, "kind": "report"}\n')
    assert _in_process([str(report)], capsys) == (
        2,
        "",
        f"nanwatch repro: {report} is a nanwatch report as JSON Lines; {WHAT_TO_GIVE}\n",
    )
    capture = tmp_path / "replay-rank0-batch7.pt"
    torch.save({"format": "nanwatch-replay"}, capture)
    status, out, err = _in_process([str(capture)], capsys)
    assert (status, out) == (2, "")
    assert err == (
        f"nanwatch repro: {capture} is a replay capture (capture_on_detect's torch.save file), not a report; replay "
        f"it with nanwatch replay {capture} --model MODULE:FACTORY\n"
    )


def test_what_is_not_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _in_process([str(tmp_path)], capsys) == (
        2,
        "",
        f"nanwatch repro: {tmp_path} is a folder, not a file; {WHAT_TO_GIVE}\n",
    )
    missing = tmp_path / "nanwatch-capsule-rank0-batch1.pt"
    assert _in_process([str(missing)], capsys) == (
        2,
        "",
        f"nanwatch repro: {missing} is not there (no such file); {WHAT_TO_GIVE}\n",
    )


def test_a_capsule_of_a_newer_format_is_one_line(
    capsules: Capsules, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newer = _bumped(capsules.linear, tmp_path / "newer.pt", version=CAPSULE_VERSION + 1)
    status, out, err = _in_process([str(newer)], capsys)
    assert (status, out) == (2, "")
    assert err == (
        f"nanwatch repro: capsule '{newer}' has format version {CAPSULE_VERSION + 1}; this nanwatch "
        f"({__import__('nanwatch').__version__}) reads versions up to {CAPSULE_VERSION}; upgrade nanwatch (pip install "
        "-U nanwatch)\n"
    )


def test_a_bad_option_is_one_line(capsules: Capsules, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _in_process([str(capsules.linear), "--dtype", "int8"], capsys)
    assert (status, out) == (2, "")
    assert err == (
        "nanwatch repro: argument --dtype: invalid choice: 'int8' (choose from 'float32', 'float16', 'bfloat16', "
        "'float64'); "
        "see nanwatch repro --help\n"
    )
    status, _, err = _in_process([str(capsules.linear), "--backend", "cudagraphs"], capsys)
    assert status == 2
    assert err.startswith("nanwatch repro: argument --backend: invalid choice: 'cudagraphs' (choose from 'eager', ")


def test_a_last_run_that_cannot_run_is_one_line_after_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "c.pt", RefusesFloat64(), (torch.ones(1, 2),), {}, dtype="float32")
    status, out, err = _in_process([str(path), "--dtype", "float64"], capsys)
    assert status == 2
    failed = "failed: TypeError: float64 is not supported by this module"
    assert out.splitlines()[1:] == [
        "as recorded: float32, autocast off, eager, on cpu: finite (2 values), abs max "
        + out.splitlines()[1].rsplit(" ", 1)[1],
        f"requested: float64, autocast off, eager, on cpu: {failed}",
    ]
    assert err == (
        f"nanwatch repro: the last run (requested: float64, autocast off, eager, on cpu) {failed}; the error is the "
        "module's own or the backend's: try another --dtype or --backend\n"
    )
    assert _in_process([str(path)], capsys)[0] == 0  # as recorded, it runs, and is finite


@pytest.mark.slow
def test_a_class_that_does_not_import_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The class lives in a module of the training run's own folder, which the repro's process does not have on its
    # path: the realistic way a class does not import.
    code = tmp_path / "code"
    code.mkdir()
    (code / "private_models.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(2, 2)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n"
    )
    monkeypatch.syspath_prepend(str(code))
    from private_models import Net  # type: ignore[import-not-found]

    path = _write(tmp_path / "c.pt", Net(), (torch.ones(1, 2),), {})
    result = _repro(path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"nanwatch repro: capsule '{path}': its module's class private_models:Net cannot be imported here "
        "(ModuleNotFoundError: No module named 'private_models'); run nanwatch repro where the code that defines it "
        "imports (its project's folder, or with it on PYTHONPATH)\n"
    )
    result = _repro(path, cwd=code)  # from the project's folder, it imports
    assert result.returncode == 0, result.stderr
