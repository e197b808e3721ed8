"""Sharded tensors (DTensor: FSDP2's parameters and gradients, tensor parallelism's activations), read without a
collective.

A DTensor's values live on several ranks. A read that needs all of them (`.tolist()`, a comparison or a `stack` with
a plain tensor, `full_tensor()`) runs a collective, and one that only some ranks run (the rank that reports, the ranks
that trace or check headroom) pairs with another collective of the other ranks, or waits for ever. So nanwatch
measures only this rank's shard, a plain tensor: every later read is local, on every rank alike. Where a shard is all
a hook can see (an FSDP2 parameter after its module's forward, a gradient the optimizer is about to apply), its
numbers are those of this rank's shard; a value that is inf or nan there is caught on the rank that holds it.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["local_shard", "local_shards"]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor, no collective), or `tensor` itself when it is not one."""
    # Without torch.distributed.tensor imported, no tensor can be a DTensor (and nanwatch does not import it).
    module = sys.modules.get("torch.distributed.tensor")
    kind = getattr(module, "DTensor", None)
    if kind is None or not isinstance(tensor, kind):
        return tensor
    with torch.no_grad():
        local: torch.Tensor = tensor.to_local()
    return local


_PLAIN = frozenset((torch.Tensor,))


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`local_shard` of each of `tensors` (the list itself when none is a tensor subclass, as in most runs)."""
    if set(map(type, tensors)) <= _PLAIN:  # in C: no Python step per tensor
        return tensors
    return [local_shard(tensor) for tensor in tensors]
