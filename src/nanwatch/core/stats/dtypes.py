"""The largest finite value of each floating-point dtype, by the name records give it, without importing torch.

For the tools (`nanwatch plot`) that read files and never import torch; a test checks every value against
`torch.finfo`.
"""

from __future__ import annotations

__all__ = ["FLOAT_MAX", "float_max"]

FLOAT_MAX: dict[str, float] = {
    "float64": 1.7976931348623157e308,
    "float32": 3.4028234663852886e38,
    "bfloat16": 3.3895313892515355e38,
    "float16": 65504.0,
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
}


def float_max(name: str) -> float | None:
    """The largest finite value of the floating-point dtype `name` ("float16", ...), None for any other name."""
    return FLOAT_MAX.get(name)
