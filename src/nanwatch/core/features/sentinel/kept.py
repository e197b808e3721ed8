"""What sentinel mode keeps of a training micro-batch to run it again: references to each outermost call's inputs,
the state it began in, and copies of the buffers a forward changes.

Apart from the feature because this is the whole of what a replay is given: whatever is not here cannot be replayed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Call", "MAX_WINDOW", "MicroBatch", "refuse_what_the_forward_consumes"]

# Micro-batches kept at most (a loop that never steps an optimizer would otherwise keep every one).
MAX_WINDOW = 64


@dataclass
class Call:
    """One outermost forward call of a training micro-batch: references to its inputs, and the state it began in."""

    module: torch.nn.Module  # what runs it again (the unwrapped model when the call went through a wrapper)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: dict[str, Any]
    autocast: dict[str, str]
    grad_enabled: bool
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # by output label, kept in backward


@dataclass
class MicroBatch:
    """What running one training micro-batch again needs: its calls, and the buffers it changes, as it began."""

    batch_number: int
    buffers: dict[str, torch.Tensor]
    calls: list[Call] = field(default_factory=list)


def refuse_what_the_forward_consumes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Iterator) and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"nanwatch sentinel mode keeps a forward's inputs by reference to replay it, and a "
                f"{type(value).__name__} is used up by the forward: pass a list, a tuple or tensors, or watch with "
                "mode='full'"
            )
