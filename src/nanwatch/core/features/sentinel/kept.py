"""What sentinel mode keeps of a training micro-batch to run it again: each outermost call's inputs (copies when they
are small, references otherwise), the state it began in, and copies of the buffers a forward changes.

Apart from the feature because this is the whole of what a replay is given: whatever is not here cannot be replayed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = [
    "COPY_LIMIT_BYTES",
    "Call",
    "Kept",
    "MAX_WINDOW",
    "MicroBatch",
    "kept_inputs",
    "refuse_what_the_forward_consumes",
]

# Micro-batches kept at most (a loop that never steps an optimizer would otherwise keep every one).
MAX_WINDOW = 64

# With sentinel_copy_inputs="auto", a call's inputs are copied when their tensors hold this many bytes or fewer in
# all: token ids and small images cost one small copy (a few microseconds, stream-ordered on a GPU), and the replay
# then runs what the forward was given whatever the forward or the loop did to the tensors since. Larger inputs are
# kept by reference and checked by version counter before a replay.
COPY_LIMIT_BYTES = 1 << 20


@dataclass
class Call:
    """One outermost forward call of a training micro-batch: its inputs (`kept_inputs`), and the state it began in."""

    module: torch.nn.Module  # what runs it again (the unwrapped model when the call went through a wrapper)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: dict[str, Any]
    autocast: dict[str, str]
    grad_enabled: bool
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # by output label, summed over backwards
    # Each input tensor kept by reference and its version counter at the call, by label: a change since (the forward's
    # own `x.sub_()`, a loop refilling a preallocated buffer) means a replay would run other values. Empty when the
    # inputs were copied (`copied`): a copy is nanwatch's own, and nothing changes it.
    versions: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    copied: bool = False
    own_rng: list[Any] = field(default_factory=list)  # the states of the generators the model holds (generators.py)
    fed: bool = False  # an input carried an autograd graph (Kept.fed)

    def changed_inputs(self) -> list[str]:
        """The inputs changed since the call, by label: changed in place, or another tensor put in their place (a
        dict or list the loop refills)."""
        if self.copied:
            return []
        changed = [label for label, tensor, version in self.versions if _version(tensor) != version]
        now = list(_input_tensors(self.args, self.kwargs))
        if len(now) != len(self.versions):
            changed += [label for label, _, _ in self.versions + now]
        else:
            changed += [
                label for (label, tensor, _), (_, kept, _) in zip(now, self.versions, strict=True) if tensor is not kept
            ]
        return list(dict.fromkeys(changed))


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
        return list(dict.fromkeys(found + [f"buffer {name!r}" for name in self.changed_buffers()]))


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot be changed in place)
        return -1


def _input_tensors(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor, int]]:
    named = [(f"input[{index}]", value) for index, value in enumerate(args)]
    named += [(f"input.{keyword}", value) for keyword, value in kwargs.items()]
    for label, value in named:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                yield label, leaf, _version(leaf)


CopyInputs = Literal["auto", "always", "never"]


class Kept(NamedTuple):
    """A call's inputs as its replay will be given them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: list[tuple[str, torch.Tensor, int]]  # the tensors kept by reference, with their version counters
    copied: bool
    # An input carries an autograd graph (the output of an earlier call, or of the user's code on something that
    # requires grad): the gradient w.r.t. an earlier output may then have come through the model's own backward.
    fed: bool


def kept_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], copy: CopyInputs) -> Kept:
    """What a call's replay will be given. Copies (containers and tensors, each tensor detached, its requires_grad
    kept) when `copy` asks for them ("auto": up to COPY_LIMIT_BYTES in all); references otherwise, with each tensor's
    version counter to tell a change before the replay."""
    tensors = list(_input_tensors(args, kwargs))
    fed = any(tensor.grad_fn is not None for _, tensor, _ in tensors)
    if copy == "always" or (copy == "auto" and _bytes(tensors) <= COPY_LIMIT_BYTES):
        with torch.no_grad():
            args, kwargs = tree_map_only(torch.Tensor, _copy, (args, kwargs))
        return Kept(args, kwargs, [], True, fed)
    return Kept(tuple(args), dict(kwargs), tensors, False, fed)


def _bytes(tensors: list[tuple[str, torch.Tensor, int]]) -> float:
    try:
        return sum(tensor.nbytes for _, tensor, _ in tensors)
    except (RuntimeError, NotImplementedError):  # a layout without plain storage (nested, sparse): not copied
        return float("inf")


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)


def refuse_what_the_forward_consumes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Iterator) and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"nanwatch sentinel mode keeps a forward's inputs by reference to replay it, and a "
                f"{type(value).__name__} is used up by the forward: pass a list, a tuple or tensors, or watch with "
                "mode='full'"
            )
