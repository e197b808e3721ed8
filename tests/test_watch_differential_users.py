"""Differential tests on what users' code does around a module call: each frame shows what the call returned, as
transformers' `DebugUnderflowOverflow` (the oracle) does, or says it cannot.

- a caller that starts changing a Linear's output in place at a later batch (`h.mul_(0.5)`, as masking on padded
  batches does);
- another tool's forward hook, after nanwatch's, that starts halving an output in place at a later batch;
- `torch.func.functional_call` with a weight that holds inf at one batch;
- a parametrization (`torch.nn.utils.parametrize`) whose weight goes inf at one batch;
- a caller whose in-place change overflows a Linear's output from a later batch: the inf is born in the caller's code;
- a module called twice in one forward, its second call's output changed in place by the caller.

nanwatch measures some calls' outputs at the end of the micro-batch instead of as they return
(core/engine/recording/deferral.py).
Where an output was changed in place after its call before that, the frame cannot show what the call returned: its
line says "changed in place after the call: not measured", and no culprit is drawn from it. Every other line must be
the oracle's, digit for digit, and the module named culprit must be the oracle's. From the batch after, the module is
measured as it returns, so its frames are the oracle's again.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tests.models import Scale
from tests.test_watch_differential import MODULE_LINE, module_of, parse_oracle, split_report
from torch import nn

import nanwatch
from nanwatch import NonFiniteError

debug_utils = pytest.importorskip("transformers.debug_utils")

SEED = 99
CHANGED = "changed in place after the call: not measured"


class BoostsAtBatch4(nn.Module):
    """`fc`, `act`, `head`, then `boost`, which overflows at batch 4; with `changes`, the caller halves `fc`'s output
    in place from batch 2."""

    def __init__(self, changes: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.Tanh()
        self.head = nn.Linear(8, 4)
        self.boost = Scale()
        self.changes = changes
        self.batch = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(x)
        if self.changes and self.batch >= 2:
            hidden.mul_(0.5)  # the caller changes what `fc` returned
        self.boost.factor = math.inf if self.batch == 4 else 1.0
        return self.boost(self.head(self.act(hidden)))


class CallerOverflows(nn.Module):
    """The caller multiplies `fc`'s output in place past float32's max from batch 3: the inf is born in the caller's
    code, after `fc` returned finite values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.batch = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(x)
        if self.batch >= 3:
            hidden.mul_(1e39)
        return self.head(hidden)


class TwiceSecondChanged(nn.Module):
    """One Linear called twice; the caller scales the second call's output in place from batch 2; `boost` overflows at
    batch 4."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.boost = Scale()
        self.batch = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.block(x)
        second = self.block(first.tanh())
        if self.batch >= 2:
            second.mul_(3.0)
        self.boost.factor = math.inf if self.batch == 4 else 1.0
        return self.boost(self.head(second))


def _halving_hook(model: nn.Module) -> None:
    """Another tool's forward hook on `fc`, registered after nanwatch's (or transformers'), halving its output in place
    from batch 2."""

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if model.batch >= 2:
            output.mul_(0.5)

    model.fc.register_forward_hook(hook)


@dataclass
class Case:
    build: Callable[[], nn.Module]
    after_watch: Callable[[nn.Module], None]  # what the user does once the tool is on
    call: Callable[[nn.Module, torch.Tensor, int], Any]
    culprit: str
    changed: set[tuple[int, str, str]]  # (batch, module, line) nanwatch cannot show: changed before it measured
    producer: str  # what the culprit line says of where the value was born


def _plain_call(model: nn.Module, x: torch.Tensor, batch: int) -> Any:
    return model(x)


def _functional_call(model: nn.Module, x: torch.Tensor, batch: int) -> Any:
    params = dict(model.named_parameters())
    if batch == 3:  # the weights the call uses hold an inf; the module's own do not
        params = {name: value.detach().clone() for name, value in params.items()}
        params["fc.weight"][0, 0] = math.inf
    return torch.func.functional_call(model, params, (x,))


def _nothing(model: nn.Module) -> None:
    return None


class _Scaled(nn.Module):
    """A parametrization: the weight the call uses is the registered one times `factor` (inf from batch 3)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.batch_of = lambda: model.batch  # not a submodule: the model holds this one

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * (math.inf if self.batch_of() >= 3 else 1.0)


def _parametrized() -> nn.Module:
    model = BoostsAtBatch4()
    torch.nn.utils.parametrize.register_parametrization(model.fc, "weight", _Scaled(model))
    return model


CASES = {
    "caller-changes-output-from-batch-2": Case(
        lambda: BoostsAtBatch4(changes=True), _nothing, _plain_call, "boost", {(2, "fc", "output")}, "boost (Scale)"
    ),
    "other-tool-hook-halves-from-batch-2": Case(
        BoostsAtBatch4, _halving_hook, _plain_call, "boost", {(2, "fc", "output")}, "boost (Scale)"
    ),
    "functional-call-inf-weight": Case(
        BoostsAtBatch4,
        _nothing,
        _functional_call,
        "fc",
        set(),
        "weight of fc (Linear) was already non-finite when this forward ran",
    ),
    # The weight `fc` uses is its parametrization's output, recorded as that module's frame, which both name.
    "parametrized-weight-inf": Case(
        _parametrized,
        _nothing,
        _plain_call,
        "fc.parametrizations.weight.0",
        set(),
        "produced by fc.parametrizations.weight.0 (_Scaled): inputs finite",
    ),
    # Both end at `head`, whose input holds the inf; nanwatch's culprit line says where it was born: the model's own
    # code, never `fc`, whose output it could not measure.
    "caller-overflows-output-from-batch-3": Case(
        CallerOverflows,
        _nothing,
        _plain_call,
        "head",
        {(3, "fc", "output")},
        "the top-level model (CallerOverflows) in its own code, outside its watched submodules",
    ),
    "module-called-twice-second-changed": Case(
        TwiceSecondChanged, _nothing, _plain_call, "boost", {(2, "block", "output")}, "boost (Scale)"
    ),
}


def _run(case: Case, tool: Callable[[nn.Module], Any]) -> tuple[Any, int]:
    torch.manual_seed(SEED)
    model = case.build()
    handle = tool(model)
    case.after_watch(model)
    for batch in range(6):
        model.batch = batch
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(batch))
        try:
            case.call(model, x, batch)
            if isinstance(handle, nanwatch.WatchHandle):
                handle.step()
        except (NonFiniteError, ValueError) as error:
            if isinstance(handle, nanwatch.WatchHandle):
                handle.close()
            return error, batch
    raise AssertionError("nothing detected")


def _frames_by_batch(frames: list[str], batches: list[int]) -> dict[tuple[int, int], str]:
    """Each frame keyed by (batch, its place among that batch's frames)."""
    seen: dict[int, int] = {}
    keyed = {}
    for frame, batch in zip(frames, batches, strict=True):
        keyed[batch, seen.get(batch, 0)] = frame
        seen[batch] = seen.get(batch, 0) + 1
    return keyed


@pytest.mark.parametrize("name", list(CASES))
def test_each_frame_shows_what_the_call_returned_or_says_it_cannot(name: str) -> None:
    case = CASES[name]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        _, oracle_batch = _run(case, lambda model: debug_utils.DebugUnderflowOverflow(model, max_frames_to_save=60))
    oracle = parse_oracle(buffer.getvalue())
    error, batch = _run(case, lambda model: nanwatch.watch(model, max_frames_to_save=60))
    assert isinstance(error, NonFiniteError)
    assert batch == oracle_batch
    assert oracle.header[0] == f"Detected inf/nan during batch_number={batch}"
    assert error.module_name == case.culprit == module_of(oracle.frames[-1])

    header, frames, _ = split_report(error.report)
    assert header == oracle.header
    assert len(frames) == len(oracle.frames)
    mine = _frames_by_batch(frames, oracle.frame_batches)
    theirs = _frames_by_batch(oracle.frames, oracle.frame_batches)
    not_measured = set()
    for key, frame in mine.items():
        ours, expected = frame.splitlines(), theirs[key].splitlines()
        assert ours[0] == expected[0], f"batch {key[0]}: another module"
        assert len(ours) == len(expected)
        for line, oracle_line in zip(ours[1:], expected[1:], strict=True):
            label = oracle_line[18:]
            if line.strip().startswith(CHANGED):
                assert line.endswith(f" {label}")
                found = MODULE_LINE.match(ours[0])
                assert found is not None
                not_measured.add((key[0], found.group(1), label))
            else:
                assert line == oracle_line, f"batch {key[0]} {ours[0].strip()}"
    assert not_measured == case.changed
    assert error.culprit is not None
    assert CHANGED not in error.culprit.message
    assert case.producer in error.culprit.message
