"""The repro capsule: one module's failing call, kept so that `nanwatch repro` can run it again alone, elsewhere.

`write_capsule` writes it (as `nanwatch-capsule-rank{R}-batch{N}.pt`, `capsule_file_name`), `read_capsule` reads
it. The file is a `torch.save` of one dict of plain values, strings, numbers, bytes and tensors, so that
`torch.load(path, weights_only=True)` reads all of it and runs no code from it:

    format            "nanwatch-capsule"
    version           CAPSULE_VERSION (a reader refuses a newer one)
    torch_version     torch's version where it was written; nanwatch_version likewise
    module_name       the module's qualified name in the model ("" for the model itself)
    module_class      "package.module:Qual.Name" of its class
    training          whether it ran in training mode
    module_pickle     bytes: the module pickled without its tensors (see capsule_module.py)
    state             {name: tensor}: every parameter and buffer, CPU copies
    args, kwargs      its inputs: tensors as CPU copies, other plain values as they were (see capsule_inputs.py)
    objects           [bytes]: input values a weights-only load cannot read, each pickled on its own
    dropped           [str]: what was left out (inputs and hooks that cannot be pickled), one line each
    dtype             the dtype it ran in ("float16")
    autocast          {device type: dtype}: autocast as it was on during the call ({} when off)
    compile_backend   the torch.compile backend it ran under ("inductor"), or None when it ran eagerly
    compile_mode      the torch.compile mode, or None
    device            where it ran ("cuda:0")
    batch_number, rank, note

Only `module_pickle` and `objects` need a trusted load (unpickling runs code), and they are unpickled only by
`Capsule.build_module` and `Capsule.inputs`, after `read_capsule` found the outer file to be a capsule whose module
class imports.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanwatch._version import __version__
from nanwatch.core.formats.capsule_inputs import CallInputs, decode_inputs, encode_inputs
from nanwatch.core.formats.capsule_module import class_path, load_module, save_module, unwrap_compiled
from nanwatch.errors import CapsuleError

__all__ = [
    "CAPSULE_FORMAT",
    "CAPSULE_VERSION",
    "Capsule",
    "CallInputs",
    "CapsuleError",
    "capsule_file_name",
    "write_capsule",
    "read_capsule",
]

CAPSULE_FORMAT = "nanwatch-capsule"
CAPSULE_VERSION = 1
# Every key a capsule holds, with the type it must have.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "version": int,
    "torch_version": str,
    "nanwatch_version": str,
    "module_name": str,
    "module_class": str,
    "training": bool,
    "module_pickle": bytes,
    "state": dict,
    "args": tuple,
    "kwargs": dict,
    "objects": list,
    "dropped": list,
    "dtype": str,
    "autocast": dict,
    "compile_backend": (str, type(None)),
    "compile_mode": (str, type(None)),
    "device": str,
    "batch_number": int,
    "rank": int,
    "note": str,
}
_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_WHAT_TO_GIVE = "nanwatch repro reads the nanwatch-capsule-rank{R}-batch{N}.pt files a detection writes in report_dir"


@dataclass(frozen=True)
class Capsule:
    """A capsule as `read_capsule` found it (the fields are the file's keys, see the module's docstring).

    `module_pickle`, `encoded_args`, `encoded_kwargs` and `objects` are what the file holds; `build_module()` and
    `inputs()` turn them into a module and inputs to run, fresh at each call (unpickling runs their code: only for
    capsules you trust).
    """

    path: Path
    version: int
    torch_version: str
    nanwatch_version: str
    module_name: str
    module_class: str
    training: bool
    dtype: str
    autocast: Mapping[str, str]
    compile_backend: str | None
    compile_mode: str | None
    device: str
    batch_number: int
    rank: int
    note: str
    dropped: tuple[str, ...]
    state: Mapping[str, torch.Tensor] = field(repr=False)
    module_pickle: bytes = field(repr=False)
    encoded_args: tuple[Any, ...] = field(repr=False)
    encoded_kwargs: Mapping[str, Any] = field(repr=False)
    objects: tuple[bytes, ...] = field(repr=False)

    def build_module(self) -> nn.Module:
        """The module, rebuilt from its pickle with a fresh copy of its tensors, on the CPU.

        Raises:
            CapsuleError: it cannot be unpickled (a class it uses moved or does not import) or its state does not fit.
        """
        try:
            return load_module(self.module_pickle, self.state)
        except Exception as error:
            raise CapsuleError(
                f"capsule {str(self.path)!r}: its module ({self.module_class}) cannot be rebuilt: "
                f"{_one_line(error)}; run nanwatch repro where the code it was written from imports, with that version "
                f"of it (the capsule was written with torch {self.torch_version})"
            ) from error

    def inputs(self) -> CallInputs:
        """The inputs the module was called with: fresh tensors on the CPU, the pickled values unpickled, the dropped
        ones None.

        Raises:
            CapsuleError: a pickled input cannot be unpickled here.
        """
        try:
            return decode_inputs(self.encoded_args, self.encoded_kwargs, self.objects)
        except Exception as error:
            raise CapsuleError(
                f"capsule {str(self.path)!r}: its inputs cannot be loaded: {_one_line(error)}; run nanwatch repro "
                "where the code that defines them imports"
            ) from error


def capsule_file_name(rank: int, batch_number: int, phase: str = "train") -> str:
    """`nanwatch-capsule-rank{R}-batch{N}.pt` (`nanwatch-capsule-eval-...` for an eval forward), named as reports."""
    infix = "" if phase == "train" else f"-{phase}"
    return f"nanwatch-capsule{infix}-rank{rank}-batch{batch_number}.pt"


def write_capsule(
    path: str | Path,
    module: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    dtype: torch.dtype | str,
    autocast: Mapping[str, str],
    compile_backend: str | None,
    compile_mode: str | None,
    module_name: str,
    batch_number: int,
    rank: int,
    note: str = "",
) -> Path:
    """Write the capsule of one call `module(*args, **kwargs)` to `path`, whole or not at all.

    Args:
        path: the file to write (its folder is created); by convention `capsule_file_name(rank, batch_number)` in
            report_dir.
        module: the module that was called; a `torch.compile` wrapper is unwrapped (give the backend instead). It is
            not changed.
        args, kwargs: what it was called with (tensors anywhere inside are copied to the CPU).
        dtype: the dtype it ran in.
        autocast: autocast during the call, as `nanwatch.core.runstate.autocast_state()` gives it.
        compile_backend: the torch.compile backend it ran under ("inductor", "aot_eager"), None when not compiled.
        compile_mode: the torch.compile mode ("max-autotune"), or None.
        module_name: its qualified name in the model ("" for the model itself).
        batch_number, rank: the micro-batch and the process it ran in.
        note: a line for whoever reads the capsule (why it was written).

    Returns:
        `path`, as a `Path`.

    Raises:
        CapsuleError: the module cannot be pickled (it holds a lock or a file, its class is local to a function);
            nothing was written.
        OSError: the file cannot be written; nothing was left behind.
    """
    path = Path(path)
    module = unwrap_compiled(module)
    try:
        saved = save_module(module)
    except Exception as error:  # pickling fails in many ways: PicklingError, TypeError, AttributeError
        raise CapsuleError(
            f"module {module_name!r} ({class_path(type(module))}) cannot be saved in a capsule: "
            f"{_one_line(error)}; its class must be importable and hold no lock, file or thread"
        ) from error
    inputs = encode_inputs(args, kwargs)
    payload = {
        "format": CAPSULE_FORMAT,
        "version": CAPSULE_VERSION,
        "torch_version": str(torch.__version__),
        "nanwatch_version": __version__,
        "module_name": module_name,
        "module_class": class_path(type(module)),
        "training": module.training,
        "module_pickle": saved.pickle,
        "state": saved.state,
        "args": inputs.args,
        "kwargs": inputs.kwargs,
        "objects": inputs.objects,
        "dropped": inputs.dropped + saved.dropped,
        "dtype": str(dtype).removeprefix("torch."),
        "autocast": {str(key): str(value) for key, value in autocast.items()},
        "compile_backend": compile_backend,
        "compile_mode": compile_mode,
        "device": str(_device_of(module, args, kwargs)),
        "batch_number": batch_number,
        "rank": rank,
        "note": note,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return path


def read_capsule(path: str | Path) -> Capsule:
    """Read a capsule with a weights-only load, check it is one this nanwatch reads, and that its class imports.

    Importing the module that defines the class runs that module's code, as importing it anywhere would; nothing
    from the file itself is unpickled (see `Capsule.build_module`).

    Raises:
        CapsuleError: `path` is not a file, not a capsule (another torch file, or none), a capsule of a newer format
            version, a damaged one, or one whose module class cannot be imported here. One line each.
    """
    path = Path(path)
    data = _checked(_load(path), path)
    _import_class(data["module_class"], path)
    return Capsule(
        path=path,
        version=data["version"],
        torch_version=data["torch_version"],
        nanwatch_version=data["nanwatch_version"],
        module_name=data["module_name"],
        module_class=data["module_class"],
        training=data["training"],
        dtype=data["dtype"],
        autocast=dict(data["autocast"]),
        compile_backend=data["compile_backend"],
        compile_mode=data["compile_mode"],
        device=data["device"],
        batch_number=data["batch_number"],
        rank=data["rank"],
        note=data["note"],
        dropped=tuple(str(line) for line in data["dropped"]),
        state=data["state"],
        module_pickle=data["module_pickle"],
        encoded_args=data["args"],
        encoded_kwargs=data["kwargs"],
        objects=tuple(data["objects"]),
    )


# --------------------------------------------------------------------------------------------------------------------


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def _device_of(module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.device:
    """Where the call ran: the module's first tensor's device, else the first input tensor's, else the CPU."""
    tensors = chain(module.parameters(), module.buffers(), args, kwargs.values())
    return next((value.device for value in tensors if isinstance(value, torch.Tensor)), torch.device("cpu"))


def _load(path: Path) -> Any:
    """What the torch file at `path` holds, weights-only; every way it is not one as a `CapsuleError`."""
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        raise CapsuleError(f"{str(path)!r} {what}; {_WHAT_TO_GIVE}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # A weights-only load refuses Python objects: a capsule never holds any outside its pickled bytes.
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
        held = f"it holds Python objects: {found.group(1)}" if found else "not a file torch.save wrote"
        raise CapsuleError(f"{str(path)!r} is not a nanwatch capsule ({held}); {_WHAT_TO_GIVE}") from error
    except Exception as error:  # a zip that is not torch's, a truncated file, plain text: torch raises all kinds
        raise CapsuleError(
            f"{str(path)!r} is not a nanwatch capsule (not a file torch.save wrote: {type(error).__name__}); "
            f"{_WHAT_TO_GIVE}"
        ) from error


def _checked(data: Any, path: Path) -> dict[str, Any]:
    """`data`, once it is a whole capsule of a version this nanwatch reads; else a `CapsuleError`."""
    if not isinstance(data, dict) or data.get("format") != CAPSULE_FORMAT:
        if isinstance(data, dict):
            what = f"a dict with keys {sorted(map(str, data))[:8]}"
        else:
            what = f"a {type(data).__name__}"
        raise CapsuleError(
            f"{str(path)!r} is a torch file but not a nanwatch capsule (it holds {what}); {_WHAT_TO_GIVE}"
        )
    version = data.get("version")
    if not isinstance(version, int) or version > CAPSULE_VERSION:
        raise CapsuleError(
            f"capsule {str(path)!r} has format version {version!r}; this nanwatch ({__version__}) reads versions up "
            f"to {CAPSULE_VERSION}; upgrade nanwatch (pip install -U nanwatch)"
        )
    problems = [
        f"{key!r} ({'missing' if key not in data else f'a {type(data[key]).__name__}'})"
        for key, expected in _REQUIRED.items()
        if not isinstance(data.get(key), expected)
    ]
    if isinstance(data.get("state"), dict):
        problems += [
            f"state[{name!r}] (a {type(value).__name__}, not a tensor)"
            for name, value in data["state"].items()
            if not isinstance(value, torch.Tensor)
        ]
    if isinstance(data.get("module_class"), str) and not _CLASS_PATH.match(data["module_class"]):
        problems.append(f"'module_class' ({data['module_class']!r}, not package.module:ClassName)")
    if problems:
        raise CapsuleError(
            f"capsule {str(path)!r} is damaged: bad or missing entries {', '.join(problems)}; the file was changed "
            "after it was written: use the one nanwatch wrote"
        )
    return data


def _import_class(text: str, path: Path) -> type:
    """The class `package.module:Qual.Name` names, once it imports and is a torch module; else a `CapsuleError`."""
    module_path, _, qualname = text.partition(":")
    cannot = f"capsule {str(path)!r}: its module's class {text} cannot be imported here"
    if module_path == "__main__":
        raise CapsuleError(
            f"{cannot}: it was defined in the script that ran (__main__), which another process cannot import; "
            "define the class in a module the script imports, and write the capsule again"
        )
    try:
        found: Any = importlib.import_module(module_path)
    except Exception as error:  # ImportError, or whatever the module raises as it is imported
        raise CapsuleError(
            f"{cannot} ({_one_line(error)}); run nanwatch repro where the code that defines it imports "
            f"(its project's folder, or with it on PYTHONPATH)"
        ) from error
    for part in qualname.split("."):
        if not hasattr(found, part):
            raise CapsuleError(
                f"{cannot}: {module_path} has no {qualname}; run nanwatch repro with the code the capsule was "
                "written from (the class was renamed or moved since)"
            )
        found = getattr(found, part)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise CapsuleError(
            f"{cannot}: {text} is a {type(found).__name__}, not a torch.nn.Module class; {_WHAT_TO_GIVE}"
        )
    return found
