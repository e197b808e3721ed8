"""How a module call's lines are labelled: the one specification the eager recorder, the compiled path and the
trace use.

- positional input `i`: `input[i]`; keyword input `name`: `input.name`; what the call returned: `output`;
- inside containers: `[i]` for tuple and list items, `.key` (or `[repr(key)]`) for mapping keys, `.field` for
  dataclass fields (transformers' ModelOutput is both): `output[0]`, `output[1].mask`, `output.logits`;
- every leaf of a positional input or of the output gets a line: a tensor its numbers, anything else a note (`note`);
  a keyword input lists its tensors only (flags, sizes and caches get no line), and plain values are not looked into;
- containers deeper than MAX_DEPTH are one line (`TooDeep`), leaves past MAX_LEAVES one more (`TooMany`).

`call_leaves` walks a call by these rules. The eager recorder takes faster paths for the common shapes (a tensor, a
flat tuple of tensors and None), built from the same pieces (`input_label`, `item_label`, `note`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "INPUT",
    "KEYWORD_PLAIN",
    "MAX_DEPTH",
    "MAX_LEAVES",
    "OUTPUT",
    "OUTPUT_LABEL",
    "TooDeep",
    "TooMany",
    "call_leaves",
    "input_label",
    "item_label",
    "keyword_label",
    "note",
    "value_leaves",
    "walk",
]

MAX_DEPTH = 6  # deeper containers are summarised with one line rather than walked
MAX_LEAVES = 64  # leaves per input/output; the rest are counted in one line


class TooDeep:
    """Marker leaf: a container nested deeper than MAX_DEPTH."""


class TooMany:
    """Marker leaf: more leaves than MAX_LEAVES; `count` were left out."""

    def __init__(self, count: int) -> None:
        self.count = count


# The roles of a call's lines, as text (the values of core/frames.py's Role).
INPUT, OUTPUT = "input", "output"
OUTPUT_LABEL = "output"
# Keyword values of these kinds are never looked into (a keyword input lists its tensors only).
KEYWORD_PLAIN = (bool, int, float, str, type(None))
# Labels built once rather than formatted at every module call.
_INPUT_LABELS = tuple(f"input[{index}]" for index in range(16))
_ITEM_SUFFIXES = tuple(f"[{index}]" for index in range(16))


def input_label(index: int) -> str:
    """Positional input `index`: `input[0]`, `input[1]`, ..."""
    return _INPUT_LABELS[index] if index < 16 else f"input[{index}]"


def keyword_label(name: str) -> str:
    """Keyword input `name`: `input.attention_mask`."""
    return "input." + name


def item_label(label: str, index: int) -> str:
    """Item `index` of a tuple or list labelled `label`: `output[0]`."""
    return label + (_ITEM_SUFFIXES[index] if index < 16 else f"[{index}]")


def note(leaf: object) -> str:
    """The line of a leaf that is no tensor: what it says instead of numbers."""
    if leaf is None:
        return "None"
    if isinstance(leaf, TooDeep):
        return "nested too deep"
    if isinstance(leaf, TooMany):
        return "not shown"
    return "not a tensor"


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
            yield from _walk(item, item_label(label, index), depth + 1)
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


def value_leaves(value: Any, label: str, role: str, *, notes: bool) -> Iterator[tuple[str, str, Any, bool]]:
    """`(label, role, leaf, noted)` for every leaf of one input or output: `noted` says whether a leaf that is no
    tensor gets a line (with its `note`)."""
    for leaf_label, leaf in walk(value, label):
        yield leaf_label, role, leaf, notes


def call_leaves(
    args: tuple[Any, ...], output: Any, kwargs: Mapping[str, Any] | None = None
) -> Iterator[tuple[str, str, Any, bool]]:
    """`(label, role, leaf, noted)` for the inputs and outputs of one module call, in the order of its lines:
    positional inputs, keyword inputs, the output (see the module's rules)."""
    for index, value in enumerate(args):
        yield from value_leaves(value, input_label(index), INPUT, notes=True)
    for name, value in (kwargs or {}).items():
        if not isinstance(value, KEYWORD_PLAIN):
            yield from value_leaves(value, keyword_label(name), INPUT, notes=False)
    yield from value_leaves(output, OUTPUT_LABEL, OUTPUT, notes=True)
