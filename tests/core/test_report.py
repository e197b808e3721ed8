"""core/report.py: transformers' text format, line for line, and the same frames as structured data."""

from __future__ import annotations

import json

import pytest
import torch

from nanwatch.core.frames import Direction, Entry, RecordedFrame, ResolvedEntry, ResolvedFrame, Role, resolve
from nanwatch.core.report import (
    MODULE_INDENT,
    TABLE_HEADER,
    Report,
    ReportSection,
    format_entry,
    format_frame,
    format_module_line,
    format_note_line,
)
from nanwatch.core.stats.abs_range import format_range
from nanwatch.core.stats.measure import measure


def _frames() -> list[ResolvedFrame]:
    return resolve(
        [
            RecordedFrame(
                "encoder.block.2.layer.1.DenseReluDense.wo",
                "Linear",
                3,
                entries=[
                    Entry("weight", Role.PARAMETER, measure(torch.tensor([1.01e-06, -6.44]))),
                    Entry("input[0]", Role.INPUT, measure(torch.tensor([0.0, 9.74e03]))),
                    Entry("output", Role.OUTPUT, measure(torch.tensor([-3.18e-04, 6.27e04]))),
                ],
            ),
            RecordedFrame(
                "encoder.block.2.layer.1.dropout",
                "Dropout",
                3,
                entries=[
                    Entry("input[0]", Role.INPUT, measure(torch.tensor([3.18e-04, 6.27e04]))),
                    Entry("output", Role.OUTPUT, measure(torch.tensor([0.0, float("inf")], dtype=torch.float16))),
                    Entry("input[1]", Role.INPUT, note="None"),
                    Entry("input[2]", Role.INPUT, note="not a tensor"),
                ],
            ),
        ]
    )


def test_text_report_matches_transformers_layout() -> None:
    report = Report(
        batch_number=3,
        phase="train",
        rank=0,
        world_size=1,
        module_name="encoder.block.2.layer.1.dropout",
        frames=_frames(),
    )
    expected = "\n".join(
        [
            "Detected inf/nan during batch_number=3",
            "Last 2 forward frames:",
            "abs min  abs max  metadata",
            "                  encoder.block.2.layer.1.DenseReluDense.wo Linear",
            "1.01e-06 6.44e+00 weight",
            "0.00e+00 9.74e+03 input[0]",
            "3.18e-04 6.27e+04 output",
            "                  encoder.block.2.layer.1.dropout Dropout",
            "3.18e-04 6.27e+04 input[0]",
            "0.00e+00      inf output",
            "             None input[1]",
            "     not a tensor input[2]",
        ]
    )
    assert report.to_text() == expected


def test_header_names_the_rank_when_distributed_and_the_eval_counter() -> None:
    frames = _frames()
    assert Report(7, "train", 1, 4, None, frames).header == "Detected inf/nan during batch_number=7 on rank 1"
    assert Report(2, "eval", 0, 1, None, frames).header == "Detected inf/nan during eval_batch_number=2"
    assert Report(2, "eval", 3, 8, None, frames).header == "Detected inf/nan during eval_batch_number=2 on rank 3"


def test_module_line_puts_the_name_in_column_19() -> None:
    line = format_module_line("lm_head", "Linear")
    assert line == " " * 18 + "lm_head Linear"
    assert len(MODULE_INDENT) + 1 == 18
    assert TABLE_HEADER == "abs min  abs max  metadata"


def test_note_lines_are_right_aligned_in_17_columns() -> None:
    assert format_note_line("None", "input[1]") == "             None input[1]"
    assert format_note_line("not a tensor", "output") == "     not a tensor output"
    assert format_note_line("empty", "weight") == "            empty weight"
    assert format_entry(ResolvedEntry("x", Role.INPUT, None, None, None, None, None)) == "     not a tensor x"


FLOAT_VALUES = [[1e-8, -3.3e4], [0.0, 1.0], [float("inf"), 2.0], [float("nan"), 1.0], [-1e-45, 3.4e38], [1234.5, 1e-3]]
CASES = [(values, dtype) for values in FLOAT_VALUES for dtype in (torch.float32, torch.float16, torch.bfloat16)] + [
    ([0, -7], torch.int64),
    ([123456789, 3], torch.int32),
    ([-5, 200], torch.uint8),
]


@pytest.mark.parametrize(("values", "dtype"), CASES)
def test_value_lines_match_transformers_get_abs_min_max(values: list[float], dtype: torch.dtype) -> None:
    debug_utils = pytest.importorskip("transformers.debug_utils")
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    (frame,) = resolve([RecordedFrame("m", "M", 0, entries=[Entry("output", Role.OUTPUT, measure(tensor))])])
    assert format_entry(frame.entries[0]) == debug_utils.get_abs_min_max(tensor, "output")


def test_format_range_and_frame() -> None:
    assert format_range(0.5, 65504.0) == "5.00e-01 6.55e+04"
    assert format_range(0, 255) == "0.00e+00 2.55e+02"
    assert format_entry(ResolvedEntry("weight", Role.PARAMETER, 0.5, 65504.0, "float16", (2,), None)) == (
        "5.00e-01 6.55e+04 weight"
    )
    none = ResolvedEntry("output", Role.OUTPUT, None, None, None, None, "None")
    frame = ResolvedFrame("", "GPT2Model", 0, "train", (none,))
    assert format_frame(frame) == "                   GPT2Model\n             None output"
    backward = ResolvedFrame("0", "Linear", 0, "train", (none,), Direction.BACKWARD)
    assert format_frame(backward).splitlines()[0] == "                  0 Linear (backward)"


def test_sections_follow_the_frames_in_order_after_one_blank_line() -> None:
    report = Report(3, "train", 0, 1, "m", _frames())
    scale = ReportSection("loss_scale", 20, ("Loss scale (GradScaler): 65536 at batch 0",), {"current": 65536.0})
    culprit = ReportSection("culprit", 10, ("first non-finite value produced by m",), {"kind": "produced"}, "payload")
    both = report.with_section(scale).with_section(culprit)
    assert (
        both.to_text()
        == report.to_text() + "\n\nfirst non-finite value produced by m\nLoss scale (GradScaler): 65536 at batch 0"
    )
    assert both.footer() == both.to_text()[len(report.to_text()) :]
    assert both.culprit == "payload"
    data = both.to_dict()
    assert list(data)[-2:] == ["loss_scale", "culprit"]
    assert (data["loss_scale"], data["culprit"]) == ({"current": 65536.0}, {"kind": "produced"})
    assert report.to_dict()["culprit"] is None
    assert report.to_dict()["loss_scale"] is None
    replaced = both.with_section(ReportSection("culprit", 10, ("another",), None))
    assert replaced.to_text().endswith("\n\nanother\nLoss scale (GradScaler): 65536 at batch 0")


def test_a_report_with_backward_frames_says_so() -> None:
    frame = ResolvedFrame("0", "Linear", 1, "train", (), Direction.BACKWARD)
    assert Report(1, "train", 0, 1, "0", [frame]).to_text().splitlines()[1] == "Last 1 forward and backward frames:"


def test_dict_and_json_carry_the_same_frames() -> None:
    report = Report(3, "train", 0, 1, "encoder.block.2.layer.1.dropout", _frames(), optimizer_step=1, epoch=0)
    data = report.to_dict()
    assert data["batch_number"] == 3
    assert data["phase"] == "train"
    assert data["rank"] == 0
    assert data["world_size"] == 1
    assert data["optimizer_step"] == 1
    assert data["epoch"] == 0
    assert data["module_name"] == "encoder.block.2.layer.1.dropout"
    assert [f["module"] for f in data["frames"]] == [
        "encoder.block.2.layer.1.DenseReluDense.wo",
        "encoder.block.2.layer.1.dropout",
    ]
    dropout = data["frames"][1]
    assert dropout["class"] == "Dropout"
    assert dropout["batch_number"] == 3
    output = dropout["entries"][1]
    assert output == {
        "label": "output",
        "abs_min": 0.0,
        "abs_max": "inf",  # JSON has no literal for inf/nan
        "dtype": "float16",
        "shape": [2],
        "non_finite": True,
        "note": None,
    }
    assert dropout["entries"][2]["note"] == "None"
    assert dropout["entries"][2]["abs_min"] is None

    parsed = json.loads(report.to_json())  # strict JSON: no bare NaN/Infinity tokens
    assert parsed == data
    assert "Infinity" not in report.to_json()
    assert "NaN" not in report.to_json()


def test_nan_becomes_a_string_in_json() -> None:
    nan = measure(torch.tensor([float("nan")]))
    frames = resolve([RecordedFrame("m", "M", 0, entries=[Entry("output", Role.OUTPUT, nan)])])
    entry = json.loads(Report(0, "train", 0, 1, "m", frames).to_json())["frames"][0]["entries"][0]
    assert entry["abs_min"] == "nan"
    assert entry["abs_max"] == "nan"
    assert entry["non_finite"] is True


def test_empty_report_still_renders() -> None:
    report = Report(0, "train", 0, 1, None, [])
    assert (
        report.to_text() == "Detected inf/nan during batch_number=0\nLast 0 forward frames:\nabs min  abs max  metadata"
    )
    assert json.loads(report.to_json())["frames"] == []
