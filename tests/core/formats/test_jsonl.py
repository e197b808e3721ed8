"""core/formats/jsonl_schema.py, jsonl_writer.py, jsonl_reader.py: every report and trace line as a JSON record
(schema 2, derived from the statistics registry), read back to exactly the text nanwatch wrote; version 1 files still
read."""

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
from nanwatch.core.formats.jsonl_reader import read_blocks, read_records, split_blocks
from nanwatch.core.formats.jsonl_schema import SCHEMA_VERSION, LineRecord
from nanwatch.core.formats.jsonl_writer import dumps, report_records
from nanwatch.core.frames import Direction, ResolvedEntry, ResolvedFrame, Role
from nanwatch.core.report import Report
from nanwatch.core.stats.base import decode_number, encode_number
from nanwatch.core.watcher import Watcher
from nanwatch.errors import JsonlError

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.report_lines import capsule_line  # noqa: E402
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
    "direction",
    "label",
    "role",
    "dtype",
    "shape",
    "abs_min",
    "abs_max",
    "nan",
    "inf",
    "subnormal",
    "target_subnormal",
    "target_zero",
    "note",
    "report_batch",
    "report_module",
    "report_frames",
    "report_culprit",
    "report_footer",
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
    # The frames end at the blank line before the footer: the cause, the repro capsule's line and the culprit line.
    # Every record carries the footer, and the culprit line on its own.
    body, footer = text.rstrip("\n").split("\n\n")
    cause = json.loads((tmp_path / "nanwatch-report-rank0-batch2.json").read_text())["cause"]
    assert (cause["kind"], cause["module"]) == ("precision", "amp")  # x * 1e5 passes float16's max: finite in float32
    assert cause["capsule"] == str(tmp_path / "nanwatch-capsule-rank0-batch2.pt")
    *ours, culprit = footer.splitlines()
    assert ours == [f"cause: {cause['kind']}: {cause['evidence']}", capsule_line(cause["capsule"])]
    assert {record["report_culprit"] for record in records} == {culprit}
    assert {record["report_footer"] for record in records} == {"\n\n" + footer}
    assert culprit.startswith("first non-finite value produced by amp (Amplify): inputs finite")
    tensor_lines = [line for line in body.splitlines()[3:] if not line.startswith(" " * 18)]
    assert len(records) == len(tensor_lines)
    frames = [record["frame"] for record in records]
    assert frames == sorted(frames)
    assert frames[0] == 0
    assert frames[-1] + 1 == int(text.splitlines()[1].split()[1])  # "Last N forward frames:"
    assert {record["report_frames"] for record in records} == {frames[-1] + 1}
    assert {(r["direction"], r["role"]) for r in records if r["label"] == "weight"} == {("forward", "parameter")}
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
    assert (injected.column("nan"), injected.column("inf")) == (1, 2)
    assert isinstance(injected.abs_max, float)
    assert math.isnan(injected.abs_max)
    after = by_line[("2", "output")]  # a Linear fed one nan row and one row with -inf: whole rows go nan
    nan, inf = after.column("nan"), after.column("inf")
    assert nan is not None
    assert nan > 0
    assert inf is not None
    assert nan + inf == 4
    clean = by_line[("0", "weight")]
    assert (clean.column("nan"), clean.column("inf")) == (0, 0)
    # The report of the same batch has no tensors left: its non-finite lines say "not measured".
    report = {(r.module, r.label): r for r in read_records(tmp_path / "nanwatch-report-rank0-batch1.jsonl")}
    assert (report[("1", "output")].column("nan"), report[("1", "output")].column("inf")) == (None, None)
    assert (report[("0", "weight")].column("nan"), report[("0", "weight")].column("inf")) == (0, 0)


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
    watcher.end_batch()
    watcher.close(check=False)
    text = (tmp_path / "nanwatch-trace-rank1.txt").read_text()
    assert "*** Starting batch number=0 on rank 1 ***" in text
    (block,) = read_blocks(str(trace_path(tmp_path, rank=1)))
    assert (block.rank, block.world_size) == (1, 2)
    assert block.to_text() + "\n" == text


def test_a_frame_without_lines_keeps_its_module_line(tmp_path: Path) -> None:
    frames = [
        ResolvedFrame("empty", "NoOutput", 4, "eval", ()),
        ResolvedFrame("", "Net", 4, "eval", (ResolvedEntry("output", Role.OUTPUT, 0, 2.5, "float32", (2,), None),)),
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
        "newer.jsonl": (good[0] + "\n" + good[1].replace('"version":2', '"version":3') + "\n", "newer.jsonl:2"),
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
    with pytest.raises(JsonlError, match="schema version 3"):
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
        label="grad output[0]",
        dtype="bfloat16",
        shape=(2, 3),
        abs_min=-math.inf,
        abs_max=math.inf,
        note=None,
        direction=Direction.BACKWARD,
        role=Role.OUTPUT,
        stats={"non_finite_counts": (0, 6), "underflow": (3, None, None)},
    )
    again = LineRecord.from_dict(json.loads(dumps([record])))
    assert again == record
    assert again.shown_class == "Linear (backward)"


def _v1(**changes: object) -> str:
    """A record as nanwatch wrote them before schema 2 (meaning only in the class and label text)."""
    record: dict[str, object] = {
        "version": 1, "kind": "report", "rank": 0, "world_size": 1, "phase": "train", "batch": 3,
        "optimizer_step": None, "epoch": None, "frame": 0, "module": "0", "class": "Linear", "label": "weight",
        "dtype": "float32", "shape": [2, 2], "abs_min": 0.5, "abs_max": 2.0, "nan": 0, "inf": 0, "note": None,
        "report_batch": 3, "report_module": "0", "report_culprit": "the culprit line",
    }  # fmt: skip
    record.update(changes)
    return json.dumps(record)


def test_version_1_files_still_read_with_their_meaning_recovered_from_the_text(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    lines = [
        _v1(),
        _v1(frame=1, **{"class": "Linear (backward)"}, label="grad output", abs_max="inf", nan=None, inf=None),
        _v1(frame=1, **{"class": "Linear (backward)"}, label="grad weight"),
    ]
    path.write_text("\n".join(lines) + "\n")
    records = read_records(path)
    assert [(r.direction, r.role, r.class_name) for r in records] == [
        (Direction.FORWARD, Role.PARAMETER, "Linear"),
        (Direction.BACKWARD, Role.OUTPUT, "Linear"),
        (Direction.BACKWARD, Role.PARAMETER, "Linear"),
    ]
    assert records[0].stats == {"non_finite_counts": (0, 0)}
    (block,) = split_blocks(records)
    text = block.to_text()
    assert "                  0 Linear (backward)\n" in text
    assert text.endswith("\n\nthe culprit line")


def test_underflow_counts_reach_the_jsonl_as_they_reach_the_json(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4)).half()
    with torch.no_grad():
        model[0].weight.fill_(1e-6)  # subnormal in float16 (smallest normal: 6.1e-5)
        model[0].bias.fill_(float("inf"))
    with nanwatch.watch(model, count_underflow=True, report_dir=tmp_path) as handle:
        model(torch.ones(2, 4).half())
        with pytest.raises(nanwatch.NonFiniteError):
            handle.step()
    entries = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text())["frames"][0]["entries"]
    weight_json = next(entry for entry in entries if entry["label"] == "weight")
    assert weight_json["underflow"] == {"subnormal": 16, "target_subnormal": None, "target_zero": None}
    records = read_records(tmp_path / "nanwatch-report-rank0-batch0.jsonl")
    weight = next(record for record in records if record.label == "weight")
    assert (weight.column("subnormal"), weight.column("target_subnormal"), weight.column("target_zero")) == (
        16,
        None,
        None,
    )


def test_a_report_under_a_grad_scaler_reads_back_with_its_loss_scale_line(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with nanwatch.watch(model, optimizer=optimizer, scaler=scaler, report_dir=tmp_path) as handle:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
        model(torch.ones(1, 2)).sum()
        with pytest.raises(nanwatch.NonFiniteError):
            handle.step()
    text = (tmp_path / "nanwatch-report-rank0-batch0.txt").read_text()
    assert "\nLoss scale (GradScaler): 4 at batch 0;" in text
    (block,) = read_blocks(str(tmp_path / "nanwatch-report-rank0-batch0.jsonl"))
    assert block.to_text() + "\n" == text
