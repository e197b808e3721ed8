"""What sentinel mode keeps of a training micro-batch to run it again: references to each outermost call's inputs,
the state it began in, and copies of the buffers a forward changes.

Apart from the feature because this is the whole of what a replay is given: whatever is not here cannot be replayed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

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
    # Each input tensor's version counter at the call, by label: a change since (the forward's own `x.sub_()`, a loop
    # refilling a preallocated buffer) means a replay would run other values.
    versions: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = list(_input_versions(self.args, self.kwargs))

    def changed_inputs(self) -> list[str]:
        """The inputs changed in place since the call, by label."""
        return [label for label, tensor, version in self.versions if _version(tensor) != version]


@dataclass
class MicroBatch:
    """What running one training micro-batch again needs: its calls, and the buffers it changes, as it began."""

    batch_number: int
    buffers: dict[str, torch.Tensor]
    calls: list[Call] = field(default_factory=list)
    # The version counters of the buffers kept by reference (not copied), as the micro-batch began.
    buffer_versions: dict[str, int] = field(default_factory=dict)

    def changed_buffers(self) -> list[str]:
        """The buffers kept by reference whose values changed since this micro-batch began."""
        return [name for name, version in self.buffer_versions.items() if _version(self.buffers[name]) != version]

    def changed(self) -> list[str]:
        """What this micro-batch would not replay as it ran: inputs and buffers kept by reference that changed since."""
        found = [
            f"{label} of micro-batch {self.batch_number}" for call in self.calls for label in call.changed_inputs()
        ]
        return found + [f"buffer {name!r}" for name in self.changed_buffers()]


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot be changed in place)
        return -1


def _input_versions(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor, int]]:
    named = [(f"input[{index}]", value) for index, value in enumerate(args)]
    named += [(f"input.{keyword}", value) for keyword, value in kwargs.items()]
    for label, value in named:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                yield label, leaf, _version(leaf)


def refuse_what_the_forward_consumes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Iterator) and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"nanwatch sentinel mode keeps a forward's inputs by reference to replay it, and a "
                f"{type(value).__name__} is used up by the forward: pass a list, a tuple or tensors, or watch with "
                "mode='full'"
            )
