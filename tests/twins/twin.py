"""What a twin run ended with: the model's weights and buffers, the optimizer's state, every RNG a user draws from,
and how many optimizer steps ran, compared bit for bit (tests/twins/)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TwinEnd:
    tensors: dict[str, bytes]  # name -> dtype, shape and raw bytes
    torch_rng: bytes
    python_rng: object
    numpy_rng: str
    steps: int

    def differences(self, other: TwinEnd) -> list[str]:
        """What differs between two ends, by name (empty when they are bit-identical)."""
        names = self.tensors.keys() | other.tensors.keys()
        found = [name for name in names if self.tensors.get(name) != other.tensors.get(name)]
        for part in ("torch_rng", "python_rng", "numpy_rng", "steps"):
            if getattr(self, part) != getattr(other, part):
                found.append(part)
        return sorted(found)


def _raw(tensor: torch.Tensor) -> bytes:
    local = tensor.detach().contiguous().cpu()
    header = f"{local.dtype} {tuple(local.shape)}|".encode()
    return header + local.reshape(-1).view(torch.uint8).numpy().tobytes()


def twin_end(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, steps: int) -> TwinEnd:
    tensors = {f"model.{name}": _raw(value) for name, value in model.state_dict().items()}
    if optimizer is not None:
        for index, state in enumerate(optimizer.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer.{index}.{key}"] = _raw(value)
    return TwinEnd(tensors, _raw(torch.get_rng_state()), random.getstate(), repr(np.random.get_state()), steps)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


class StepCounter:
    """Counts the optimizer steps that ran (a step nanwatch refused or skipped does not)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.count = 0
        optimizer.register_step_post_hook(self._ran)

    def _ran(self, *_: object) -> None:
        self.count += 1
