"""A module call's inputs as a repro capsule keeps them: readable by `torch.load(..., weights_only=True)`.

Tensors become CPU copies; numbers, strings, bytes, None, dtypes, devices and sizes stay as they are, inside plain
tuples, lists and dicts. Anything else (a dataclass, a namedtuple, a model output object) cannot be in a
weights-only file: it is pickled on its own, into bytes kept beside the inputs, and its place holds a marker naming
those bytes; the bytes are unpickled only when the inputs are asked for to run them (a trusted load, as the module's
is). What cannot be pickled at all (a function, a generator, a lock) is left out, its place a marker that becomes
None, and described in `dropped`.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CallInputs", "EncodedInputs", "encode_inputs", "decode_inputs", "cpu_copy"]

# The markers' keys: a dict with exactly one of them is a marker, not one of the user's dicts.
OBJECT_KEY = "__nanwatch_capsule_object__"
DROPPED_KEY = "__nanwatch_capsule_dropped__"
# Leaves a weights-only load accepts, kept inline.
_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


@dataclass(frozen=True)
class CallInputs:
    """What a module is called with: `module(*args, **kwargs)`."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class EncodedInputs:
    """Inputs as the capsule holds them: `args` and `kwargs` with tensors on the CPU and markers for the rest."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    objects: list[bytes]  # the pickled leaves that a weights-only load could not read, by marker index
    dropped: list[str]  # one description per leaf left out: where it was, what it was, why


def cpu_copy(tensor: torch.Tensor, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """A detached CPU copy of `tensor` as a plain `torch.Tensor`; the same tensor twice gives the same copy (`memo`),
    so inputs that alias each other (a tied weight, one tensor passed as two arguments) still do after loading."""
    found = memo.get(id(tensor))
    if found is not None:
        return found
    copy = tensor.detach().to("cpu", copy=True)
    if type(copy) is not torch.Tensor:  # a subclass would need its class to load, which weights-only refuses
        copy = copy.as_subclass(torch.Tensor)
    memo[id(tensor)] = copy
    return copy


def encode_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> EncodedInputs:
    """`args` and `kwargs` as a capsule keeps them (see the module's docstring)."""
    objects: list[bytes] = []
    dropped: list[str] = []
    memo: dict[int, torch.Tensor] = {}

    def encode(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            return cpu_copy(value, memo)
        if value is None or type(value) in _PLAIN or type(value) is torch.Size:
            return value
        if type(value) is tuple:
            return tuple(encode(item, f"{where}[{index}]") for index, item in enumerate(value))
        if type(value) is list:
            return [encode(item, f"{where}[{index}]") for index, item in enumerate(value)]
        if type(value) is dict and all(type(key) in (str, int) for key in value):
            return {key: encode(item, f"{where}[{key!r}]") for key, item in value.items()}
        try:
            buffer = io.BytesIO()
            torch.save(value, buffer)
        except Exception as error:  # pickling fails in many ways: PicklingError, TypeError, AttributeError
            description = f"{where}: a {type(value).__qualname__}, not picklable ({type(error).__name__}: {error})"
            description = " ".join(description.split())  # one line, whatever the error's message holds
            dropped.append(description)
            return {DROPPED_KEY: description}
        objects.append(buffer.getvalue())
        return {OBJECT_KEY: len(objects) - 1}

    encoded_args = tuple(encode(value, f"args[{index}]") for index, value in enumerate(args))
    encoded_kwargs = {str(key): encode(value, f"kwargs[{key!r}]") for key, value in kwargs.items()}
    return EncodedInputs(args=encoded_args, kwargs=encoded_kwargs, objects=objects, dropped=dropped)


def decode_inputs(args: Sequence[Any], kwargs: Mapping[str, Any], objects: Sequence[bytes]) -> CallInputs:
    """Inputs to run from what a capsule holds: fresh tensors (a forward may change its inputs in place), the pickled
    leaves unpickled (this runs their code: a trusted load), the dropped ones None.

    Raises:
        ValueError: a marker names bytes the capsule does not hold.
    """
    memo: dict[int, torch.Tensor] = {}

    def decode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = value.clone()
            return memo[id(value)]
        if type(value) is tuple:
            return tuple(decode(item) for item in value)
        if type(value) is list:
            return [decode(item) for item in value]
        if type(value) is dict:
            if len(value) == 1 and DROPPED_KEY in value:
                return None
            if len(value) == 1 and OBJECT_KEY in value:
                index = value[OBJECT_KEY]
                if not isinstance(index, int) or not 0 <= index < len(objects):
                    raise ValueError(f"an input marker names object {index!r}, of {len(objects)} kept")
                return torch.load(io.BytesIO(objects[index]), map_location="cpu", weights_only=False)
            return {key: decode(item) for key, item in value.items()}
        return value

    return CallInputs(args=tuple(decode(value) for value in args), kwargs={k: decode(v) for k, v in kwargs.items()})
