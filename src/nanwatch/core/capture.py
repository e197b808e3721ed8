"""Capture what replaying a failing forward needs, and read it back.

With `capture_on_detect`, a forward pre-hook on the root module copies, as each top-level forward begins, its inputs
(args and kwargs), the RNG states and every parameter and buffer. Only the latest copy is kept (the weight copies
are reused, so steady state allocates nothing new for them). Nothing is written until a detection is published:
then the copy, labelled with the batch it belongs to, goes to `report_dir/replay-rank{R}-batch{N}.pt`, next to the
report. `nanwatch replay` (see `nanwatch.replay`) reads the file back with `load_replay_file`.

The copies are real copies (`detach().clone()`, then `copy_` into them): the optimizer changes the weights in place
between the forward and the check that finds the inf/nan.
"""

from __future__ import annotations

import os
import pickle
import random
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanwatch._version import __version__
from nanwatch.core.hooks import HookSet
from nanwatch.core.report import Report
from nanwatch.errors import NanwatchError

if TYPE_CHECKING:
    from nanwatch.core.watcher import Watcher

__all__ = [
    "REPLAY_FORMAT",
    "REPLAY_VERSION",
    "ReplayCapture",
    "ReplayError",
    "capture_rng_states",
    "determinism_flags",
    "load_replay_file",
    "replay_file_name",
    "restore_rng_states",
    "set_determinism_flags",
]

REPLAY_FORMAT = "nanwatch-replay"
REPLAY_VERSION = 1
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
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


class ReplayError(NanwatchError, ValueError):
    """A replay file or the model it is replayed on is not usable; the message says what is wrong."""


def replay_file_name(rank: int, batch_number: int, phase: str = "train") -> str:
    """`replay-rank{R}-batch{N}.pt` (`replay-eval-...` for an eval forward), named like the report files."""
    infix = "" if phase == "train" else f"-{phase}"
    return f"replay{infix}-rank{rank}-batch{batch_number}.pt"


def capture_rng_states() -> dict[str, Any]:
    """The python, torch CPU and (if CUDA was initialised) CUDA generator states."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    # Asking for CUDA states would initialise CUDA in a CPU-only run; if it was never initialised, nothing used it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> list[str]:
    """Set the generators to `states`; return notes on what could not be restored (empty when all was)."""
    notes = []
    if "python" in states:
        random.setstate(_as_python_state(states["python"]))
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    cuda_states = states.get("cuda")
    if cuda_states:
        if torch.cuda.is_available() and torch.cuda.device_count() >= len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            notes.append(f"CUDA generator states of {len(cuda_states)} device(s) not restored: CUDA not available here")
    return notes


def determinism_flags() -> dict[str, bool]:
    """The switches that decide whether the same inputs give the same bits on a GPU."""
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }


def set_determinism_flags(flags: Mapping[str, bool]) -> None:
    """Set the switches `determinism_flags()` read; missing keys are left as they are."""
    if "deterministic_algorithms" in flags:
        torch.use_deterministic_algorithms(
            bool(flags["deterministic_algorithms"]), warn_only=bool(flags.get("warn_only", False))
        )
    if "cudnn_deterministic" in flags:
        torch.backends.cudnn.deterministic = bool(flags["cudnn_deterministic"])
    if "cudnn_benchmark" in flags:
        torch.backends.cudnn.benchmark = bool(flags["cudnn_benchmark"])


def _as_python_state(state: Any) -> Any:
    # random.setstate wants tuples; a state that went through a file may come back with lists.
    if isinstance(state, (list, tuple)):
        return tuple(_as_python_state(item) for item in state)
    return state


def _clone_tree(value: Any) -> Any:
    """Copy every tensor in nested tuples, lists and dicts; other values are kept as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        items = [_clone_tree(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_clone_tree(item) for item in value]
    if isinstance(value, dict):
        return {key: _clone_tree(item) for key, item in value.items()}
    return value


def _copy_into(previous: dict[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Copy each tensor into last time's copy when it still fits (no allocation), else into a new one."""
    copies = {}
    for name, tensor in named:
        data = tensor.detach()
        old = previous.get(name)
        if old is not None and old.shape == data.shape and old.dtype == data.dtype and old.device == data.device:
            old.copy_(data)
            copies[name] = old
        else:
            copies[name] = data.clone()
    return copies


def _qualified_class_name(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


class ReplayCapture:
    """Keeps a copy of what the latest top-level forward started from; saves it when a detection is published.

    Args:
        watcher: the watcher whose root module, counters and config this capture follows.
    """

    def __init__(self, watcher: Watcher) -> None:
        self._watcher = watcher
        self._root = watcher.model
        self._parameters: dict[str, torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}
        self._rng: dict[str, Any] = {}
        self._training_modes: dict[str, bool] = {}
        self._autocast: dict[str, str] = {}
        self._grad_enabled = True
        self._num_threads = 1
        self._determinism: dict[str, bool] = {}
        self._device = "cpu"
        # (phase, batch) of the forward the copy belongs to; set when that forward returns, so a forward that
        # raised, or one whose phase the adapter decided late, is never mistaken for the one a report is about.
        self._label: tuple[str, int] | None = None
        self._taking = False
        self._failed: str | None = None

    def attach(self, hooks: HookSet) -> None:
        """Register the root's pre-hook (copy) and forward hook (label) in `hooks`, so `detach()` removes them."""
        hooks.add_handle(self._root.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        hooks.add_handle(self._root.register_forward_hook(self._after_forward))

    @property
    def label(self) -> tuple[str, int] | None:
        """`(phase, batch_number)` of the forward held, or None when none completed since the last copy."""
        return self._label

    # ---------------------------------------------------------------------------------------------- copying

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._failed is not None or self._watcher.disabled_reason is not None:
            return
        # An eval-mode forward is only checked with watch_eval; copying it would also overwrite the training copy.
        if not module.training and not self._watcher.config.watch_eval:
            return
        # An unwatched training batch records nothing, so nothing in it can be reported or replayed: no copy.
        if module.training and not self._watcher.watches_batch(self._watcher.batch_number):
            return
        try:
            self._take(module, args, kwargs)
        except Exception as error:  # a capture problem must never kill a healthy run
            self._fail(f"copying the forward's inputs and weights failed: {error!r}")

    def _take(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._label = None
        self._taking = True
        with torch.no_grad():
            self._parameters = _copy_into(self._parameters, module.named_parameters())
            self._buffers = _copy_into(self._buffers, module.named_buffers())
            self._args = _clone_tree(tuple(args))
            self._kwargs = _clone_tree(dict(kwargs))
        self._rng = capture_rng_states()
        self._training_modes = {name: sub.training for name, sub in module.named_modules()}
        self._autocast = {
            device_type: str(torch.get_autocast_dtype(device_type)).replace("torch.", "")
            for device_type in _AUTOCAST_DEVICE_TYPES
            if torch.is_autocast_enabled(device_type)
        }
        self._grad_enabled = torch.is_grad_enabled()
        self._num_threads = torch.get_num_threads()
        self._determinism = determinism_flags()
        first = next(iter(self._parameters.values()), None)
        self._device = str(first.device) if first is not None else "cpu"

    def _after_forward(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._taking:
            self._taking = False
            self._label = (self._watcher.phase, self._watcher.current_batch)

    def _fail(self, reason: str) -> None:
        self._failed = reason
        self._label = None
        self._parameters, self._buffers, self._args, self._kwargs = {}, {}, (), {}
        # Logged, not warned: tests turn NanwatchWarning into errors, and a capture problem is not the run's.
        self._watcher.logger.warning(f"nanwatch stopped capturing forwards for replay (the run goes on): {reason}")

    # ----------------------------------------------------------------------------------------------- saving

    def save(self, report: Report) -> Path | None:
        """Write the copy of the forward `report` is about to `report_dir`; return its path, or None if there is none.

        Never raises: a replay file that cannot be written is logged, and the detection goes on to be raised.
        """
        report_dir = self._watcher.config.report_dir
        counter = "batch_number" if report.phase == "train" else f"{report.phase}_batch_number"
        if report_dir is None:
            return None
        if self._failed is not None:
            self._watcher.logger.warning(f"nanwatch saved no replay of {counter}={report.batch_number}: {self._failed}")
            return None
        if self._label != (report.phase, report.batch_number):
            held = "" if self._label is None else f" (the copy held is of {self._label[0]} batch {self._label[1]})"
            self._watcher.logger.warning(
                f"nanwatch saved no replay of {counter}={report.batch_number}: no forward of the watched model ran "
                f"to its end in that batch{held}"
            )
            return None
        path = Path(report_dir) / replay_file_name(report.rank, report.batch_number, report.phase)
        try:
            _atomic_save(self._payload(report), path)
        except Exception as error:
            self._watcher.logger.warning(f"nanwatch could not write the replay file {str(path)!r}: {error!r}")
            return None
        self._watcher.logger.info(
            f"nanwatch saved the failing forward to {path}\n"
            f"  replay it with: nanwatch replay {path} --model PACKAGE.MODULE:FACTORY"
        )
        return path

    def _payload(self, report: Report) -> dict[str, Any]:
        watcher = self._watcher
        return {
            "format": REPLAY_FORMAT,
            "version": REPLAY_VERSION,
            "nanwatch_version": __version__,
            "torch_version": str(torch.__version__),
            "batch_number": report.batch_number,
            "phase": report.phase,
            "rank": report.rank,
            "world_size": report.world_size,
            "optimizer_step": report.optimizer_step,
            "epoch": report.epoch,
            "model_class": _qualified_class_name(self._root),
            "layout": {
                "parameters": {name: _describe(t) for name, t in self._parameters.items()},
                "buffers": {name: _describe(t) for name, t in self._buffers.items()},
            },
            "parameters": self._parameters,
            "buffers": self._buffers,
            "args": self._args,
            "kwargs": self._kwargs,
            "rng": self._rng,
            "training_modes": self._training_modes,
            "autocast": self._autocast,
            "grad_enabled": self._grad_enabled,
            "num_threads": self._num_threads,
            "determinism": self._determinism,
            "device": self._device,
            "config": watcher.config.model_dump(mode="json"),
            "report": report.to_dict(),
        }


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}


def _atomic_save(payload: dict[str, Any], path: Path) -> None:
    # Whole or not at all: a crash or a pickling error mid-write leaves no half file under the final name.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
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
    if not path.is_file():
        raise ReplayError(
            f"replay file {str(path)!r} does not exist" if not path.exists() else f"{str(path)!r} is not a file"
        )
    not_torch = f"{str(path)!r} is not a nanwatch replay file (it is not a file written by torch.save)"
    try:
        data = torch.load(path, map_location="cpu", weights_only=not trusted)
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
