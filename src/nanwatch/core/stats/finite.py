"""Is everything a checkpoint holds finite? One fused reduction over every floating-point tensor, one host read.

The tensors are found wherever a checkpoint keeps them: nested dicts, lists and tuples (a Lightning checkpoint, an
optimizer's `state_dict()`), a module (its `state_dict()`), an optimizer (its state). The 2-norm of each is taken in
one `_foreach_norm` per (device, dtype), accumulated in float32 (inf or nan as soon as one value is; on the CPU the
2-norm runs about thirty times faster than the infinity norm), and every group's verdict is read with one `.item()`.
Only a checkpoint that fails is walked again, tensor by tensor, with the exact test (`abs().amax()`), to name what is
not finite; a norm that overflowed from huge finite values (above 1e19) passes there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from nanwatch.core.stats.sharded import local_shard

__all__ = ["MAX_NAMED", "non_finite_tensors", "floating_tensors"]

# Tensors named in a message; the others are counted.
MAX_NAMED = 5


def floating_tensors(state: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating-point tensor in `state`, with where it is (`state_dict.fc.weight`, `state.0.exp_avg`)."""
    if isinstance(state, torch.Tensor):
        tensor = local_shard(state)
        if tensor.is_floating_point() and tensor.numel() > 0 and not tensor.is_meta:
            yield where or "tensor", tensor.detach()
    elif isinstance(state, torch.nn.Module):
        yield from floating_tensors(state.state_dict(keep_vars=True), where)
    elif isinstance(state, torch.optim.Optimizer):
        yield from floating_tensors({"state": state.state_dict()["state"]}, where)
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from floating_tensors(value, f"{where}.{key}" if where else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from floating_tensors(value, f"{where}[{index}]")


def non_finite_tensors(state: Any) -> tuple[list[tuple[str, str]], int]:
    """The tensors of `state` that hold inf or nan, as `(where, "inf" | "nan")` (empty when all are finite), and how
    many floating-point tensors were checked."""
    found = list(floating_tensors(state))
    if not found:
        return [], 0
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, tensor in found:
        by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for (device, _), tensors in by_kind.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        flags.setdefault(device, []).append(torch.isfinite(torch.stack(norms)).all())
    # One host read per device (one in all on a single-device rank).
    if all(bool(torch.stack(device_flags).all()) for device_flags in flags.values()):
        return [], len(found)
    bad = []
    for where, tensor in found:  # the slow path: a failing checkpoint, named tensor by tensor
        value = float(tensor.abs().amax())
        if not math.isfinite(value):
            bad.append((where, "nan" if math.isnan(value) else "inf"))
    return bad, len(found)
