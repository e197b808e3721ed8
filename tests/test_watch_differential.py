"""Differential tests: `nanwatch.watch()` reports exactly the frames transformers' `DebugUnderflowOverflow` reports.

The same model is built twice from the same seed and fed the same batches: once under transformers' class (the
oracle), once under `nanwatch.watch(model, max_frames_to_save=K)` with `handle.step()` after each forward. The report
in `NonFiniteError.report`, and the JSON and text written to `report_dir`, must hold the frames transformers prints:
the last K frames ending at the first frame with inf/nan, with the same header. Transformers puts the lines
`*** Starting batch number=N ***` and `abs min  abs max  metadata` inside its frames; those (and blank lines) are
dropped from its output before the frames are compared, and used to check which batch each frame belongs to.

The models return tensors, None, numbers or tuples (at most two deep) of them: nanwatch walks lists, dicts and
ModelOutputs where transformers prints "not a tensor", so the transformers model is called with `return_dict=False`.

nanwatch also records the tensors a module gets as keyword arguments (`input.attention_mask`), which transformers'
forward hooks never see: those lines, and only those, are taken out of nanwatch's frames before they are compared
(GPT-2 passes its attention blocks their mask and positions that way, so the GPT-2 cases check they are there).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models import MLP, MLP_FRAMES_PER_BATCH, OverflowsInItsOwnForward, Twice, loud_mlp, tiny_gpt2_config
from tests.report_lines import cause_tail
from torch import nn

import nanwatch
from nanwatch import NonFiniteError

debug_utils = pytest.importorskip("transformers.debug_utils")
transformers = pytest.importorskip("transformers")

SEED = 4321
INF = float("inf")
NAN = float("nan")
TABLE_HEADER = "abs min  abs max  metadata"
BATCH_MARK = re.compile(r"^ {17} \*\*\* Starting batch number=(\d+) \*\*\*$")
MODULE_LINE = re.compile(r"^ {17} (\S*) (\S+)$")
KEYWORD_LINE = re.compile(r"^.{17} input\.[A-Za-z_]\w*$")  # a keyword input's line: `0.00e+00 7.00e+00 input.mask`

Forward = Callable[[nn.Module, int], None]


# ------------------------------------------------------------------------------------------------- models
# (MLP, loud_mlp, Twice and OverflowsInItsOwnForward, which both differential tests use: tests/models.py)


def positive_mlp() -> MLP:
    """The first Linear's weights are all positive: a -inf input makes its whole row -inf, which the ReLU zeroes."""
    model = MLP()
    with torch.no_grad():
        model.body[0].weight.abs_()
    return model


class Split(nn.Module):
    """Takes None and a float; returns a tensor, None, a float and a tuple of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: None, scale: float) -> tuple[Any, ...]:
        h = self.proj(x) * scale
        return h, None, scale, (h.relu(), h.tanh())


class SplitTupleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = Split()
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        h, _, _, (r, t) = self.split(x, None, 2.0)
        return self.head(h + r), None, (r, t)


def gpt2_fp16(scale: float) -> Callable[[], nn.Module]:
    """A tiny random GPT-2 in fp16 whose `h.1.mlp.c_fc` weight is multiplied by `scale` (it stays finite)."""

    def build() -> nn.Module:
        model = transformers.GPT2Model(tiny_gpt2_config()).half().train()
        with torch.no_grad():
            model.h[1].mlp.c_fc.weight.mul_(scale)
        return model

    return build


GPT2_FRAMES_PER_BATCH = 33


# ------------------------------------------------------------------------------------------------- inputs


def float_forward(poison: dict[int, float] | None = None) -> Forward:
    """Forward batch `index` of random floats, with `poison[index]` written into one element."""
    poison = poison or {}

    def forward(model: nn.Module, index: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(index))
        if index in poison:
            x[1, 3] = poison[index]
        model(x)

    return forward


def gpt2_forward(model: nn.Module, index: int) -> None:
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(index))
    model(ids, return_dict=False, use_cache=False)


def sgd_step(model: nn.Module) -> None:
    """A training update between batches, so later frames show weights changed in place."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9).add_(0.01)


def data_step(model: nn.Module) -> None:
    """An update through `.data`, as older loops and EMA code do: it bypasses the tensors' version counters."""
    for param in model.parameters():
        param.data.mul_(0.9).add_(0.01)


def grow_gpt2(model: nn.Module) -> None:
    """The weights blow up as training goes on: x20 per batch, until a fp16 matmul passes 65504."""
    with torch.no_grad():
        model.h[1].mlp.c_fc.weight.mul_(20)


def no_update(model: nn.Module) -> None:
    return None


# ------------------------------------------------------------------------------------------------- running


@dataclass
class Scenario:
    build: Callable[[], nn.Module]
    forward: Forward
    update: Callable[[nn.Module], None]
    batches: int
    detect_batch: int  # the batch in which inf/nan first appears
    culprit: str  # the module whose frame first holds it
    cause: str  # the cause's kind: "data" (inf/nan in the batch), "precision" (a finite input overflowed the dtype)


SCENARIOS = {
    "mlp-overflow-midway-batch0": Scenario(loud_mlp, float_forward({0: 3e37}), no_update, 2, 0, "body.2", "precision"),
    "mlp-inf-batch2-training": Scenario(MLP, float_forward({2: INF}), sgd_step, 4, 2, "body.0", "data"),
    "mlp-overflow-midway-batch3": Scenario(loud_mlp, float_forward({3: 3e37}), sgd_step, 5, 3, "body.2", "precision"),
    "mlp-inf-batch2-data-updates": Scenario(MLP, float_forward({2: INF}), data_step, 4, 2, "body.0", "data"),
    "mlp-inf-hidden-by-inplace-relu": Scenario(
        positive_mlp, float_forward({1: -INF}), no_update, 3, 1, "body.0", "data"
    ),
    "tuples-nan-batch2": Scenario(SplitTupleModel, float_forward({2: NAN}), no_update, 4, 2, "split.proj", "data"),
    "twice-inf-batch1": Scenario(Twice, float_forward({1: INF}), sgd_step, 3, 1, "block", "data"),
    "gpt2-fp16-overflow-batch0": Scenario(gpt2_fp16(3e5), gpt2_forward, no_update, 2, 0, "h.1.mlp.c_fc", "precision"),
    "gpt2-fp16-overflow-batch2": Scenario(gpt2_fp16(1e3), gpt2_forward, grow_gpt2, 4, 2, "h.1.mlp.c_fc", "precision"),
}

# (scenario, K): K below, at and above one batch's frame count, so reports span one, two and three batches.
CASES = [
    ("mlp-overflow-midway-batch0", 1),
    ("mlp-overflow-midway-batch0", 2),
    ("mlp-overflow-midway-batch0", None),  # the default, 21: more frames than the run has
    ("mlp-inf-batch2-training", 1),
    ("mlp-inf-batch2-training", 4),
    ("mlp-inf-batch2-training", MLP_FRAMES_PER_BATCH),
    ("mlp-inf-batch2-training", MLP_FRAMES_PER_BATCH + 3),
    ("mlp-inf-batch2-training", 2 * MLP_FRAMES_PER_BATCH + 1),  # exactly every frame of the run
    ("mlp-inf-batch2-training", 40),
    ("mlp-overflow-midway-batch3", 12),
    ("mlp-inf-batch2-data-updates", 2 * MLP_FRAMES_PER_BATCH + 1),
    ("mlp-inf-hidden-by-inplace-relu", 5),
    ("tuples-nan-batch2", 2),
    ("tuples-nan-batch2", 6),
    ("tuples-nan-batch2", 20),
    ("twice-inf-batch1", 3),
    ("twice-inf-batch1", 9),
    ("gpt2-fp16-overflow-batch0", None),
    ("gpt2-fp16-overflow-batch2", 5),
    ("gpt2-fp16-overflow-batch2", GPT2_FRAMES_PER_BATCH + 7),
    ("gpt2-fp16-overflow-batch2", 2 * GPT2_FRAMES_PER_BATCH + 10),
]


def run_oracle(scenario: Scenario, size: int | None) -> tuple[str, int]:
    """transformers' stdout, and the batch whose forward raised."""
    torch.manual_seed(SEED)
    model = scenario.build()
    torch.manual_seed(SEED + 1)  # dropout masks: the same in both runs
    kwargs = {} if size is None else {"max_frames_to_save": size}
    debug_utils.DebugUnderflowOverflow(model, **kwargs)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        for index in range(scenario.batches):
            try:
                scenario.forward(model, index)
            except ValueError:
                return buffer.getvalue(), index
            scenario.update(model)
    raise AssertionError(f"transformers detected nothing in {scenario.batches} batches:\n{buffer.getvalue()}")


def run_watch(scenario: Scenario, size: int | None, report_dir: Path) -> tuple[NonFiniteError, int]:
    """nanwatch's error, and the batch whose `step()` raised it."""
    torch.manual_seed(SEED)
    model = scenario.build()
    torch.manual_seed(SEED + 1)
    overrides: dict[str, Any] = {"report_dir": report_dir}
    if size is not None:
        overrides["max_frames_to_save"] = size
    with nanwatch.watch(model, **overrides) as handle:
        for index in range(scenario.batches):
            scenario.forward(model, index)
            try:
                handle.step()
            except NonFiniteError as error:
                return error, index
            scenario.update(model)
    raise AssertionError(f"nanwatch detected nothing in {scenario.batches} batches")


@dataclass
class OracleReport:
    header: list[str]  # "Detected inf/nan during batch_number=N", "Last K forward frames:", the table header
    frames: list[str]  # each frame's text, its batch-start lines and blank lines dropped
    frame_batches: list[int]  # the batch each frame belongs to, from transformers' batch-start lines


def parse_oracle(stdout: str) -> OracleReport:
    _, dump = stdout.split("\nDetected inf/nan", 1)
    lines = ("Detected inf/nan" + dump).splitlines()
    header, body = lines[:3], lines[3:]
    frames: list[list[str]] = []
    marks: list[int | None] = []
    mark: int | None = None
    for line in body:
        found = BATCH_MARK.match(line)
        if found:
            mark = int(found.group(1))
        elif not line.strip() or line == TABLE_HEADER:
            continue
        elif MODULE_LINE.match(line):
            frames.append([line])
            marks.append(mark)
            mark = None
        else:
            frames[-1].append(line)
    # A frame is in the batch its last batch-start line names; frames before the first such line are in the one before.
    batches: list[int] = []
    batch = int(header[0].rsplit("=", 1)[1])
    known = [m for m in marks if m is not None]
    current = known[0] - 1 if known else batch
    for m in marks:
        current = m if m is not None else current
        batches.append(current)
    return OracleReport(header, ["\n".join(frame) for frame in frames], batches)


def module_of(frame: str) -> str:
    found = MODULE_LINE.match(frame.splitlines()[0])
    assert found is not None, frame
    return found.group(1)


def split_report(text: str) -> tuple[list[str], list[str], list[str]]:
    """nanwatch's report text: its three header lines, each frame's text, and what follows the frames.

    The frames end at the first blank line (no frame holds one); after it nanwatch adds its own lines (the cause,
    the repro capsule's, the culprit).
    """
    lines = text.splitlines()
    body = lines[3:]
    end = body.index("") if "" in body else len(body)
    frames: list[list[str]] = []
    for line in body[:end]:
        if MODULE_LINE.match(line):
            frames.append([line])
        else:
            frames[-1].append(line)
    return lines[:3], ["\n".join(frame) for frame in frames], body[end:]


def without_keyword_lines(frames: list[str]) -> tuple[list[str], list[str]]:
    """nanwatch's frames without the lines of keyword inputs (transformers' tool does not see them), and those lines."""
    kept, keyword = [], []
    for frame in frames:
        lines = frame.splitlines()
        keyword += [line for line in lines[1:] if KEYWORD_LINE.match(line)]
        kept.append("\n".join(line for line in lines if not KEYWORD_LINE.match(line)))
    return kept, keyword


def render_json_frames(document: dict[str, Any]) -> list[str]:
    """The JSON report's frames, written out in transformers' line format by this test (not by nanwatch)."""
    rendered = []
    for frame in document["frames"]:
        lines = [f"{' ' * 17} {frame['module']} {frame['class']}"]
        for entry in frame["entries"]:
            if entry["abs_min"] is None:
                lines.append(f"{entry['note']:>17} {entry['label']}")
            else:
                lines.append(f"{float(entry['abs_min']):8.2e} {float(entry['abs_max']):8.2e} {entry['label']}")
        rendered.append("\n".join(lines))
    return rendered


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("name", "size"), CASES, ids=[f"{name}-K{size}" for name, size in CASES])
def test_watch_reports_the_frames_transformers_reports(name: str, size: int | None, tmp_path: Path) -> None:
    scenario = SCENARIOS[name]
    stdout, oracle_batch = run_oracle(scenario, size)
    oracle = parse_oracle(stdout)
    error, watch_batch = run_watch(scenario, size, tmp_path)

    # The scenario does what it says, judged on the oracle alone.
    assert oracle_batch == scenario.detect_batch
    assert oracle.header[0] == f"Detected inf/nan during batch_number={scenario.detect_batch}"
    assert module_of(oracle.frames[-1]) == scenario.culprit
    assert oracle.header[1] == f"Last {len(oracle.frames)} forward frames:"
    assert len(oracle.frames) <= (size or 21)

    # The report text: the same header, the same frames (and keyword inputs), then only nanwatch's own lines: the
    # cause, the repro capsule where the culprit's call was captured (a precision overflow: the culprit ran again; an
    # inf/nan in the batch needs no rerun), and the culprit line.
    header, frames, tail = split_report(error.report)
    assert header == oracle.header
    assert header[2] == TABLE_HEADER
    frames, keyword_lines = without_keyword_lines(frames)
    assert frames == oracle.frames
    assert bool(keyword_lines) == name.startswith("gpt2"), keyword_lines
    assert error.culprit is not None
    assert error.cause is not None
    assert error.cause.kind == scenario.cause
    capsule = tmp_path / f"nanwatch-capsule-rank0-batch{scenario.detect_batch}.pt"
    if scenario.cause == "precision":
        assert error.cause.module_name == scenario.culprit
        assert error.capsule == str(capsule)
        assert capsule.is_file()
    else:
        assert error.cause.module_name == ""  # the top-level model's input
        assert error.capsule is None
        assert not capsule.exists()
    ours = cause_tail(error, error.capsule)
    assert tail[: len(ours)] == ours
    # Then, where a frame of the detection holds numbers near their dtype's max (the fp16 overflows), the headroom
    # finding, one line per tensor; nothing else.
    assert (len(tail) > len(ours)) == name.startswith("gpt2"), tail
    if len(tail) > len(ours):
        batch = scenario.detect_batch
        assert (
            tail[len(ours)]
            == f"numbers near their dtype's limits in the frames checked with this detection (batch_number={batch}):"
        )
        assert tail[len(ours) + 1 :]
        assert all(line.startswith("  ") and "headroom" in line for line in tail[len(ours) + 1 :]), tail

    # The error and the files in report_dir carry the same.
    assert watch_batch == oracle_batch
    assert error.batch_number == scenario.detect_batch
    assert error.module_name == scenario.culprit
    stem = f"nanwatch-report-rank0-batch{scenario.detect_batch}"
    assert (tmp_path / f"{stem}.txt").read_text(encoding="utf-8") == error.report + "\n"
    document = json.loads((tmp_path / f"{stem}.json").read_text(encoding="utf-8"))
    assert document["batch_number"] == scenario.detect_batch
    assert document["module_name"] == scenario.culprit
    assert document["cause"] == {**error.cause.to_dict(), "capsule": error.capsule}
    assert without_keyword_lines(render_json_frames(document))[0] == oracle.frames
    assert [frame["batch_number"] for frame in document["frames"]] == oracle.frame_batches


def test_a_report_spans_earlier_batches() -> None:
    # Guards the cases above: with K above one batch's frame count, the oracle's report reaches back two batches.
    stdout, _ = run_oracle(SCENARIOS["mlp-inf-batch2-training"], 2 * MLP_FRAMES_PER_BATCH + 1)
    oracle = parse_oracle(stdout)
    assert oracle.frame_batches == [0] * MLP_FRAMES_PER_BATCH + [1] * MLP_FRAMES_PER_BATCH + [2]


def test_inf_hidden_by_an_inplace_relu_is_still_reported_as_recorded() -> None:
    # The Linear's output was all -inf in row 1; the in-place ReLU after it zeroed those values before step() ran.
    stdout, _ = run_oracle(SCENARIOS["mlp-inf-hidden-by-inplace-relu"], 5)
    culprit = parse_oracle(stdout).frames[-1].splitlines()
    assert culprit[0].endswith(" body.0 Linear")
    assert culprit[-1].endswith("      inf output")


def test_only_the_root_overflowing_differs_in_the_header_batch_number(tmp_path: Path) -> None:
    """The one difference: when only the root's own frame holds inf, transformers names the next batch.

    transformers advances its batch counter when the root's hook fires, before it builds the root's frame, so the
    header says batch_number=N+1 for an inf that appeared in batch N. nanwatch says N. The frames are the same.
    """
    scenario = Scenario(OverflowsInItsOwnForward, float_forward({1: 1e3}), no_update, 3, 1, "", "precision")
    stdout, oracle_batch = run_oracle(scenario, 4)
    oracle = parse_oracle(stdout)
    error, watch_batch = run_watch(scenario, 4, tmp_path)
    assert oracle_batch == watch_batch == 1
    assert oracle.header[0] == "Detected inf/nan during batch_number=2"
    header, frames, tail = split_report(error.report)
    assert header[0] == "Detected inf/nan during batch_number=1"
    assert header[1:] == oracle.header[1:]
    assert frames == oracle.frames
    assert error.culprit is not None
    # The root's own product (finite fc output times 1e38) passed float32's max: a precision cause, whose capsule
    # holds the root's call.
    assert error.cause is not None
    assert (error.cause.kind, error.cause.module_name) == ("precision", "")
    assert error.capsule == str(tmp_path / "nanwatch-capsule-rank0-batch1.pt")
    assert tail == cause_tail(error, error.capsule)
    assert error.batch_number == 1
    assert error.module_name == ""
