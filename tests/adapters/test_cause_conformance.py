"""The cause of a detection, named with its evidence, in every framework: the same runs through the plain loop,
Lightning, Accelerate and the HF Trainer (tests/adapters/conformance/), each cause made to happen at micro-batch K.

The plain loop's finer cases (keyword inputs, rounding told from range, the capsule, sentinel mode, the clean path):
tests/core/features/test_cause.py.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest
from tests.adapters.conformance.common import Outcome, Scenario

from nanwatch import NonFiniteError
from nanwatch.core.features.cause import Cause

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("fresh_accelerate_state"),
    pytest.mark.filterwarnings(
        "ignore:.*does not have many workers.*",
        "ignore:.*isinstance\\(treespec, LeafSpec\\).*",
        "ignore:.*smaller than the logging interval.*",
    ),
]

ADAPTERS = ["plain", "lightning", "accelerate", "hf_trainer"]
K = 2  # the micro-batch where the cause happens (not the first: Lightning's model is called through its children)


@pytest.fixture(params=ADAPTERS)
def harness(request: pytest.FixtureRequest) -> ModuleType:
    return importlib.import_module(f"tests.adapters.conformance.{request.param}_harness")


def _cause(outcome: Outcome) -> tuple[NonFiniteError, Cause]:
    error = outcome.error
    assert isinstance(error, NonFiniteError), f"expected NonFiniteError, the run ended with {outcome.error!r}"
    assert isinstance(error.cause, Cause), error.report
    assert f"cause: {error.cause}" in error.report
    return error, error.cause


def test_data(harness: ModuleType, tmp_path: Path) -> None:
    _, cause = _cause(harness.run(Scenario(inf_at=K, cause="data"), tmp_path))
    assert cause.kind == "data", cause
    # The HF Trainer calls the model with keywords (input.x); the others pass x first (input[0]).
    assert re.search(r"(input\[0\]|input\.x) holds 1 non-finite at \(\d, 1\)", cause.evidence), cause.evidence


@pytest.mark.parametrize(
    ("cause_name", "dtype", "child", "range_overflowed"),
    [("precision16", "float16", "amplify", True), ("precision_bf16", "bfloat16", "rounding", False)],
)
def test_precision(
    harness: ModuleType, tmp_path: Path, cause_name: str, dtype: str, child: str, range_overflowed: bool
) -> None:
    error, cause = _cause(harness.run(Scenario(inf_at=K, cause=cause_name), tmp_path))
    assert cause.kind == "precision", cause
    assert cause.module_name == f"{harness.FAULT_NAME}.{child}"
    assert cause.details["dtype"] == dtype
    assert cause.details["recomputed_in"] == "float32"
    assert cause.details["range_overflowed"] is range_overflowed
    assert error.capsule is not None
    assert Path(error.capsule).is_file()


def test_weights(harness: ModuleType, tmp_path: Path) -> None:
    error, cause = _cause(harness.run(Scenario(inf_at=K, cause="weights"), tmp_path))
    assert cause.kind == "weights", cause
    assert error.born_in_step == cause.born_in_step == K  # the step of micro-batch K (one micro-batch per step)
    assert error.optimizer_step == K + 1
    assert f"boost of {harness.FAULT_NAME} (CauseFault) held inf/nan when the forward began" in cause.evidence
    assert f"born in optimizer step {K}" in cause.evidence


def test_loss(harness: ModuleType, tmp_path: Path) -> None:
    # `F.mse_loss(logits * 1e30, labels)` at micro-batch K: the model's output is finite, the loss alone is inf.
    _, cause = _cause(harness.run(Scenario(loss_inf_at=K), tmp_path))
    if harness.NAME in ("lightning", "accelerate"):  # the framework hands the loss over: it has a frame of its own
        assert cause.kind == "loss", cause
        assert "born outside the model" in cause.evidence
    else:  # the harness's loop and the HF Trainer's compute_loss_func tell nanwatch nothing of the loss
        assert cause.kind == "unknown", cause
        assert "first seen in the gradients" in cause.evidence


# The HF Trainer takes no torch.compile wrapper as its model (it reads the forward's signature to pick the batch's
# columns) and compiles it itself, inside the calls nanwatch could keep: docs/why-nan.md says so.
@pytest.mark.parametrize("harness", ["plain", "lightning", "accelerate"], indirect=True)
def test_compiler(harness: ModuleType, tmp_path: Path) -> None:
    _, cause = _cause(harness.run(Scenario(cause="compiler"), tmp_path))
    assert cause.kind == "compiler", cause
    assert cause.details["backend"] == "wrong_backend"
    assert "run eagerly in the same dtype (float32) gives a finite output" in cause.evidence
