"""What a forward depends on besides its inputs and weights: the random generators, autocast, the determinism
switches. Captured where a forward begins and restored to run it again (capture, sentinel replay, `nanwatch.replay`).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "autocast_state",
    "autocast_as",
    "capture_rng_states",
    "restore_rng_states",
    "determinism_flags",
    "set_determinism_flags",
]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> dict[str, str]:
    """The device types autocast is on for now, with the dtype it casts to (`{"cuda": "float16"}`)."""
    return {
        device_type: str(torch.get_autocast_dtype(device_type)).replace("torch.", "")
        for device_type in _AUTOCAST_DEVICE_TYPES
        if torch.is_autocast_enabled(device_type)
    }


@contextlib.contextmanager
def autocast_as(state: Mapping[str, str]) -> Iterator[None]:
    """Autocast on exactly as `autocast_state()` found it (only for the device types given)."""
    with contextlib.ExitStack() as stack:
        for device_type, dtype_name in state.items():
            stack.enter_context(torch.autocast(device_type, dtype=getattr(torch, dtype_name)))
        yield


def capture_rng_states(*, numpy: bool = False) -> dict[str, Any]:
    """The python, torch CPU and (if CUDA was initialised) CUDA generator states; with `numpy`, numpy's global
    generator's too, where numpy was imported (a replay in this process restores it; a replay file does not keep it)."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy_module = sys.modules.get("numpy") if numpy else None
    if numpy_module is not None:
        states["numpy"] = numpy_module.random.get_state()
    # Asking for CUDA states would initialise CUDA in a CPU-only run; if it was never initialised, nothing used it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> list[str]:
    """Set the generators to `states`; return notes on what could not be restored (empty when all was)."""
    notes = []
    if "python" in states:
        random.setstate(_as_python_state(states["python"]))
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "numpy" in states:
        sys.modules["numpy"].random.set_state(states["numpy"])  # captured only where numpy was imported
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
