"""Checkpoints read back from disk, as the frameworks write them, for `nanwatch.verify_checkpoint`.

A checkpoint is one file (`torch.save`'s, a Lightning `.ckpt`, a `.safetensors`) or a folder of them (Accelerate's
`save_state`: `model.safetensors`, `optimizer.bin`, ...; the HF Trainer's `checkpoint-N`: `model.safetensors`,
`optimizer.pt`, ...). A folder's checkpoint files are those named `*.safetensors`, `*.bin`, `*.pt`, `*.pth`,
`*.ckpt` or `*.pkl`, in it and in its subfolders, read one at a time (a folder is never held in memory whole); the
rest (`trainer_state.json`, `config.json`, a `nanwatch-quarantine/*.nonfinite`) is no checkpoint file. The shards of
a `torch.distributed.checkpoint` (`*.distcp`: FSDP's sharded state) are not read, and said.

Torch files are read with `torch.load(map_location="cpu", weights_only=True)` (memory-mapped where the file allows):
unpickling anything else runs its code, so a file that holds other Python objects is refused with one line that says
which, unless the caller opts in with `weights_only=False`. Beside the weights, the frameworks pickle objects that
hold no floating-point state (the HF Trainer's `training_args.bin` and `rng_state*.pth`, Accelerate's
`random_states_*.pkl` and `sampler*.bin`: `BOOKKEEPING`); in a folder, such a file that `weights_only=True` refuses
is skipped, and said. A framework's resume (Accelerate's) skips every file it refuses (`skip_refused`): the framework
decides what it unpickles, nanwatch checks what it can read safely.

Of a Lightning checkpoint, `state_dict` and `optimizer_states` are what is checked (`state_to_check`), as the
checkpoint guard checks them before the file is written: its callbacks' state holds an inf on purpose (a
`ModelCheckpoint`'s `kth_value`).
"""

from __future__ import annotations

import fnmatch
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch.errors import CheckpointReadError

__all__ = [
    "BOOKKEEPING",
    "CHECKPOINT_SUFFIXES",
    "CheckpointFile",
    "SkippedFile",
    "read_checkpoint",
    "state_to_check",
]

CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SHARD_SUFFIX = ".distcp"  # torch.distributed.checkpoint's: read only by its own planner, into a sharded model
# Pickled beside the weights, with no floating-point state: skipped in a folder when weights_only=True refuses them.
BOOKKEEPING = ("training_args.bin", "rng_state*.pth", "random_states_*.pkl", "sampler*.bin")
# The keys of a Lightning checkpoint the guard checks before writing one (the callbacks' state is left out).
_LIGHTNING_MARK = "pytorch-lightning_version"
_LIGHTNING_CHECKED = ("state_dict", "optimizer_states")


@dataclass(frozen=True)
class CheckpointFile:
    """One checkpoint file, read: its name relative to the folder given (the path itself for a file given alone),
    and what it holds."""

    name: str
    state: Any


@dataclass(frozen=True)
class SkippedFile:
    """A file of the folder that was not read, why, and whether it is a framework's bookkeeping (`BOOKKEEPING`)."""

    name: str
    why: str
    bookkeeping: bool


def read_checkpoint(
    path: str | os.PathLike[str], *, weights_only: bool = True, skip_refused: bool = False
) -> Iterator[CheckpointFile | SkippedFile]:
    """Each checkpoint file at `path` (a file, or every checkpoint file of a folder, in sorted order), read. In a
    folder, a file `weights_only=True` refuses is skipped when it is bookkeeping, or any such file with `skip_refused`.

    Raises:
        FileNotFoundError: nothing is at `path`.
        CheckpointReadError: a file is not a checkpoint (neither a torch file nor a safetensors file), or holds
            objects `weights_only=True` refuses; a folder holds no checkpoint file.
    """
    target = os.fspath(path)
    if not os.path.exists(target):
        raise FileNotFoundError(f"nanwatch: no checkpoint at {target!r}: no such file or folder")
    if not os.path.isdir(target):
        try:
            yield CheckpointFile(target, _read_file(target, weights_only=weights_only))
        except _Refused as refused:
            raise CheckpointReadError(str(refused)) from refused
        return
    names = _checkpoint_names(target)
    if not names:
        raise CheckpointReadError(
            f"nanwatch: the folder {target!r} holds no checkpoint file (none named *{', *'.join(CHECKPOINT_SUFFIXES)})"
        )
    for name in names:
        if name.endswith(_SHARD_SUFFIX):
            yield SkippedFile(
                name, "a torch.distributed.checkpoint shard, which nanwatch does not read", bookkeeping=False
            )
            continue
        try:
            yield CheckpointFile(name, _read_file(os.path.join(target, name), weights_only=weights_only))
        except _Refused as refused:
            if _is_bookkeeping(name):
                why = f"pickled framework state that weights_only=True refuses ({refused.held})"
                yield SkippedFile(name, why, bookkeeping=True)
            elif skip_refused:
                why = f"it holds {refused.held}, which weights_only=True refuses"
                yield SkippedFile(name, why, bookkeeping=False)
            else:
                raise CheckpointReadError(str(refused)) from refused


def state_to_check(state: Any) -> Any:
    """What of a file's content is checked: of a Lightning checkpoint its weights and optimizer states, of anything
    else all of it."""
    if isinstance(state, dict) and _LIGHTNING_MARK in state:
        return {key: state[key] for key in _LIGHTNING_CHECKED if key in state}
    return state


class _Refused(Exception):
    """`torch.load(weights_only=True)` refused a torch file for the Python object it holds (`held`)."""

    def __init__(self, message: str, held: str) -> None:
        super().__init__(message)
        self.held = held


def _checkpoint_names(folder: str) -> list[str]:
    """The checkpoint files in `folder` and its subfolders, relative to it, sorted (hidden folders left out)."""
    found = []
    for root, folders, files in os.walk(folder):
        folders[:] = [name for name in folders if not name.startswith(".")]
        found += [
            os.path.relpath(os.path.join(root, name), folder)
            for name in files
            if name.endswith((*CHECKPOINT_SUFFIXES, _SHARD_SUFFIX))
        ]
    return sorted(found)


def _is_bookkeeping(name: str) -> bool:
    return any(fnmatch.fnmatchcase(os.path.basename(name), pattern) for pattern in BOOKKEEPING)


def _read_file(path: str, *, weights_only: bool) -> Any:
    if path.endswith(".safetensors"):
        return _read_safetensors(path)
    is_zip = zipfile.is_zipfile(path)
    not_torch = f"nanwatch: {path!r} is not a checkpoint (neither a file written by torch.save nor a safetensors file)"
    try:
        # Memory-mapped where torch allows it (its zip format): a large checkpoint is read as it is checked.
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=is_zip)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
        if found is None:
            raise CheckpointReadError(not_torch) from error
        raise _Refused(
            f"nanwatch: torch.load(weights_only=True) refuses {path!r}: it holds {found.group(1)}, which unpickling "
            "would run; pass weights_only=False only if you trust where the file came from",
            found.group(1),
        ) from error
    except Exception as error:  # a zip that is not torch's, a truncated file, plain text: torch raises all kinds
        raise CheckpointReadError(f"{not_torch}: {type(error).__name__}") from error


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError as error:
        raise CheckpointReadError(
            f"nanwatch: reading {path!r} needs the safetensors package, which is not installed: pip install safetensors"
        ) from error
    try:
        loaded: dict[str, torch.Tensor] = load_file(path, device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError, and OSError for an unreadable header
        raise CheckpointReadError(f"nanwatch: {path!r} is not a safetensors file ({error})") from error
    return loaded
