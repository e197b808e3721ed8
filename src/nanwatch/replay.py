"""`nanwatch replay`: run the forward that went inf/nan again, from its replay file, with every module traced.

With `capture_on_detect=True` the detecting process saves `report_dir/replay-rank{R}-batch{N}.pt`: the inputs of the
failing top-level forward, the RNG states, and the weights and buffers as that forward began. `replay()` rebuilds
the model from a factory, checks the saved state fits it, restores that state and runs that one forward under a
watcher: every frame of the batch, in seconds, instead of training again to batch N. The frames are compared,
value for value, with those of the original report.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.features.culprit import culprit_section, find_culprit
from nanwatch.core.features.headroom import HeadroomMonitor
from nanwatch.core.formats.files import atomic_write
from nanwatch.core.formats.replay_file import load_replay_file
from nanwatch.core.frames import ResolvedFrame, counter_name, resolve
from nanwatch.core.report import MODULE_INDENT, TABLE_HEADER, Report, format_frame
from nanwatch.core.runstate import (
    capture_rng_states,
    determinism_flags,
    restore_rng_states,
    set_determinism_flags,
)
from nanwatch.core.stats import registry
from nanwatch.core.watcher import Watcher
from nanwatch.errors import ConfigError, ReplayError

__all__ = [
    "ModelSource",
    "ReplayError",
    "ReplayResult",
    "UserCodeFailed",
    "check_state_fits",
    "load_factory",
    "replay",
    "write_replay_outputs",
]

ModelSource: TypeAlias = torch.nn.Module | Callable[[], torch.nn.Module] | str
_MAX_LISTED = 10  # names listed per kind of mismatch; the rest are counted
# The captured config's fields that the report's headroom section depends on.
_HEADROOM_FIELDS = ("headroom_warn_fraction", "target_dtype")


# ------------------------------------------------------------------------------------------------ the model


def load_factory(spec: str) -> Callable[[], Any]:
    """Import `package.module:factory` (the attribute may be dotted: `module:Class.build`) and return it.

    Raises:
        ReplayError: the spec is malformed, the module cannot be imported, or it has no such callable.
    """
    module_path, colon, attribute = spec.partition(":")
    if not colon or not module_path or not attribute:
        raise ReplayError(f"--model must be 'package.module:factory' (a callable returning the model), got {spec!r}")
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_path == error.name or module_path.startswith(error.name + ".")):
            raise ReplayError(
                f"cannot import module {module_path!r} (from --model {spec!r}): no module named {error.name!r} "
                f"on the Python path (the current directory is {os.getcwd()!r})"
            ) from error
        raise ReplayError(f"importing module {module_path!r} (from --model {spec!r}) failed: {error}") from error
    except Exception as error:  # the user's module raised at import: say so, keep their exception chained
        raise UserCodeFailed(
            f"importing module {module_path!r} (from --model {spec!r}) raised {type(error).__name__}: {error}"
        ) from error
    target: Any = module
    parts = attribute.split(".")
    for depth, part in enumerate(parts):
        if not hasattr(target, part):
            where = f"module {module_path!r}" if depth == 0 else repr(f"{module_path}:{'.'.join(parts[:depth])}")
            raise ReplayError(
                f"{where} has no attribute {part!r} (from --model {spec!r}); callables defined there: "
                + (", ".join(_callables_in(target, module_path)) or "none")
            )
        target = getattr(target, part)
    if not callable(target):
        raise ReplayError(
            f"--model {spec!r} names an object of type {type(target).__name__}, not a callable that returns the model"
        )
    factory: Callable[[], Any] = target
    return factory


class UserCodeFailed(ReplayError):
    """The user's module or factory raised; the command line shows its traceback (the `__cause__`) too."""


def _callables_in(namespace: Any, module_path: str) -> list[str]:
    names = []
    for name, value in vars(namespace).items():
        defined_here = getattr(value, "__module__", module_path) == module_path
        if not name.startswith("_") and callable(value) and defined_here:
            names.append(name)
    return sorted(names)


def _build_model(source: ModelSource) -> tuple[torch.nn.Module, str]:
    """The model to replay on, and words naming where it came from."""
    if isinstance(source, torch.nn.Module):
        return source, f"the given {type(source).__name__}"
    if isinstance(source, str):
        factory, origin = load_factory(source), source
    elif callable(source):
        factory, origin = source, getattr(source, "__qualname__", repr(source))
    else:
        raise ReplayError(
            f"the model must be a torch.nn.Module, a callable returning one, or 'package.module:factory', "
            f"got {type(source).__name__}"
        )
    try:
        model = factory()
    except Exception as error:
        raise UserCodeFailed(f"the factory {origin} raised {type(error).__name__}: {error}") from error
    if not isinstance(model, torch.nn.Module):
        raise ReplayError(f"the factory {origin} returned a {type(model).__name__}, not a torch.nn.Module")
    return model, origin


def _qualified_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


def check_state_fits(data: dict[str, Any], model: torch.nn.Module, *, origin: str, path: str | Path) -> None:
    """Check that the file's parameters and buffers match `model`'s names, shapes and dtypes.

    Only the state must fit: a model whose code changed elsewhere (a fix being tried) replays fine.

    Raises:
        ReplayError: naming every parameter or buffer that is missing, unexpected, or of another shape or dtype.
    """
    problems = []
    for kind, saved, current in (
        ("parameters", data["parameters"], dict(model.named_parameters())),
        ("buffers", data["buffers"], dict(model.named_buffers())),
    ):
        missing = [name for name in saved if name not in current]
        unexpected = [name for name in current if name not in saved]
        shapes = [
            f"{name} (file {list(saved[name].shape)}, model {list(current[name].shape)})"
            for name in saved
            if name in current and saved[name].shape != current[name].shape
        ]
        dtypes = [
            f"{name} (file {_dtype(saved[name])}, model {_dtype(current[name])})"
            for name in saved
            if name in current and saved[name].dtype != current[name].dtype
        ]
        if missing:
            problems.append(f"{kind} in the file but not in the model: {_listed(missing)}")
        if unexpected:
            problems.append(f"{kind} in the model but not in the file: {_listed(unexpected)}")
        if shapes:
            problems.append(f"{kind} of another shape: {_listed(shapes)}")
        if dtypes:
            problems.append(f"{kind} of another dtype: {_listed(dtypes)}")
    if problems:
        captured, built = data["model_class"], _qualified_name(model)
        classes = f"both are {built}" if captured == built else f"the file was captured from {captured}, not {built}"
        raise ReplayError(
            f"replay file {str(path)!r} does not fit the model built by {origin} ({classes}):\n  - "
            + "\n  - ".join(problems)
        )


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class ReplayResult:
    """What a replay found.

    Attributes:
        path: the replay file.
        model_class: the qualified class name of the model the file was captured from.
        batch_number: the replayed batch (counted in `phase`).
        phase: "train" or "eval".
        rank: the rank that captured the file.
        world_size: the number of processes of the original run.
        device: where the forward ran now.
        frames: every frame of the replayed forward, in call order.
        first_non_finite: index in `frames` of the first frame holding inf/nan, or None if the replay stayed finite.
        report: the report the replay gives (the last `max_frames_to_save` frames ending at the first inf/nan, in the
            original's format), or None if the replay stayed finite.
        original_report: the report captured with the file, as `Report.to_dict()` gave it.
        compared_frames: how many frames of the original report (those of the replayed batch) were compared.
        differences: where the replay differs from those frames; empty when they are equal, value for value.
        notes: what could not be restored as it was (another device, no CUDA here, ...).
    """

    path: Path
    model_class: str
    batch_number: int
    phase: str
    rank: int
    world_size: int
    device: str
    frames: list[ResolvedFrame]
    first_non_finite: int | None
    report: Report | None
    original_report: dict[str, Any]
    compared_frames: int
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        """The replayed forward went inf/nan again."""
        return self.first_non_finite is not None

    @property
    def matches_original(self) -> bool:
        """The replay went inf/nan with the frames of the original report, value for value."""
        return self.reproduced and not self.differences

    @property
    def counter(self) -> str:
        return counter_name(self.phase)

    def trace_text(self) -> str:
        """Every frame of the replayed forward in transformers' format, under a batch header as tracing prints."""
        where = f" on rank {self.rank}" if self.world_size > 1 else ""
        lines = [f"{MODULE_INDENT} *** Starting batch number={self.batch_number}{where} ***", TABLE_HEADER]
        lines.extend(format_frame(frame) for frame in self.frames)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data: every frame in the report's JSON form, the report, the comparison."""
        every_frame = Report(self.batch_number, self.phase, self.rank, self.world_size, None, self.frames)
        return {
            "file": str(self.path),
            "model_class": self.model_class,
            "batch_number": self.batch_number,
            "phase": self.phase,
            "rank": self.rank,
            "world_size": self.world_size,
            "device": self.device,
            "first_non_finite": self.first_non_finite,
            "matches_original": self.matches_original,
            "compared_frames": self.compared_frames,
            "differences": list(self.differences),
            "notes": list(self.notes),
            "frames": every_frame.to_dict()["frames"],
            "report": None if self.report is None else self.report.to_dict(),
        }

    def summary(self) -> str:
        """Where inf/nan first appears, and whether that matches the original report."""
        lines = [f"note: {note}" for note in self.notes]
        if self.first_non_finite is None:
            lines.append(f"The replay of {self.counter}={self.batch_number} stayed finite: no inf/nan in its frames.")
        else:
            frame = self.frames[self.first_non_finite]
            labels = ", ".join(entry.label for entry in frame.entries if entry.non_finite)
            lines.append(
                f"inf/nan first appears in frame {self.first_non_finite + 1} of {len(self.frames)}: "
                f"module {frame.module_name!r} ({frame.class_name}), in {labels}"
            )
        if self.matches_original:
            earlier = len(self.original_report.get("frames", [])) - self.compared_frames
            lines.append(
                f"The replay matches the original report: its {self.compared_frames} frames of "
                f"{self.counter}={self.batch_number} are equal, value for value"
                + (
                    f" (its other {earlier} come from earlier batches, which a replay does not run)."
                    if earlier
                    else "."
                )
            )
        else:
            lines.append("The replay differs from the original report:")
            lines.extend(f"  - {difference}" for difference in self.differences)
        return "\n".join(lines)


def _compare(original: dict[str, Any], replayed: list[dict[str, Any]], batch_number: int, phase: str) -> list[str]:
    """Differences between the original report's frames of the replayed batch and the replay's frames ending at
    its first inf/nan (`replayed`, as `Report.to_dict()` writes them): names, dtypes, shapes, notes, and the values
    of every statistic both reports carry (core/stats/registry.py), compared exactly."""
    ours = [f for f in original.get("frames", []) if f.get("batch_number") == batch_number and f.get("phase") == phase]
    if not ours:
        return ["the original report holds no frame of the replayed batch"]
    if not replayed:
        return [f"the original report's {len(ours)} frames end at inf/nan; the replay has none"]
    if len(replayed) < len(ours):
        return [f"the replay reaches inf/nan after {len(replayed)} frames of the batch, the original after {len(ours)}"]
    differences = []
    for before, after in zip(ours, replayed[-len(ours) :], strict=True):
        name = f"{before.get('module')!r} ({before.get('class')})"
        if (before.get("module"), before.get("class")) != (after["module"], after["class"]):
            differences.append(f"frame {name} is {after['module']!r} ({after['class']}) in the replay")
            continue
        old_entries = {entry.get("label"): entry for entry in before.get("entries", [])}
        new_entries = {entry["label"]: entry for entry in after["entries"]}
        if list(old_entries) != list(new_entries):
            differences.append(f"frame {name} has entries {list(new_entries)}, the original {list(old_entries)}")
            continue
        for label, entry in new_entries.items():
            old = old_entries[label]
            for key in ("dtype", "shape", "note"):
                if old.get(key) != entry[key]:
                    differences.append(f"frame {name}, {label} {key}: original {old.get(key)}, replay {entry[key]}")
            differences += _compare_statistics(name, label, old, entry)
    return differences


def _compare_statistics(name: str, label: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    differences = []
    for statistic in registry.statistics():
        if not statistic.in_report_json:
            continue
        try:
            before, after = statistic.from_report_json(old), statistic.from_report_json(new)
        except ValueError as error:  # a damaged original report
            differences.append(f"frame {name}, {label}: the original's {statistic.name} cannot be read ({error})")
            continue
        if before is None or after is None:  # one side did not measure it (count_underflow off then, on now)
            continue
        for column, a, b in zip(statistic.columns, before, after, strict=True):
            if not _same_number(a, b):
                differences.append(f"frame {name}, {label} {column.name}: original {a}, replay {b}")
    return differences


def _same_number(a: object, b: object) -> bool:
    # nan equals nan here: the same bits replayed are the same result.
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


# ---------------------------------------------------------------------------------------------- the replay


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        items = [_to_device(item, device) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def _pick_device(captured: str, device: str | torch.device | None, notes: list[str]) -> torch.device:
    if device is not None:
        try:
            chosen = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ReplayError(f"device must be like 'cpu' or 'cuda:0', got {device!r}") from error
    else:
        chosen = torch.device(captured)
        usable = chosen.type == "cpu" or (
            chosen.type == "cuda" and torch.cuda.is_available() and (chosen.index or 0) < torch.cuda.device_count()
        )
        if not usable:
            chosen = torch.device("cpu")
    if str(chosen) != captured:
        notes.append(f"captured on {captured}, replayed on {chosen}: the numbers may differ in the last bits")
    return chosen


def replay(
    path: str | Path,
    model: ModelSource,
    *,
    device: str | torch.device | None = None,
    max_frames_to_save: int | None = None,
    trusted: bool = False,
) -> ReplayResult:
    """Run the forward saved in a replay file again, with every module watched.

    Args:
        path: a `replay-rank{R}-batch{N}.pt` file written by `capture_on_detect=True`.
        model: the model, or a callable that builds it, or `"package.module:factory"`. A model given as is has its
            parameters, buffers and training modes overwritten by the file's.
        device: where to run; by default where the forward first ran, or the CPU when that device is not here.
        max_frames_to_save: frames in `result.report`; by default those of the config the file was captured with.
        trusted: allow inputs that are Python objects besides tensors and containers (unpickling runs their code).

    Returns:
        A `ReplayResult`: every frame, where inf/nan first appears, the report, and its comparison with the original.

    Raises:
        ReplayError: the file is not a replay file, the factory cannot be loaded, or the state does not fit the model.
            Nothing is changed on disk in any case. An exception raised by the model's own forward propagates as is.
    """
    callers_rng = capture_rng_states()  # the factory and the forward both draw from the generators
    try:
        return _replay(Path(path), model, device, max_frames_to_save, trusted)
    finally:
        restore_rng_states(callers_rng)


def _replay(
    path: Path, model: ModelSource, device: str | torch.device | None, max_frames_to_save: int | None, trusted: bool
) -> ReplayResult:
    data = load_replay_file(path, trusted=trusted)
    # Only this field of the stored config matters here (and the headroom ones, below), each read alone: a file from
    # a nanwatch with more fields works.
    stored = data["config"].get("max_frames_to_save")
    frames_to_save = max_frames_to_save if max_frames_to_save is not None else stored if isinstance(stored, int) else 21
    if frames_to_save < 1:
        raise ReplayError(f"max_frames_to_save must be at least 1, got {frames_to_save}")
    built, origin = _build_model(model)
    check_state_fits(data, built, origin=origin, path=path)
    notes: list[str] = []
    target = _pick_device(data["device"], device, notes)
    built.to(target)
    _restore_state(built, data)
    args = _to_device(data["args"], target)
    kwargs = _to_device(data["kwargs"], target)

    batch_number, phase = data["batch_number"], data["phase"]
    watcher = Watcher(
        built,
        WatchConfig(max_frames_to_save=frames_to_save, watch_eval=True),
        rank=data["rank"],
        world_size=data["world_size"],
    )
    watcher.load_state_dict({"batch_number": batch_number, "eval_batch_number": batch_number})
    watcher.start_batch(phase)
    frames = _run_forward(built, watcher, data, args, kwargs, target, notes)

    resolved = resolve(frames)
    first = next((index for index, frame in enumerate(resolved) if frame.non_finite), None)
    original: dict[str, Any] = data["report"]
    compared = sum(
        1 for f in original.get("frames", []) if f.get("batch_number") == batch_number and f.get("phase") == phase
    )
    report = None
    if first is None:
        differences = [f"the original went inf/nan in module {original.get('module_name')!r}; the replay stayed finite"]
    else:
        culprit = find_culprit(resolved, first)  # as the watcher names it, from the same frames
        # The section CulpritFeature.annotate gives a watched run's report: the replay's report must read the same.
        section = culprit_section(culprit)

        def report_of(frames: list[ResolvedFrame]) -> Report:
            return Report(
                batch_number=batch_number,
                phase=phase,
                rank=data["rank"],
                world_size=data["world_size"],
                module_name=resolved[first].module_name,
                frames=frames,
                optimizer_step=data.get("optimizer_step"),
                epoch=data.get("epoch"),
                sections=(section,),
            )

        up_to_first = report_of(resolved[: first + 1]).to_dict()["frames"]
        differences = _compare(original, up_to_first, batch_number, phase)
        report = report_of(resolved[max(0, first + 1 - frames_to_save) : first + 1])
        # And the section HeadroomMonitor.annotate gives it, under the headroom settings of the capture.
        try:
            headroom = WatchConfig(**{key: data["config"][key] for key in _HEADROOM_FIELDS if key in data["config"]})
        except ConfigError:  # a value this nanwatch does not take: the report goes without the section
            headroom = WatchConfig(headroom_warn_fraction=None)
        if HeadroomMonitor.wanted(headroom):
            report = HeadroomMonitor(headroom).with_findings(report, resolved)
    return ReplayResult(
        path=path,
        model_class=data["model_class"],
        batch_number=batch_number,
        phase=phase,
        rank=data["rank"],
        world_size=data["world_size"],
        device=str(target),
        frames=resolved,
        first_non_finite=first,
        report=report,
        original_report=original,
        compared_frames=compared,
        differences=differences,
        notes=notes,
    )


def _restore_state(model: torch.nn.Module, data: dict[str, Any]) -> None:
    """Put the file's parameters, buffers and training modes into `model` (whose state was checked to fit)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(data["parameters"][name])
        for name, buffer in model.named_buffers():
            buffer.copy_(data["buffers"][name])
    modes: dict[str, bool] = data["training_modes"]
    model.train(bool(modes.get("", True)))
    # Module by module: a submodule frozen in eval mode (a BatchNorm, say) must stay so.
    for name, module in model.named_modules():
        if name in modes:
            module.training = bool(modes[name])


def _run_forward(
    model: torch.nn.Module,
    watcher: Watcher,
    data: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: torch.device,
    notes: list[str],
) -> list[Any]:
    """Run the forward as it first ran (generators, threads, determinism, autocast, grad mode); put those back."""
    callers_threads = torch.get_num_threads()
    callers_determinism = determinism_flags()
    watcher.attach()
    try:
        notes.extend(restore_rng_states(data["rng"]))
        # Reductions are split by thread count: the same count gives the same bits on the CPU.
        torch.set_num_threads(data["num_threads"])
        set_determinism_flags(data.get("determinism", {}))
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(data["grad_enabled"]))
            for device_type, dtype_name in data["autocast"].items():
                if device_type != target.type:
                    notes.append(f"autocast on {device_type} ({dtype_name}) was on; not applicable on {target}")
                    continue
                stack.enter_context(torch.autocast(device_type, dtype=getattr(torch, dtype_name)))
            model(*args, **kwargs)
        if watcher.disabled_reason is not None:
            raise ReplayError(f"the replay could not watch the forward: {watcher.disabled_reason}")
        return watcher.recent_frames()
    finally:
        watcher.close(check=False)
        torch.set_num_threads(callers_threads)
        set_determinism_flags(callers_determinism)


def write_replay_outputs(report_dir: Path, result: ReplayResult, text: str) -> list[Path]:
    """Write the replay's text and JSON to `report_dir/nanwatch-replay[-phase]-rank{R}-batch{N}.txt/.json`.

    Named apart from the original report (`nanwatch-report-...`), which is never overwritten. Each file is written
    whole or not at all.
    """
    report_dir.mkdir(parents=True, exist_ok=True)
    infix = "" if result.phase == "train" else f"-{result.phase}"
    stem = f"nanwatch-replay{infix}-rank{result.rank}-batch{result.batch_number}"
    paths = [report_dir / f"{stem}.json", report_dir / f"{stem}.txt"]
    for path, content in zip(paths, [json.dumps(result.to_dict(), indent=2), text], strict=True):
        atomic_write(path, content + "\n")
    return paths
