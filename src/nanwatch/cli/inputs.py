"""What file did the user give? `show`, `diff` and `plot` read nanwatch's JSON Lines; this says what else it was.

A report directory holds several kinds of file side by side (the text report, the JSON report, the JSON Lines
report, the text and JSON Lines traces, the replay capture `replay-*.pt`), and the wrong one is easy to pick.
`sniff` tells them apart from their first bytes, without reading a whole file or importing torch, and
`read_jsonl_blocks` turns anything but a whole nanwatch JSON Lines file into one line that names what was given and
what to give instead: the file of the right kind beside it, when there is one.

A JSON Lines file cut short (a full disk, a copy taken while the run was writing) is refused too: its last line is
not whole, or a report holds fewer frames than its records say it has (`report_frames`, schema 2). A cut that falls
exactly between two lines of a report's last frame, or between two frames of a trace, leaves no such trace and
cannot be told from a whole file.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from nanwatch.cli.usage import CliError
from nanwatch.core.formats.jsonl_reader import Block, parse_source, read_blocks

__all__ = ["Kind", "Sniffed", "sniff", "read_jsonl_blocks", "check_whole"]

_HEAD_BYTES = 64 * 1024  # enough to see the first record, or a JSON report's first keys
_WHOLE_JSON_BYTES = 64 * 1024 * 1024  # a pretty-printed JSON is parsed whole only up to this size


class Kind(Enum):
    MISSING = "missing"
    DIRECTORY = "directory"
    EMPTY = "empty"
    REPORT_JSONL = "report JSON Lines"
    TRACE_JSONL = "trace JSON Lines"
    REPORT_JSON = "report JSON"
    REPORT_TEXT = "report text"
    TRACE_TEXT = "trace text"
    CAPTURE = "replay capture"
    CAPSULE = "repro capsule"
    TORCH = "torch.save file"
    JSON = "other JSON"
    TEXT = "other text"
    BINARY = "binary"


JSONL_KINDS = (Kind.REPORT_JSONL, Kind.TRACE_JSONL)


@dataclass(frozen=True)
class Sniffed:
    """A file's kind, and words for it that complete "FILE is ..." (`a nanwatch report as JSON (one report)`)."""

    kind: Kind
    what: str


def sniff(path: Path) -> Sniffed:
    """Say what `path` is, from its first bytes (a JSON document that spans lines is parsed whole, when not huge)."""
    if not path.exists():
        return Sniffed(Kind.MISSING, "not there (no such file)")
    if path.is_dir():
        return Sniffed(Kind.DIRECTORY, "a folder, not a file")
    try:
        with path.open("rb") as handle:
            head = handle.read(_HEAD_BYTES)
    except OSError as error:
        return Sniffed(Kind.MISSING, f"not readable ({error.strerror or error})")
    if not head.strip():
        return Sniffed(Kind.EMPTY, "empty")
    if head.startswith(b"PK\x03\x04"):
        return _sniff_zip(path)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return Sniffed(Kind.TORCH, "a Python pickle (torch.save's legacy format, or another pickle), not text")
    text = _utf8_head(head)
    if text is None or "\x00" in text:
        return Sniffed(Kind.BINARY, f"a binary file (byte {_first_non_text(head)} is {_byte(head)}), not text")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{"):
        return _sniff_json(path, first)
    if first.startswith("Detected inf/nan"):
        return Sniffed(Kind.REPORT_TEXT, "a nanwatch text report (.txt)")
    if first.startswith("*** Starting batch number"):
        return Sniffed(Kind.TRACE_TEXT, "a nanwatch text trace (.txt)")
    return Sniffed(Kind.TEXT, "a text file that nanwatch did not write as JSON Lines")


def read_jsonl_blocks(spec: str, command: str) -> list[Block]:
    """The reports and traced batches of `FILE[:BATCH]`, when FILE is a whole nanwatch JSON Lines file.

    Args:
        spec: `FILE` or `FILE:BATCH`.
        command: the command's name, as the error line calls it (`show`).

    Raises:
        CliError: FILE is of another kind (the line says which, and names the file to give instead), or cut short.
        JsonlError: a line of FILE is not a record of a schema this nanwatch reads, or it holds no batch BATCH.
    """
    path, _ = parse_source(spec)
    sniffed = sniff(path)
    if sniffed.kind not in JSONL_KINDS:
        raise CliError(
            f"{path} is {sniffed.what}", f"{command} reads a nanwatch .jsonl file: {_instead(path, sniffed)}"
        )
    _check_last_line(path)
    blocks = read_blocks(spec)
    check_whole(blocks, path)
    return blocks


def check_whole(blocks: list[Block], path: Path) -> None:
    """Refuse a report that holds fewer frames than its records say it has: the file was cut short.

    Raises:
        CliError: a report block lacks frames.
    """
    for block in blocks:
        expected = block.records[0].report_frames if block.kind == "report" else None
        present = len({record.frame for record in block.records})
        if expected is not None and present < expected:
            raise CliError(
                f"{path} ends mid-report: the report of batch {block.batch} holds {present} of its {expected} frames",
                "the file was cut short (a full disk, or copied while being written); use the .txt report beside it, "
                "or run again",
            )


# --------------------------------------------------------------------------------------------------------------------


def _sniff_zip(path: Path) -> Sniffed:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return Sniffed(Kind.BINARY, "a damaged zip archive, not text")
    if any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
        if path.name.startswith("replay-"):
            return Sniffed(Kind.CAPTURE, "a replay capture (capture_on_detect's torch.save file), not a report")
        if path.name.startswith("nanwatch-capsule-"):
            return Sniffed(Kind.CAPSULE, "a repro capsule (nanwatch repro runs its culprit alone), not a report")
        return Sniffed(Kind.TORCH, "a torch.save file (a zip of tensors), not a report")
    return Sniffed(Kind.BINARY, "a zip archive, not text")


def _sniff_json(path: Path, first: str) -> Sniffed:
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        record = None
    if isinstance(record, dict) and "version" in record and "kind" in record:
        if record["kind"] == "trace":
            return Sniffed(Kind.TRACE_JSONL, "a nanwatch trace as JSON Lines")
        return Sniffed(Kind.REPORT_JSONL, "a nanwatch report as JSON Lines")
    if record is not None:
        return Sniffed(Kind.JSON, "JSON, but not nanwatch's JSON Lines records")
    # One JSON document over many lines: parse it whole (a report's .json is a few MB at most).
    try:
        if path.stat().st_size > _WHOLE_JSON_BYTES:
            return Sniffed(Kind.JSON, "a large JSON document, not JSON Lines")
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return Sniffed(Kind.TEXT, "a text file that is neither JSON nor JSON Lines")
    if isinstance(document, dict) and "frames" in document and "batch_number" in document:
        return Sniffed(Kind.REPORT_JSON, "a nanwatch report as one JSON document (the .json report)")
    return Sniffed(Kind.JSON, "a JSON document, not nanwatch's JSON Lines")


def _utf8_head(head: bytes) -> str | None:
    try:
        return head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start >= len(head) - 3 and len(head) == _HEAD_BYTES:  # a character cut by the read, not bad bytes
            return head[: error.start].decode("utf-8", errors="strict")
        return None


def _first_non_text(head: bytes) -> int:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start
    return head.index(b"\x00")


def _byte(head: bytes) -> str:
    return f"{head[_first_non_text(head)]:#04x}"


def _check_last_line(path: Path) -> None:
    size = path.stat().st_size
    with path.open("rb") as handle:
        handle.seek(max(0, size - _HEAD_BYTES))
        tail = handle.read()
    if tail.endswith(b"\n"):
        return
    last = tail.rsplit(b"\n", 1)[-1]
    try:
        json.loads(last)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CliError(
            f"{path} ends mid-line: its last line is cut short",
            "the file was cut short (a full disk, or copied while being written); use the .txt beside it, or run again",
        ) from None


def _instead(path: Path, sniffed: Sniffed) -> str:
    """What to give instead: the JSON Lines file written beside `path` when there is one, else how to find one."""
    if sniffed.kind is Kind.DIRECTORY:
        found = _jsonl_files(path)
        return f"give one of those in it: {found}" if found else "there is none in that folder"
    twin = path.with_suffix(".jsonl")
    if sniffed.kind in (Kind.REPORT_JSON, Kind.REPORT_TEXT, Kind.TRACE_TEXT) and twin.is_file():
        return f"give {twin}, written beside it"
    found = _jsonl_files(path.parent, besides=path)
    hint = (
        f"those beside it: {found}" if found else "report_dir holds nanwatch-report-*.jsonl and nanwatch-trace-*.jsonl"
    )
    if sniffed.kind is Kind.CAPTURE:
        return f"{hint} (replay this file with nanwatch replay {path} --model MODULE:FACTORY)"
    return hint


def _jsonl_files(folder: Path, most: int = 4, besides: Path | None = None) -> str:
    try:
        names = sorted(
            child.name
            for child in folder.glob("nanwatch-*.jsonl")
            if child.is_file() and (besides is None or child.name != besides.name)
        )
    except OSError:
        return ""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
