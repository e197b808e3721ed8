"""core/stats/limits.py and dtypes.py: each floating-point dtype's limits, float64 included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.core.stats.dtypes import FLOAT_MAX, float_max
from nanwatch.core.stats.limits import limits_of

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_limits_come_from_finfo_for_every_float_dtype(dtype: torch.dtype) -> None:
    limits = limits_of(dtype)
    assert limits is not None
    info = torch.finfo(dtype)
    assert limits.max == info.max
    assert limits.smallest_normal == info.smallest_normal
    assert limits.overflow_at > limits.max  # past it, a cast no longer rounds down to the max


def test_overflow_points_are_half_a_spacing_past_the_max() -> None:
    half = limits_of(torch.float16)
    assert half is not None
    assert half.overflow_at == 65520.0  # 65504 + 32 / 2: where float16 rounds to inf
    assert torch.tensor(65519.0).half().isfinite()
    assert torch.tensor(65520.0).half().isinf()


def test_float64_is_watched_with_headroom_on() -> None:
    # Before: limits_of(float64) raised OverflowError (2.0 ** 1024), and with the default headroom check every
    # float64 tensor stopped the watching, so later inf/nan went unseen.
    model = nn.Linear(2, 2).double()
    with nanwatch.watch(model) as handle:
        model(torch.ones(1, 2, dtype=torch.float64))
        handle.step()
        assert handle.watcher.disabled_reason is None
        model(torch.full((1, 2), float("inf"), dtype=torch.float64))
        with pytest.raises(nanwatch.NonFiniteError):
            handle.step()


@pytest.mark.parametrize("name", sorted(FLOAT_MAX))
def test_the_torch_free_table_matches_finfo(name: str) -> None:
    assert float_max(name) == torch.finfo(getattr(torch, name)).max
    assert float_max("int32") is None
