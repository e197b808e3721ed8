"""The replay file: what replaying a failing forward needs, as `report_dir/replay-rank{R}-batch{N}.pt`.

Written by the capture feature (core/features/capture.py) when a detection is published, read by `nanwatch.replay`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from nanwatch._version import __version__
from nanwatch.errors import ReplayError

__all__ = ["REPLAY_FORMAT", "REPLAY_VERSION", "ReplayError", "replay_file_name", "save_replay_file", "load_replay_file"]

REPLAY_FORMAT = "nanwatch-replay"
REPLAY_VERSION = 1
# Keys a replay file must hold, with the type each must have.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "batch_number": int,
    "phase": str,
    "rank": int,
    "world_size": int,
    "model_class": str,
    "parameters": dict,
    "buffers": dict,
    "args": tuple,
    "kwargs": dict,
    "rng": dict,
    "training_modes": dict,
    "autocast": dict,
    "grad_enabled": bool,
    "num_threads": int,
    "device": str,
    "config": dict,
    "report": dict,
}


def replay_file_name(rank: int, batch_number: int, phase: str = "train") -> str:
    """`replay-rank{R}-batch{N}.pt` (`replay-eval-...` for an eval forward), named like the report files."""
    infix = "" if phase == "train" else f"-{phase}"
    return f"replay{infix}-rank{rank}-batch{batch_number}.pt"


def save_replay_file(payload: dict[str, Any], path: Path) -> None:
    """Write `payload` (with the format's name and version) whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(
            {"format": REPLAY_FORMAT, "version": REPLAY_VERSION, "nanwatch_version": __version__, **payload}, tmp
        )
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def load_replay_file(path: str | Path, *, trusted: bool = False) -> dict[str, Any]:
    """Read a replay file written by `capture_on_detect` and check it is one.

    Args:
        path: the `replay-rank{R}-batch{N}.pt` file.
        trusted: allow Python objects other than tensors and plain containers (unpickling runs their code: only
            for files you trust). Needed when the forward was given such objects as inputs.

    Returns:
        The file's content: a dict with the keys `_REQUIRED` lists, tensors on the CPU.

    Raises:
        ReplayError: the file is missing, not a torch file, not a nanwatch replay file, of a newer format, or holds
            objects that only a trusted load may unpickle.
    """
    path = Path(path)
    return _checked(_unpickle(path, trusted=trusted), path)


def _unpickle(path: Path, *, trusted: bool) -> Any:
    """What the torch file at `path` holds; every way it is not one (or needs a trusted load) as a `ReplayError`."""
    if not path.is_file():
        raise ReplayError(
            f"replay file {str(path)!r} does not exist" if not path.exists() else f"{str(path)!r} is not a file"
        )
    not_torch = f"{str(path)!r} is not a nanwatch replay file (it is not a file written by torch.save)"
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
        if found is None:
            raise ReplayError(not_torch) from error
        raise ReplayError(
            f"replay file {str(path)!r} holds Python objects besides tensors and plain containers ({found.group(1)}, "
            "among the forward's inputs probably); unpickling them runs their code, so load it with trusted=True "
            "(--trusted on the command line) only if you trust where the file came from"
        ) from error
    except Exception as error:  # a zip that is not torch's, a truncated file, plain text: torch raises all kinds
        raise ReplayError(f"{not_torch}: {type(error).__name__}") from error


def _checked(data: Any, path: Path) -> dict[str, Any]:
    """`data`, once it is a replay file's content, of a version this nanwatch reads, whole; else a `ReplayError`."""
    if not isinstance(data, dict) or data.get("format") != REPLAY_FORMAT:
        what = f"a dict with keys {sorted(map(str, data))[:8]}" if isinstance(data, dict) else type(data).__name__
        raise ReplayError(
            f"{str(path)!r} is a torch file but not a nanwatch replay file (it holds {what}); replay files are "
            "written as report_dir/replay-rank{R}-batch{N}.pt by capture_on_detect=True"
        )
    version = data.get("version")
    if not isinstance(version, int) or version > REPLAY_VERSION:
        raise ReplayError(
            f"replay file {str(path)!r} has format version {version!r}; this nanwatch ({__version__}) reads versions "
            f"up to {REPLAY_VERSION}: upgrade nanwatch"
        )
    problems = [
        f"{key!r} ({'missing' if key not in data else f'a {type(data[key]).__name__}'})"
        for key, expected in _REQUIRED.items()
        if not isinstance(data.get(key), expected)
    ]
    problems += [
        f"{kind}[{name!r}] (a {type(value).__name__}, not a tensor)"
        for kind in ("parameters", "buffers")
        if isinstance(data.get(kind), dict)
        for name, value in data[kind].items()
        if not isinstance(value, torch.Tensor)
    ]
    if problems:
        raise ReplayError(f"replay file {str(path)!r} is damaged: bad or missing entries " + ", ".join(problems))
    return data
