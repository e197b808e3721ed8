"""core/walk.py: nested outputs become labelled leaves; deep and wide containers are summarised, never recursed
into without bound."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch

from nanwatch.core.walk import MAX_DEPTH, MAX_LEAVES, TooDeep, TooMany, walk


def _labels(value: Any, label: str = "output") -> list[str]:
    return [leaf_label for leaf_label, _ in walk(value, label)]


def test_a_bare_tensor_is_one_leaf() -> None:
    tensor = torch.ones(2)
    assert list(walk(tensor, "output")) == [("output", tensor)]


def test_tuples_and_lists_are_indexed_as_transformers_labels_them() -> None:
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    leaves = list(walk((a, [b, (c,)]), "output"))
    assert [label for label, _ in leaves] == ["output[0]", "output[1][0]", "output[1][1][0]"]
    assert leaves[0][1] is a
    assert leaves[1][1] is b
    assert leaves[2][1] is c


def test_mappings_use_attribute_labels_for_identifiers_and_brackets_otherwise() -> None:
    value = OrderedDict([("logits", torch.ones(1)), ("past key", torch.ones(1)), (3, torch.ones(1))])
    assert _labels(value) == ["output.logits", "output['past key']", "output[3]"]


def test_dataclass_outputs_are_walked_by_field() -> None:
    @dataclasses.dataclass
    class Output:
        loss: torch.Tensor | None
        hidden: tuple[torch.Tensor, ...]

    assert _labels(Output(None, (torch.ones(1), torch.ones(1)))) == [
        "output.loss",
        "output.hidden[0]",
        "output.hidden[1]",
    ]
    # A dataclass *class* (not an instance) is an ordinary value.
    assert list(walk(Output, "output")) == [("output", Output)]


def test_transformers_model_output_is_walked_by_key() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    logits = torch.ones(2, 3)
    output = modeling_outputs.CausalLMOutputWithPast(loss=None, logits=logits, past_key_values=None)
    leaves = list(walk(output, "output"))
    assert leaves == [("output.logits", logits)]


def test_namedtuple_is_indexed_like_a_tuple() -> None:
    class Pair(NamedTuple):
        first: torch.Tensor
        second: torch.Tensor

    assert _labels(Pair(torch.ones(1), torch.ones(1))) == ["output[0]", "output[1]"]


def test_none_strings_and_numbers_are_leaves() -> None:
    leaves = list(walk((None, "text", 3, b"raw"), "input[0]"))
    assert leaves == [("input[0][0]", None), ("input[0][1]", "text"), ("input[0][2]", 3), ("input[0][3]", b"raw")]


def test_empty_containers_give_no_leaves() -> None:
    assert list(walk((), "output")) == []
    assert list(walk({}, "output")) == []


def _nest(leaf: Any, levels: int) -> Any:
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def test_nesting_up_to_max_depth_reaches_the_tensor() -> None:
    tensor = torch.ones(1)
    leaves = list(walk(_nest(tensor, MAX_DEPTH), "output"))
    assert leaves == [("output" + "[0]" * MAX_DEPTH, tensor)]


@pytest.mark.parametrize("extra", [1, 50, 5000])
def test_nesting_deeper_than_max_depth_is_summarised(extra: int) -> None:
    leaves = list(walk(_nest(torch.ones(1), MAX_DEPTH + extra), "output"))
    assert len(leaves) == 1
    label, leaf = leaves[0]
    assert label == "output" + "[0]" * MAX_DEPTH
    assert isinstance(leaf, TooDeep)


def test_deep_dicts_and_dataclasses_are_summarised_too() -> None:
    @dataclasses.dataclass
    class Box:
        inner: Any

    value: Any = torch.ones(1)
    for level in range(MAX_DEPTH + 3):
        value = {"x": value} if level % 2 else Box(value)
    leaves = list(walk(value, "output"))
    assert len(leaves) == 1
    assert isinstance(leaves[0][1], TooDeep)


def test_a_container_holding_itself_terminates() -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    leaves = list(walk(loop, "output"))
    assert leaves[0][0] == "output[0]"
    assert isinstance(leaves[-1][1], TooDeep)
    assert len(leaves) == MAX_DEPTH + 1  # one tensor per level, then the summary


def test_exactly_max_leaves_are_all_shown() -> None:
    leaves = list(walk([torch.ones(1)] * MAX_LEAVES, "output"))
    assert len(leaves) == MAX_LEAVES
    assert not any(isinstance(leaf, TooMany) for _, leaf in leaves)


@pytest.mark.parametrize("width", [MAX_LEAVES + 1, MAX_LEAVES + 10, 20_000])
def test_wide_outputs_show_max_leaves_then_count_the_rest(width: int) -> None:
    tensors = [torch.ones(1)] * width
    leaves = list(walk(tuple(tensors), "output"))
    assert len(leaves) == MAX_LEAVES + 1
    assert [label for label, _ in leaves[:3]] == ["output[0]", "output[1]", "output[2]"]
    label, summary = leaves[-1]
    assert isinstance(summary, TooMany)
    assert summary.count == width - MAX_LEAVES
    assert label == f"output (not shown: {width - MAX_LEAVES} more)"


def test_wide_and_nested_leaves_are_counted_across_levels() -> None:
    value = [[torch.ones(1)] * 10 for _ in range(10)]  # 100 leaves two levels down
    leaves = list(walk(value, "output"))
    summary = leaves[-1][1]
    assert isinstance(summary, TooMany)
    assert summary.count == 100 - MAX_LEAVES
