"""errors.py: the exception types carry their data, catch like transformers' ValueError, and survive pickling."""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path

import pytest

from nanwatch import BatchLimitReached, ConfigError, NanwatchError, NanwatchWarning, NonFiniteError, WatchConfig, errors


def _error() -> NonFiniteError:
    return NonFiniteError(
        "nanwatch: inf/nan detected during batch_number=7 on rank 1",
        batch_number=7,
        rank=1,
        module_name="encoder.layer.3.output",
        report="Detected inf/nan during batch_number=7 on rank 1\n...",
        optimizer_step=3,
        epoch=0,
        phase="train",
    )


def test_hierarchy() -> None:
    assert issubclass(NonFiniteError, NanwatchError)
    assert issubclass(NonFiniteError, ValueError)  # code catching transformers' ValueError keeps working
    assert issubclass(BatchLimitReached, NanwatchError)
    assert issubclass(BatchLimitReached, ValueError)
    assert issubclass(NanwatchWarning, UserWarning)
    assert not issubclass(NanwatchWarning, NanwatchError)
    assert issubclass(ConfigError, ValueError)


def test_every_error_nanwatch_raises_on_purpose_is_a_nanwatch_error() -> None:
    # ConfigError was a bare ValueError, although errors.py said every nanwatch error is a NanwatchError.
    for name in errors.__all__:
        kind = getattr(errors, name)
        if kind is not NanwatchWarning:
            assert issubclass(kind, NanwatchError), name
    with pytest.raises(NanwatchError, match="unknown field 'trace_batch_num'"):
        WatchConfig.from_dict({"trace_batch_num": [1]})


def test_errors_import_nothing_from_nanwatch() -> None:
    tree = ast.parse(Path(errors.__file__).read_text(encoding="utf-8"))
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if name and name.split(".")[0] == "nanwatch"]


def test_non_finite_error_carries_its_data() -> None:
    error = _error()
    assert str(error) == "nanwatch: inf/nan detected during batch_number=7 on rank 1"
    assert error.batch_number == 7
    assert error.rank == 1
    assert error.module_name == "encoder.layer.3.output"
    assert error.report.startswith("Detected inf/nan during batch_number=7")
    assert error.optimizer_step == 3
    assert error.epoch == 0
    assert error.phase == "train"


def test_non_finite_error_defaults() -> None:
    error = NonFiniteError("m", batch_number=0, rank=0, module_name=None, report="")
    assert (error.optimizer_step, error.epoch, error.phase) == (None, None, "train")


def test_caught_as_value_error() -> None:
    with pytest.raises(ValueError, match="batch_number=7") as info:
        raise _error()
    assert isinstance(info.value, NonFiniteError)


@pytest.mark.parametrize("clone", [lambda e: pickle.loads(pickle.dumps(e)), copy.copy, copy.deepcopy])
def test_non_finite_error_survives_pickling_and_copying(clone: object) -> None:
    # multiprocessing and Lightning's spawn launcher send exceptions between processes by pickle.
    original = _error()
    restored = clone(original)  # type: ignore[operator]
    assert type(restored) is NonFiniteError
    assert restored is not original
    assert str(restored) == str(original)
    assert restored.args == original.args
    assert vars(restored) == vars(original)


@pytest.mark.parametrize("clone", [lambda e: pickle.loads(pickle.dumps(e)), copy.copy, copy.deepcopy])
def test_batch_limit_reached_survives_pickling_and_copying(clone: object) -> None:
    original = BatchLimitReached("stopping after batch_number=4", batch_number=4)
    restored = clone(original)  # type: ignore[operator]
    assert type(restored) is BatchLimitReached
    assert str(restored) == "stopping after batch_number=4"
    assert restored.batch_number == 4
