"""One labelling specification (core/walk.py): the eager recorder, the compiled path's bookkeeping and
`walk.call_leaves` give every call the same lines, in the same order, with the same notes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from tests.engine_helpers import record_as_compiled

import nanwatch
from nanwatch.core.frames import Frame, Role
from nanwatch.core.walk import MAX_DEPTH, MAX_LEAVES, call_leaves, note


@dataclasses.dataclass
class _Output:  # a ModelOutput is a dataclass (and a mapping): walked by field
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...] | None = None
    loss: torch.Tensor | None = None


class _Echo(torch.nn.Module):
    """Returns whatever output the test sets, whatever it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.output: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _deep(depth: int) -> Any:
    value: Any = torch.ones(2)
    for _ in range(depth):
        value = [value]
    return value


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any], Any]] = {
    "positional": ((_t(2, 3), _t(3)), {}, _t(2)),
    "keyword": ((_t(2),), {"mask": _t(2), "use_cache": True, "past": None, "scale": 0.5, "name": "x"}, _t(2)),
    "keyword nested": ((), {"cache": {"k": _t(2), "v": [_t(2), None]}, "pair": (_t(1), 3)}, _t(2)),
    "nested input": (((_t(2), [_t(3), None]), {"a": _t(1), "b c": _t(1), 3: _t(1)}), {}, (_t(2), None)),
    "None and non-tensors": ((None, 3, "text", _t(2)), {}, (_t(2), 7, None)),
    "dict output": ((_t(2),), {}, {"logits": _t(2), "aux": [_t(1), None], "n": 4}),
    "model output": ((_t(2),), {}, _Output(_t(2), (_t(2), _t(2)), None)),
    "too deep": ((_deep(MAX_DEPTH + 2),), {}, _deep(MAX_DEPTH + 1)),
    "too many": (([_t(1) for _ in range(MAX_LEAVES + 5)],), {}, tuple(_t(1) for _ in range(MAX_LEAVES + 2))),
    "long flat tuple": ((_t(1),), {}, tuple(_t(1) if i % 3 else None for i in range(20))),
}


def _lines(frame: Frame) -> list[tuple[str, str, str]]:
    """(label, role, what it shows): numbers, or its note."""
    return [
        (e.label, e.role.value, "numbers" if e.note is None and e.measurement is not None else str(e.note))
        for e in frame.entries
        if e.role is not Role.PARAMETER
    ]


def _specified(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> list[tuple[str, str, str]]:
    return [
        (label, role, "numbers" if isinstance(leaf, torch.Tensor) else note(leaf))
        for label, role, leaf, noted in call_leaves(args, output, kwargs)
        if isinstance(leaf, torch.Tensor) or noted
    ]


@pytest.mark.parametrize("case", sorted(CALLS))
def test_eager_compiled_and_walk_label_a_call_alike(case: str) -> None:
    args, kwargs, output = CALLS[case]
    module = _Echo()
    module.output = output
    handle = nanwatch.watch(module)
    try:
        module(*args, **kwargs)
        record_as_compiled(handle.watcher, "", module, args, kwargs, output)
        eager, compiled = handle.watcher.recent_frames()[-2:]
    finally:
        handle.close()
    expected = _specified(args, kwargs, output)
    assert _lines(eager) == expected
    assert _lines(compiled) == expected
    assert expected  # every case has lines


def test_the_specification_reads_as_documented() -> None:
    lines = _specified(*CALLS["keyword"])
    assert [label for label, _, _ in lines] == ["input[0]", "input.mask", "output"]
    nested = [label for label, _, _ in _specified(*CALLS["nested input"])]
    assert nested[:4] == ["input[0][0]", "input[0][1][0]", "input[0][1][1]", "input[1].a"]
    assert nested[4:6] == ["input[1]['b c']", "input[1][3]"]
    model = [label for label, _, _ in _specified(*CALLS["model output"])]
    assert model[1:] == ["output.logits", "output.hidden[0]", "output.hidden[1]", "output.loss"]
