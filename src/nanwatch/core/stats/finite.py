"""Is everything a checkpoint holds finite? One fused reduction over every floating-point tensor, one host read.

The tensors are found wherever a checkpoint keeps them: nested dicts, lists and tuples (a Lightning checkpoint, an
optimizer's `state_dict()`), a module (its `state_dict()`), an optimizer (its state). The 2-norm of each is taken in
one `_foreach_norm` per (device, dtype), accumulated in float32 (inf or nan as soon as one value is; on the CPU the
2-norm runs about thirty times faster than the infinity norm), and every group's verdict is read with one `.item()`.
Only a checkpoint that fails is walked again, tensor by tensor, with the exact test (`abs().amax()`), to name what is
not finite; a norm that overflowed from huge finite values (above 1e19) passes there.

A tensor the caller knows to hold inf/nan by design (`known`: a buffer such as an additive attention mask) is left
out of the norms: its `non_finite_kinds` are compared with the ones it is expected to have (a position that is not
finite must hold the same kind of value as before: -inf stays -inf), and that verdict joins the same host read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeAlias

import torch

from nanwatch.core.stats.sharded import local_shard

__all__ = ["MAX_NAMED", "KnownKinds", "non_finite_kinds", "non_finite_tensors", "floating_tensors"]

# Tensors named in a message; the others are counted.
MAX_NAMED = 5

# For a tensor of a checkpoint (where it is, the tensor): the `non_finite_kinds` it may hold, or None for a tensor
# that must be finite throughout.
KnownKinds: TypeAlias = Callable[[str, torch.Tensor], "torch.Tensor | None"]

_NAN_KIND = 2


_KINDS_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def non_finite_kinds(tensor: torch.Tensor) -> torch.Tensor:
    """One int8 per value of `tensor`: 0 finite, 1 +inf, -1 -inf, 2 nan (three elementwise kernels, no host read)."""
    if tensor.dtype not in _KINDS_DTYPES:  # float8 has no elementwise kernels here; every value is exact in float32
        tensor = tensor.float()
    codes = torch.nan_to_num(tensor, nan=float(_NAN_KIND), posinf=1.0, neginf=-1.0)
    return torch.where(torch.isfinite(tensor), 0, codes).to(torch.int8)


def _new_non_finite(tensor: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Where `tensor` holds inf/nan of another kind than `expected` says (a value become finite is no poison)."""
    kinds = non_finite_kinds(tensor)
    return (kinds != 0) & (kinds != expected)


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


def non_finite_tensors(state: Any, known: KnownKinds | None = None) -> tuple[list[tuple[str, str]], int]:
    """The tensors of `state` that hold inf or nan, as `(where, "inf" | "nan")` (empty when all are finite), and how
    many floating-point tensors were checked. `known` says which tensors may hold inf/nan, and where."""
    found = [
        (where, _checkable(tensor), known(where, tensor) if known else None)
        for where, tensor in floating_tensors(state)
    ]
    if not found:
        return [], 0
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for _, tensor, expected in found:
        if expected is None:
            by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        else:
            flags.setdefault(tensor.device, []).append(~_new_non_finite(tensor, expected).any())
    for (device, dtype), tensors in by_kind.items():
        # Accumulated in float32, float64 in its own (torch norms no float64 tensor into float32).
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        flags.setdefault(device, []).append(torch.isfinite(torch.stack(norms)).all())
    # One host read per device (one in all on a single-device rank).
    if all(bool(torch.stack(device_flags).all()) for device_flags in flags.values()):
        return [], len(found)
    bad = []
    for where, tensor, expected in found:  # the slow path: a failing checkpoint, named tensor by tensor
        word = _verdict(tensor) if expected is None else _verdict_against(tensor, expected)
        if word is not None:
            bad.append((where, word))
    return bad, len(found)


def _checkable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or its float32 copy where torch has no reduction for its dtype (float8: every value exact in
    float32)."""
    return tensor if tensor.dtype in _KINDS_DTYPES else tensor.float()


def _verdict(tensor: torch.Tensor) -> str | None:
    value = float(tensor.abs().amax())
    if math.isfinite(value):
        return None
    return "nan" if math.isnan(value) else "inf"


def _verdict_against(tensor: torch.Tensor, expected: torch.Tensor) -> str | None:
    new = non_finite_kinds(tensor)[_new_non_finite(tensor, expected)]
    if new.numel() == 0:
        return None
    return "nan" if bool((new == _NAN_KIND).any()) else "inf"
