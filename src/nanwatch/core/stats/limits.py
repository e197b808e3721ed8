"""Floating-point limits (from `torch.finfo`) and the kernel that counts values too small for them."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from nanwatch.core.stats.kernels import FLOAT8_DTYPES

__all__ = ["TARGET_DTYPES", "Limits", "limits_of", "target_limits", "round_up", "dtype_name", "UnderflowCounter"]

# The dtypes `target_dtype` accepts: narrower formats an fp32 (or bf16) run may be moved to.
TARGET_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Limits:
    """The numbers that matter about one floating-point dtype, from `torch.finfo`.

    Attributes:
        overflow_at: the smallest magnitude that no longer rounds to `max` when cast (round to nearest even): it
            becomes inf (float16, bfloat16, float8_e5m2) or saturates/turns nan (float8_e4m3fn, which has no inf).
        flush_at: the largest magnitude that rounds to zero when cast (half the smallest subnormal).
    """

    dtype: torch.dtype
    name: str
    max: float
    smallest_normal: float
    smallest_subnormal: float
    overflow_at: float
    flush_at: float


@functools.cache
def limits_of(dtype: torch.dtype) -> Limits | None:
    """The limits of a floating-point dtype; None for any other dtype (integers, bool, complex, quantized)."""
    if not dtype.is_floating_point:
        return None
    try:
        info = torch.finfo(dtype)
    except TypeError:  # a float8 variant finfo does not describe
        return None
    # The spacing of the dtype's numbers at its max: eps times the power of two just below max (frexp: no 2.0**1024,
    # which float64's max would need through log2, and which overflows).
    ulp_at_max = math.ldexp(info.eps, math.frexp(info.max)[1] - 1)
    smallest_subnormal = info.smallest_normal * info.eps
    return Limits(
        dtype=dtype,
        name=dtype_name(dtype),
        max=info.max,
        smallest_normal=info.smallest_normal,
        smallest_subnormal=smallest_subnormal,
        overflow_at=info.max + ulp_at_max / 2,
        flush_at=smallest_subnormal / 2,
    )


def target_limits(name: str | None) -> Limits | None:
    """The limits of a `target_dtype` name ("float16", ...), None when no target is set."""
    if name is None:
        return None
    if name not in TARGET_DTYPES or not hasattr(torch, name):
        raise ValueError(f"target_dtype can be one of {TARGET_DTYPES} (or None), got {name!r}")
    limits = limits_of(getattr(torch, name))
    assert limits is not None
    return limits


def round_up(value: float, dtype: torch.dtype) -> float:
    """The smallest number of `dtype` at or above `value` (inf past its max), so `x < it` is exact for x in dtype."""
    if math.isinf(value):
        return value
    rounded = torch.tensor(value, dtype=torch.float64).to(dtype)
    if float(rounded) < value:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf, dtype=dtype))
    return float(rounded)


class UnderflowCounter:
    """Counts, on the device, the values of a tensor that underflow: the kernel of the underflow statistic.

    Returns an int64 vector `[subnormal, target_subnormal, target_zero, excess]`: nonzero magnitudes below the
    tensor's own smallest normal; below the target dtype's smallest normal (-1 when the target does not apply: no
    target, or the tensor already has the target's dtype); at or below the target's flush-to-zero point (likewise);
    and how far the larger of the first two exceeds `warn_fraction` of the tensor's size (> 0: worth a warning).

    Args:
        target: the limits of `target_dtype`, or None.
        warn_fraction: the fraction of a tensor's values that may underflow before it is worth a warning.
    """

    def __init__(self, target: Limits | None, warn_fraction: float) -> None:
        self.target = target
        self.warn_fraction = warn_fraction

    def __call__(self, data: torch.Tensor) -> torch.Tensor | None:
        own = limits_of(data.dtype)
        if own is None:
            return None
        if data.is_nested:
            data = torch.cat([part.reshape(-1) for part in data.unbind()])
        numel = data.numel()
        # float8 has no comparison kernels of its own; every float8 value is exact in float32.
        magnitude = data.float().abs() if data.dtype in FLOAT8_DTYPES else data.abs()
        # count_nonzero, not .sum() of a bool tensor: several times faster on the CPU. A nan is nonzero and below no
        # threshold, so it is counted nowhere; "nonzero and below t" is "below t" less the zeros.
        zeros = numel - torch.count_nonzero(magnitude)
        # Thresholds are powers of two: exact in every floating-point dtype whose range reaches them (and a threshold
        # below a dtype's range rounds to 0, where the count is rightly 0).
        subnormal = torch.count_nonzero(magnitude < own.smallest_normal) - zeros
        limit = math.floor(self.warn_fraction * numel)
        target = self.target
        if target is None or target.dtype == data.dtype:
            not_applicable = torch.full_like(subnormal, -1)
            return torch.stack([subnormal, not_applicable, not_applicable, subnormal - limit])
        below = torch.count_nonzero(magnitude < target.smallest_normal) - zeros
        flushed = torch.count_nonzero(magnitude <= target.flush_at) - zeros
        return torch.stack([subnormal, below, flushed, torch.maximum(subnormal, below) - limit])
