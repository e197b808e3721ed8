"""`show`, `diff` and `plot` on every kind of file a report directory holds: each one that is not a whole nanwatch
JSON Lines file is named for what it is, in one line, with the file to give instead; a .jsonl cut short is refused.

The files come from one real watched run with `capture_on_detect=True`: the text, JSON and JSON Lines report, the
text and JSON Lines trace, and the replay capture `replay-rank0-batch2.pt`, side by side as a user finds them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.trace_models import SEED, build_amp_net

import nanwatch
from nanwatch.cli import main
from nanwatch.cli.inputs import Kind, sniff

REPORT = "nanwatch-report-rank0-batch2"
TRACE = "nanwatch-trace-rank0"


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """AmpNet in float16, batches 0-2 traced; at batch 2 amp multiplies by 1e5 and its output is inf."""
    folder = tmp_path_factory.mktemp("reports")
    model = build_amp_net()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED)).half()
    watched = nanwatch.watch(
        model, trace_batch_nums=[0, 1, 2], report_dir=folder, capture_on_detect=True, max_frames_to_save=8
    )

    def train() -> None:
        with watched as handle:
            for batch in range(3):
                model.amp.factor = 1e5 if batch == 2 else 1.0
                model(x)
                handle.step()

    with pytest.raises(nanwatch.NonFiniteError):
        train()
    return folder


def test_every_file_of_a_report_dir_is_told_apart(report_dir: Path) -> None:
    kinds = {path.name: sniff(path).kind for path in report_dir.iterdir()}
    assert kinds == {
        f"{REPORT}.txt": Kind.REPORT_TEXT,
        f"{REPORT}.json": Kind.REPORT_JSON,
        f"{REPORT}.jsonl": Kind.REPORT_JSONL,
        f"{TRACE}.txt": Kind.TRACE_TEXT,
        f"{TRACE}.jsonl": Kind.TRACE_JSONL,
        "replay-rank0-batch2.pt": Kind.CAPTURE,
        "nanwatch-capsule-rank0-batch2.pt": Kind.CAPSULE,
    }
    assert sniff(report_dir).kind is Kind.DIRECTORY
    assert sniff(report_dir / "nope.jsonl").kind is Kind.MISSING


def _run(argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    assert not (tmp_path / "x.png").exists()
    return status, out, err


def _commands(path: Path, tmp_path: Path) -> dict[str, list[str]]:
    """Each command that reads JSON Lines, given `path` where it wants its (first) file."""
    good = str(path.parent / f"{TRACE}.jsonl:0")
    return {
        "show": ["show", str(path)],
        "diff": ["diff", str(path), good],
        "plot": ["plot", str(path), "-o", str(tmp_path / "x.png")],
    }


@pytest.mark.parametrize(
    ("name", "said"),
    [
        (f"{REPORT}.json", "is a nanwatch report as one JSON document (the .json report)"),
        (f"{REPORT}.txt", "is a nanwatch text report (.txt)"),
        (f"{TRACE}.txt", "is a nanwatch text trace (.txt)"),
    ],
)
def test_a_report_or_trace_of_another_format_names_its_jsonl_twin(
    report_dir: Path, name: str, said: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = report_dir / name
    for command, argv in _commands(path, tmp_path).items():
        status, out, err = _run(argv, capsys, tmp_path)
        assert (status, out) == (2, "")
        assert err == (
            f"nanwatch {command}: {path} {said}; {command} reads a nanwatch .jsonl file: give "
            f"{path.with_suffix('.jsonl')}, written beside it\n"
        )


def test_the_replay_capture_is_named_with_how_to_replay_it(
    report_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Before: a 21-27-line UnicodeDecodeError traceback.
    path = report_dir / "replay-rank0-batch2.pt"
    for command, argv in _commands(path, tmp_path).items():
        status, out, err = _run(argv, capsys, tmp_path)
        assert (status, out) == (2, "")
        assert err == (
            f"nanwatch {command}: {path} is a replay capture (capture_on_detect's torch.save file), not a report; "
            f"{command} reads a nanwatch .jsonl file: those beside it: {REPORT}.jsonl, {TRACE}.jsonl (replay this "
            f"file with nanwatch replay {path} --model MODULE:FACTORY)\n"
        )


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is a binary file (byte 0 is 0x89), not text"),
        (b"abs min  abs max  metadata\n", "is a text file that nanwatch did not write as JSON Lines"),
        (b'{"loss": 1.5}\n{"loss": 1.4}\n', "is JSON, but not nanwatch's JSON Lines records"),
        (b'{\n  "ok": true\n}\n', "is a JSON document, not nanwatch's JSON Lines"),
        (b"\x80\x04\x95\x00", "is a Python pickle (torch.save's legacy format, or another pickle), not text"),
    ],
)
def test_anything_else_is_named_too(
    tmp_path: Path, content: bytes, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nanwatch-other.jsonl"
    path.write_bytes(content)
    status, out, err = _run(["show", str(path)], capsys, tmp_path)
    assert (status, out) == (2, "")
    assert err == (
        f"nanwatch show: {path} {said}; show reads a nanwatch .jsonl file: report_dir holds nanwatch-report-*.jsonl "
        "and nanwatch-trace-*.jsonl\n"
    )


def test_a_folder_names_the_jsonl_files_in_it(
    report_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, _, err = _run(["show", str(report_dir)], capsys, tmp_path)
    assert status == 2
    assert err == (
        f"nanwatch show: {report_dir} is a folder, not a file; show reads a nanwatch .jsonl file: give one of those "
        f"in it: {REPORT}.jsonl, {TRACE}.jsonl\n"
    )


# --------------------------------------------------------------------------------------------------------------------
# Cut short


def test_a_report_cut_at_a_line_boundary_is_refused(
    report_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Before: it rendered silently as if whole, its culprit line naming a frame no longer there.
    lines = (report_dir / f"{REPORT}.jsonl").read_text().splitlines(keepends=True)
    cut = tmp_path / f"{REPORT}.jsonl"
    cut.write_text("".join(lines[: len(lines) // 2]), encoding="utf-8")
    assert main(["show", str(report_dir / f"{REPORT}.jsonl")]) == 0  # the whole file shows
    capsys.readouterr()
    for command, argv in _commands(cut, tmp_path).items():
        status, out, err = _run(argv, capsys, tmp_path)
        assert (status, out) == (2, "")
        assert err.startswith(f"nanwatch {command}: {cut} ends mid-report: the report of batch 2 holds ")
        assert " of its 8 frames; the file was cut short (a full disk, or copied while being written); " in err
        assert len(err.splitlines()) == 1


def test_a_file_cut_in_the_middle_of_a_line_is_refused(
    report_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = (report_dir / f"{TRACE}.jsonl").read_bytes()
    cut = tmp_path / f"{TRACE}.jsonl"
    cut.write_bytes(text[: len(text) // 2 + 7])
    assert not cut.read_bytes().endswith(b"\n")
    for command, argv in _commands(cut, tmp_path).items():
        status, out, err = _run(argv, capsys, tmp_path)
        assert (status, out) == (2, "")
        assert err.startswith(f"nanwatch {command}: {cut} ends mid-line: its last line is cut short; the file was cut ")
