"""Walk a module's inputs and outputs (tensors, None, nested containers) into labelled leaves."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["walk", "call_leaves", "MAX_DEPTH", "MAX_LEAVES", "TooDeep", "TooMany"]

MAX_DEPTH = 6  # deeper containers are summarised with one line rather than walked
MAX_LEAVES = 64  # leaves per input/output; the rest are counted in one line


class TooDeep:
    """Marker leaf: a container nested deeper than MAX_DEPTH."""


class TooMany:
    """Marker leaf: more leaves than MAX_LEAVES; `count` were left out."""

    def __init__(self, count: int) -> None:
        self.count = count


def walk(value: Any, label: str) -> Iterator[tuple[str, Any]]:
    """Yield `(label, leaf)` for every leaf in `value`: `output[0]`, `output[1][0]`, `output.logits`, ...

    Tuples and lists are indexed, mappings and dataclasses (transformers' ModelOutput is both) are walked by key.
    """
    for leaves, item in enumerate(_walk(value, label, 0), start=1):
        if leaves > MAX_LEAVES:
            rest = 1 + sum(1 for _ in _walk(value, label, 0)) - leaves
            yield f"{label} (not shown: {rest} more)", TooMany(rest)
            return
        yield item


def _walk(value: Any, label: str, depth: int) -> Iterator[tuple[str, Any]]:
    if isinstance(value, (tuple, list)):
        if depth >= MAX_DEPTH:
            yield label, TooDeep()
            return
        for index, item in enumerate(value):
            yield from _walk(item, f"{label}[{index}]", depth + 1)
    elif isinstance(value, Mapping):
        if depth >= MAX_DEPTH:
            yield label, TooDeep()
            return
        for key, item in value.items():
            yield from _walk(item, _key_label(label, key), depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        if depth >= MAX_DEPTH:
            yield label, TooDeep()
            return
        for field in dataclasses.fields(value):
            yield from _walk(getattr(value, field.name), f"{label}.{field.name}", depth + 1)
    else:
        yield label, value


def _key_label(label: str, key: object) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{label}.{key}"
    return f"{label}[{key!r}]"


def call_leaves(args: tuple[Any, ...], output: Any) -> Iterator[tuple[str, Any]]:
    """`(label, leaf)` for the inputs and outputs of one module call, labelled as frames label them: `input[0]`,
    `input[1].mask`, `output`, `output[0]`, `output.logits` (the engine's recording takes a faster path to the same
    labels)."""
    for index, value in enumerate(args):
        yield from walk(value, f"input[{index}]")
    yield from walk(output, "output")
