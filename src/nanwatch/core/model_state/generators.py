"""Random generators a model holds of its own (`self.gen = torch.Generator()`, `np.random.default_rng()`,
`random.Random()`): found once when watching starts, their states kept with each call like the global generators', and
restored for the replay. A draw from one that was not restored would make the replay run other numbers, and its
verdict would blame the hardware for what the model itself did.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["OwnGenerator", "capture", "held_by", "restore"]


class OwnGenerator:
    """One generator a module holds as a plain attribute, and how to read and set its state."""

    __slots__ = ("name", "generator")

    def __init__(self, name: str, generator: Any) -> None:
        self.name = name
        self.generator = generator

    def state(self) -> Any:
        generator = self.generator
        if isinstance(generator, torch.Generator):
            return generator.get_state()
        if isinstance(generator, random.Random):
            return generator.getstate()
        if hasattr(generator, "bit_generator"):  # numpy's Generator
            return generator.bit_generator.state
        return generator.get_state()  # numpy's RandomState

    def set_state(self, state: Any) -> None:
        generator = self.generator
        if isinstance(generator, torch.Generator):
            generator.set_state(state)
        elif isinstance(generator, random.Random):
            generator.setstate(state)
        elif hasattr(generator, "bit_generator"):
            generator.bit_generator.state = state
        else:
            generator.set_state(state)


def held_by(model: torch.nn.Module) -> list[OwnGenerator]:
    """The generators the model's modules hold as attributes, by `module.attribute` name, each once."""
    kinds: tuple[type, ...] = (torch.Generator, random.Random)
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # numpy is not a dependency: a model that holds its generators imported it
        kinds += (numpy.random.Generator, numpy.random.RandomState)
    found: dict[int, OwnGenerator] = {}
    for module_name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if isinstance(value, kinds) and id(value) not in found:
                found[id(value)] = OwnGenerator(f"{module_name}.{attribute}" if module_name else attribute, value)
    return list(found.values())


def capture(generators: Sequence[OwnGenerator]) -> list[Any]:
    return [generator.state() for generator in generators]


def restore(generators: Sequence[OwnGenerator], states: Sequence[Any]) -> None:
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)
