"""Writing reports and traces to `report_dir`: on disk before anything raises."""

from __future__ import annotations

import os
from pathlib import Path

from nanwatch.core.jsonl import LineRecord, dumps, report_records
from nanwatch.core.report import Report

__all__ = ["write_report", "append_trace", "append_trace_records"]


def _atomic_write(path: Path, text: str) -> None:
    # Written whole or not at all: a crash mid-write leaves no half report behind.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(report_dir: Path, report: Report) -> tuple[Path, Path, Path]:
    """Write `report` as text, JSON and JSON Lines (one record per line, see `core/jsonl.py`); return the paths."""
    report_dir.mkdir(parents=True, exist_ok=True)
    phase = "" if report.phase == "train" else f"-{report.phase}"
    stem = f"nanwatch-report{phase}-rank{report.rank}-batch{report.batch_number}"
    text_path = report_dir / f"{stem}.txt"
    json_path = report_dir / f"{stem}.json"
    jsonl_path = report_dir / f"{stem}.jsonl"
    _atomic_write(json_path, report.to_json() + "\n")
    _atomic_write(jsonl_path, dumps(report_records(report)))
    _atomic_write(text_path, report.to_text() + "\n")
    return text_path, json_path, jsonl_path


def append_trace(report_dir: Path, rank: int, text: str) -> Path:
    """Append trace lines to `report_dir/nanwatch-trace-rank{rank}.txt`."""
    report_dir.mkdir(parents=True, exist_ok=True)
    path = report_dir / f"nanwatch-trace-rank{rank}.txt"
    with path.open("a", encoding="utf-8") as handle:
        handle.write(text + "\n")
    return path


def append_trace_records(report_dir: Path, rank: int, records: list[LineRecord]) -> Path:
    """Append trace records to `report_dir/nanwatch-trace-rank{rank}.jsonl` (the JSON Lines twin of the text trace)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    path = report_dir / f"nanwatch-trace-rank{rank}.jsonl"
    with path.open("a", encoding="utf-8") as handle:
        handle.write(dumps(records))
    return path
