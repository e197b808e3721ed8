"""core/jsonl.py: every report and trace line as a JSON record, read back to exactly the text nanwatch wrote."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.core.config import WatchConfig
from nanwatch.core.frames import ResolvedEntry, ResolvedFrame
from nanwatch.core.jsonl import (
    SCHEMA_VERSION,
    JsonlError,
    LineRecord,
    decode_number,
    dumps,
    encode_number,
    read_blocks,
    read_records,
    report_records,
    split_blocks,
)
from nanwatch.core.report import Report
from nanwatch.core.watcher import Watcher

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.trace_models import Inject, run_amp_net, trace_path  # noqa: E402

FIELDS = [
    "version",
    "kind",
    "rank",
    "world_size",
    "phase",
    "batch",
    "optimizer_step",
    "epoch",
    "frame",
    "module",
    "class",
    "label",
    "dtype",
    "shape",
    "abs_min",
    "abs_max",
    "nan",
    "inf",
    "note",
    "report_batch",
    "report_module",
    "report_culprit",
]


def _strict_json(line: str) -> dict[str, object]:
    def refuse(token: str) -> object:
        raise AssertionError(f"non-standard JSON constant {token} in {line}")

    data = json.loads(line, parse_constant=refuse)
    assert isinstance(data, dict)
    return data


def test_non_finite_numbers_round_trip_as_strings() -> None:
    values: list[float | int | None] = [math.inf, -math.inf, 6.5504e4, 1e-45, 0.1, 0, 7, None]
    for value in values:
        encoded = encode_number(value)
        assert json.loads(json.dumps(encoded, allow_nan=False)) == encoded
        decoded = decode_number(encoded)
        assert decoded == value
        assert type(decoded) is type(value)
    assert encode_number(math.inf) == "inf"
    assert encode_number(-math.inf) == "-inf"
    assert encode_number(math.nan) == "nan"
    nan = decode_number("nan")
    assert isinstance(nan, float)
    assert math.isnan(nan)
    with pytest.raises(ValueError, match="'Infinity'"):
        decode_number("Infinity")
    with pytest.raises(ValueError, match="True"):
        decode_number(True)


def test_report_jsonl_holds_one_record_per_line_of_the_text_report(tmp_path: Path) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    text = (tmp_path / "nanwatch-report-rank0-batch2.txt").read_text()
    lines = (tmp_path / "nanwatch-report-rank0-batch2.jsonl").read_text().splitlines()
    records = [_strict_json(line) for line in lines]
    assert all(list(record) == FIELDS for record in records)  # the documented fields, in order
    assert {record["version"] for record in records} == {SCHEMA_VERSION}
    assert {record["kind"] for record in records} == {"report"}
    assert {record["report_batch"] for record in records} == {2}
    assert {record["report_module"] for record in records} == {"amp"}
    # The frames end at the blank line before the culprit line, which every record carries.
    body, culprit = text.rstrip("\n").split("\n\n")
    assert {record["report_culprit"] for record in records} == {culprit}
    assert culprit.startswith("first non-finite value produced by amp (Amplify): inputs finite")
    tensor_lines = [line for line in body.splitlines()[3:] if not line.startswith(" " * 18)]
    assert len(records) == len(tensor_lines)
    frames = [record["frame"] for record in records]
    assert frames == sorted(frames)
    assert frames[0] == 0
    assert frames[-1] + 1 == int(text.splitlines()[1].split()[1])  # "Last N forward frames:"
    last = records[-1]
    assert (last["module"], last["class"], last["label"]) == ("amp", "Amplify", "output")
    assert (last["abs_max"], last["dtype"], last["shape"], last["batch"]) == ("inf", "float16", [4, 16], 2)
    # A report is built when the tensors are gone: a non-finite line's counts were not measured.
    assert (last["nan"], last["inf"]) == (None, None)
    finite = [r for r in records if r["abs_max"] is not None and r["abs_max"] not in ("inf", "nan")]
    assert finite
    assert all((r["nan"], r["inf"]) == (0, 0) for r in finite)


def test_trace_counts_nan_and_inf_exactly(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), Inject(), nn.Linear(3, 2))
    with nanwatch.watch(model, trace_batch_nums=[1], report_dir=tmp_path) as handle:
        model(torch.randn(2, 3))
        handle.step()
        model[1].armed = True
        model(torch.randn(2, 3))
        with pytest.raises(nanwatch.NonFiniteError):
            handle.step()
    records = read_records(trace_path(tmp_path))
    assert {r.batch for r in records} == {1}  # the untraced batch wrote no trace record
    by_line = {(r.module, r.label): r for r in records}
    injected = by_line[("1", "output")]
    assert (injected.nan, injected.inf) == (1, 2)
    assert isinstance(injected.abs_max, float)
    assert math.isnan(injected.abs_max)
    after = by_line[("2", "output")]  # a Linear fed one nan row and one row with -inf: whole rows go nan
    assert after.nan is not None
    assert after.nan > 0
    assert after.inf is not None
    assert after.nan + after.inf == 4
    clean = by_line[("0", "weight")]
    assert (clean.nan, clean.inf) == (0, 0)
    # The report of the same batch has no tensors left: its non-finite lines say "not measured".
    report = {(r.module, r.label): r for r in read_records(tmp_path / "nanwatch-report-rank0-batch1.jsonl")}
    assert (report[("1", "output")].nan, report[("1", "output")].inf) == (None, None)
    assert (report[("0", "weight")].nan, report[("0", "weight")].inf) == (0, 0)


def test_records_carry_the_counters_and_the_frame_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, optimizer=optimizer, trace_batch_nums=[1, 2], report_dir=tmp_path) as handle:
        handle.epoch = 3
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
    records = read_records(trace_path(tmp_path))
    assert [(r.batch, r.optimizer_step, r.epoch) for r in records if r.label == "weight"] == [(1, 1, 3), (2, 2, 3)]
    batch_two = [r for r in records if r.batch == 2]
    assert [(r.frame, r.module) for r in batch_two if r.label in ("weight", "output")] == [
        (0, "0"),
        (0, "0"),
        (1, "1"),
        (2, ""),
    ]
    # Two consecutive traced batches: each gets its own block, and the text trace a header for each.
    blocks = split_blocks(records)
    assert [(b.kind, b.batch) for b in blocks] == [("trace", 1), ("trace", 2)]
    text = (tmp_path / "nanwatch-trace-rank0.txt").read_text()
    assert text.count("*** Starting batch number=1 ***") == 1
    assert text.count("*** Starting batch number=2 ***") == 1
    assert "".join(block.to_text() + "\n" for block in blocks) == text


def test_rank_and_world_size_come_back_in_the_text(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    watcher = Watcher(
        model, WatchConfig(trace_batch_nums=[0], trace_ranks="all", report_dir=tmp_path), rank=1, world_size=2
    )
    watcher.attach()
    model(torch.ones(1, 2))
    watcher.end_batch(agree=False)
    watcher.detach()
    text = (tmp_path / "nanwatch-trace-rank1.txt").read_text()
    assert "*** Starting batch number=0 on rank 1 ***" in text
    (block,) = read_blocks(str(trace_path(tmp_path, rank=1)))
    assert (block.rank, block.world_size) == (1, 2)
    assert block.to_text() + "\n" == text


def test_a_frame_without_lines_keeps_its_module_line(tmp_path: Path) -> None:
    frames = [
        ResolvedFrame("empty", "NoOutput", 4, "eval", ()),
        ResolvedFrame("", "Net", 4, "eval", (ResolvedEntry("output", 0, 2.5, "float32", (2,), None),)),
    ]
    report = Report(batch_number=4, phase="eval", rank=0, world_size=1, module_name="", frames=frames, epoch=1)
    path = tmp_path / "r.jsonl"
    path.write_text(dumps(report_records(report)))
    records = read_records(path)
    assert [(r.module, r.label, r.frame) for r in records] == [("empty", None, 0), ("", "output", 1)]
    (block,) = split_blocks(records)
    assert block.to_text() == report.to_text()
    assert block.to_text().startswith("Detected inf/nan during eval_batch_number=4\n")


def test_reading_a_file_nanwatch_did_not_write_names_the_line(tmp_path: Path) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    good = trace_path(tmp_path).read_text().splitlines()
    cases = {
        "text.jsonl": ("abs min  abs max  metadata\n", "text.jsonl:1 is not JSON"),
        "newer.jsonl": (good[0] + "\n" + good[1].replace('"version":1', '"version":2') + "\n", "newer.jsonl:2"),
        "missing.jsonl": (good[0].replace('"label":"weight",', "") + "\n", "field 'label' is missing"),
        "typed.jsonl": (good[0].replace('"batch":0', '"batch":"0"') + "\n", "field 'batch' must be int"),
        "number.jsonl": (good[0].replace('"abs_max":', '"abs_max":"Infinity","x":') + "\n", "abs_max must be"),
        "empty.jsonl": ("\n", "holds no records"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(JsonlError, match=message.replace("(", r"\(")):
            read_records(path)
    with pytest.raises(JsonlError, match="schema version 2"):
        read_records(tmp_path / "newer.jsonl")
    with pytest.raises(JsonlError, match="cannot read"):
        read_records(tmp_path / "absent.jsonl")
    with pytest.raises(JsonlError, match="holds no batch 7; it holds batch 0"):
        read_blocks(f"{trace_path(tmp_path)}:7")


def test_line_record_round_trips_through_its_dict() -> None:
    record = LineRecord(
        kind="trace",
        rank=0,
        world_size=1,
        phase="train",
        batch=5,
        optimizer_step=None,
        epoch=None,
        frame=2,
        module="a.b",
        class_name="Linear",
        label="output[0]",
        dtype="bfloat16",
        shape=(2, 3),
        abs_min=-math.inf,
        abs_max=math.inf,
        nan=0,
        inf=6,
        note=None,
    )
    again = LineRecord.from_dict(json.loads(dumps([record])))
    assert again == record
