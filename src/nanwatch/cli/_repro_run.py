"""One run of a capsule's module for `nanwatch repro`: what runs (dtype, autocast, backend, device), and what came
out (inf and nan counts, abs max), each run on a module and inputs rebuilt fresh from the capsule."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from nanwatch.core.formats.capsule import CallInputs, Capsule
from nanwatch.core.runstate import autocast_as

__all__ = ["RunSpec", "RunDevice", "Outcome", "recorded_spec", "requested_spec", "run_device", "run_once"]

_ERROR_CHARACTERS = 300  # of a run's error message, on its one line


@dataclass(frozen=True)
class RunSpec:
    """How to run the module: in `dtype` (the capsule's; or, with `cast`, the one asked for, the module and the
    floating-point inputs cast to it), under `autocast`, compiled with `backend` and `mode` (None: eagerly)."""

    label: str
    dtype: str
    cast: bool
    autocast: Mapping[str, str] = field(default_factory=dict)
    backend: str | None = None
    mode: str | None = None

    def describe(self, device: torch.device) -> str:
        """`float16, autocast off, compiled (aot_eager), on cpu`."""
        autocast = ", ".join(f"{kind} {dtype}" for kind, dtype in self.autocast.items()) or "off"
        if self.backend is None:
            how = "eager"
        else:
            how = f"compiled ({self.backend}{f', mode {self.mode}' if self.mode else ''})"
        return f"{self.dtype}, autocast {autocast}, {how}, on {device}"


@dataclass(frozen=True)
class RunDevice:
    """Where the runs go: where the capsule's call ran when this process can use it, else the CPU (`note` says so)."""

    device: torch.device
    note: str | None


@dataclass(frozen=True)
class Outcome:
    """What one run gave: counts over every floating-point tensor of the output, or the error it raised."""

    values: int = 0
    inf: int = 0
    nan: int = 0
    abs_max: float = float("nan")  # over the values that are not nan; nan when all are
    error: str | None = None

    @property
    def finite(self) -> bool:
        return self.error is None and self.inf == 0 and self.nan == 0

    def describe(self) -> str:
        """`finite (8 values), abs max 8.00e+04` or `not finite (8 inf, 0 nan of 8 values), abs max inf`."""
        if self.error is not None:
            return f"failed: {self.error}"
        if self.values == 0:
            return "finite (no floating-point tensor in the output)"
        if self.finite:
            return f"finite ({self.values} values), abs max {self.abs_max:.2e}"
        return f"not finite ({self.inf} inf, {self.nan} nan of {self.values} values), abs max {self.abs_max:.2e}"


def recorded_spec(capsule: Capsule, device: torch.device) -> RunSpec:
    """The run as the capsule recorded it, on `device`: its dtype, its autocast, its backend and mode."""
    return RunSpec(
        label="as recorded",
        dtype=capsule.dtype,
        cast=False,
        autocast=_autocast_on(capsule.autocast, torch.device(capsule.device), device),
        backend=capsule.compile_backend,
        mode=capsule.compile_mode,
    )


def requested_spec(capsule: Capsule, device: torch.device, *, dtype: str | None, backend: str | None) -> RunSpec:
    """The recorded run with what was asked changed: a dtype (module and floating inputs cast, autocast off), a
    backend (`eager`: not compiled; the recorded mode kept only for the recorded backend)."""
    spec = replace(recorded_spec(capsule, device), label="requested")
    if dtype is not None:
        spec = replace(spec, dtype=dtype, cast=True, autocast={})
    if backend is not None:
        compiled = None if backend == "eager" else backend
        spec = replace(
            spec, backend=compiled, mode=capsule.compile_mode if compiled == capsule.compile_backend else None
        )
    return spec


def run_device(capsule: Capsule) -> RunDevice:
    """The device the capsule's call ran on when torch can put a tensor there in this process, else the CPU."""
    try:
        recorded = torch.device(capsule.device)
        torch.empty(1, device=recorded)
    except Exception:  # RuntimeError, AssertionError: whatever a backend raises when it is not there
        return RunDevice(
            torch.device("cpu"),
            f"recorded on {capsule.device}, which this process cannot use: the runs go on the cpu, whose kernels "
            "may round otherwise",
        )
    return RunDevice(recorded, None)


def run_once(capsule: Capsule, spec: RunSpec, device: torch.device) -> Outcome:
    """Rebuild the module and its inputs, run them as `spec` says on `device`, and count the output's inf and nan.

    Raises:
        CapsuleError: the module or its inputs cannot be rebuilt from the capsule (before anything runs).
    """
    module = capsule.build_module()
    inputs = capsule.inputs()
    dtype = getattr(torch, spec.dtype) if spec.cast else None
    module = module.to(device=device, dtype=dtype) if dtype is not None else module.to(device=device)
    inputs = CallInputs(args=_moved(inputs.args, device, dtype), kwargs=_moved(inputs.kwargs, device, dtype))
    torch.manual_seed(0)  # a Dropout in training mode draws the same mask in every run
    try:
        call = _compiled(module, spec.backend, spec.mode) if spec.backend is not None else module
        with torch.no_grad(), autocast_as(spec.autocast):
            output = call(*inputs.args, **inputs.kwargs)
    except Exception as error:  # the module's own code, a kernel this device lacks, a backend that fails to compile
        text = " ".join(f"{type(error).__name__}: {error}".split())
        return Outcome(error=text if len(text) <= _ERROR_CHARACTERS else text[: _ERROR_CHARACTERS - 3] + "...")
    return _counted(output)


# --------------------------------------------------------------------------------------------------------------------


def _compiled(module: nn.Module, backend: str, mode: str | None) -> Any:
    torch._dynamo.reset()  # no graph compiled by an earlier run is reused
    return torch.compile(module, backend=backend, mode=mode)


def _autocast_on(state: Mapping[str, str], recorded: torch.device, device: torch.device) -> dict[str, str]:
    """Autocast as recorded, for the device the run goes on: a CUDA capsule's autocast applies to the CPU when the
    run moved there."""
    moved = dict(state)
    if recorded.type != device.type and recorded.type in moved:
        moved[device.type] = moved.pop(recorded.type)
    return moved


def _moved(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """`value` with its tensors on `device`, and its floating-point ones in `dtype` when given."""
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else None
        return value.to(device=device, dtype=cast) if cast is not None else value.to(device=device)
    if type(value) is tuple:
        return tuple(_moved(item, device, dtype) for item in value)
    if type(value) is list:
        return [_moved(item, device, dtype) for item in value]
    if type(value) is dict:
        return {key: _moved(item, device, dtype) for key, item in value.items()}
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors of an output: a tensor, or one inside tuples, lists and dicts (a model output)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)


def _counted(output: Any) -> Outcome:
    values = inf = nan = 0
    abs_max = float("nan")
    for tensor in _tensors(output):
        magnitudes = tensor.detach().abs()
        is_nan = torch.isnan(magnitudes)
        values += tensor.numel()
        inf += int(torch.isinf(magnitudes).sum())
        nan += int(is_nan.sum())
        if bool((~is_nan).any()):
            largest = float(magnitudes[~is_nan].max())
            abs_max = largest if abs_max != abs_max else max(abs_max, largest)  # abs_max != abs_max: still nan
    return Outcome(values=values, inf=inf, nan=nan, abs_max=abs_max)
