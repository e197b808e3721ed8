"""Writing reports and traces to `report_dir`: whole files or none, and on disk before anything raises."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from nanwatch.core.formats.jsonl_schema import LineRecord
from nanwatch.core.formats.jsonl_writer import dumps, report_records
from nanwatch.core.report import Report
from nanwatch.errors import ConfigError

__all__ = [
    "write_report",
    "report_stem",
    "append_trace",
    "append_trace_records",
    "atomic_write",
    "trace_paths",
    "prepare_report_dir",
]


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a crash or a full disk mid-write leaves no half file, and no
    temporary file either."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def prepare_report_dir(report_dir: Path) -> None:
    """Create `report_dir` (and its parents) now, so that a path nanwatch cannot write to is an error at attach,
    not a lost report later.

    Raises:
        ConfigError: the path names a file, or a folder on the way cannot be created or written to.
    """
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"report_dir {str(report_dir)!r} is a file, not a folder; give a folder path") from None
    except OSError as error:
        raise ConfigError(f"report_dir {str(report_dir)!r} cannot be created: {error.strerror or error}") from None
    if not os.access(report_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"report_dir {str(report_dir)!r} is not writable by this process")


def report_stem(rank: int, batch_number: int, phase: str) -> str:
    """`nanwatch-report[-eval]-rank{R}-batch{N}`: the name of a report's files, without the suffix."""
    infix = "" if phase == "train" else f"-{phase}"
    return f"nanwatch-report{infix}-rank{rank}-batch{batch_number}"


def write_report(report_dir: Path, report: Report) -> tuple[Path, Path, Path]:
    """Write `report` as text, JSON and JSON Lines (see `core/formats/jsonl_schema.py`); return the three paths."""
    report_dir.mkdir(parents=True, exist_ok=True)
    stem = report_stem(report.rank, report.batch_number, report.phase)
    text_path = report_dir / f"{stem}.txt"
    json_path = report_dir / f"{stem}.json"
    jsonl_path = report_dir / f"{stem}.jsonl"
    atomic_write(json_path, report.to_json() + "\n")
    atomic_write(jsonl_path, dumps(report_records(report)))
    atomic_write(text_path, report.to_text() + "\n")
    return text_path, json_path, jsonl_path


def trace_paths(report_dir: Path, rank: int) -> tuple[Path, Path]:
    """The text and JSON Lines trace files of one rank."""
    return report_dir / f"nanwatch-trace-rank{rank}.txt", report_dir / f"nanwatch-trace-rank{rank}.jsonl"


def append_trace(report_dir: Path, rank: int, text: str) -> Path:
    """Append trace lines to `report_dir/nanwatch-trace-rank{rank}.txt`."""
    report_dir.mkdir(parents=True, exist_ok=True)
    path = trace_paths(report_dir, rank)[0]
    with path.open("a", encoding="utf-8") as handle:
        handle.write(text + "\n")
    return path


def append_trace_records(report_dir: Path, rank: int, records: list[LineRecord]) -> Path:
    """Append trace records to `report_dir/nanwatch-trace-rank{rank}.jsonl` (the JSON Lines twin of the text trace)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    path = trace_paths(report_dir, rank)[1]
    with path.open("a", encoding="utf-8") as handle:
        handle.write(dumps(records))
    return path
