"""core/frames.py: the bounded ring, the one-sync inf/nan check, and reading numbers back to the host."""

from __future__ import annotations

import math

import pytest
import torch

from nanwatch.core.frames import Entry, Frame, FrameRing, ResolvedEntry, find_non_finite, resolve
from nanwatch.core.stats import measure


def _frame(name: str, *tensors: torch.Tensor, batch: int = 0) -> Frame:
    return Frame(name, "Linear", batch, entries=[Entry(f"input[{i}]", measure(t)) for i, t in enumerate(tensors)])


def test_ring_keeps_only_the_last_frames() -> None:
    ring = FrameRing(5)
    frames = [_frame(f"layer{i}", torch.ones(1)) for i in range(23)]
    ring.extend(frames)
    assert len(ring) == 5
    assert ring.size == 5
    assert ring.frames() == frames[-5:]


def test_ring_stays_bounded_after_clear() -> None:
    ring = FrameRing(3)
    ring.extend(_frame(str(i), torch.ones(1)) for i in range(3))
    ring.clear()
    assert len(ring) == 0
    assert ring.size == 3
    ring.extend(_frame(str(i), torch.ones(1)) for i in range(10))
    assert len(ring) == 3
    assert [f.module_name for f in ring.frames()] == ["7", "8", "9"]


def test_ring_frames_is_a_copy() -> None:
    ring = FrameRing(2)
    ring.extend([_frame("a", torch.ones(1))])
    ring.frames().append(_frame("b", torch.ones(1)))
    assert len(ring) == 1


def test_find_non_finite_on_clean_frames() -> None:
    frames = [_frame("a", torch.randn(4, 4)), _frame("b", torch.randn(3).half(), torch.randn(2).bfloat16())]
    assert not find_non_finite(frames)
    assert not find_non_finite([])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_find_non_finite_sees_one_bad_value_among_many(bad: float, dtype: torch.dtype) -> None:
    clean = [_frame(f"l{i}", torch.randn(8)) for i in range(5)]
    dirty = torch.randn(100).to(dtype)
    dirty[57] = bad
    frames = [*clean[:3], _frame("culprit", torch.randn(3).half(), dirty), *clean[3:]]
    assert find_non_finite(frames)


def test_find_non_finite_ignores_notes_skipped_integer_and_bool_entries() -> None:
    frame = Frame(
        "m",
        "M",
        0,
        entries=[
            Entry("input[0]", note="None"),
            Entry("input[1]", note="not a tensor"),
            Entry("weight", measure(torch.empty(0))),
            Entry("input[2]", measure(torch.empty(3, device="meta"))),
            Entry("input[3]", measure(torch.tensor([1, -(2**40)]))),
            Entry("output", measure(torch.tensor([True, False]))),
        ],
    )
    assert not find_non_finite([frame])


def test_resolve_reads_back_every_number() -> None:
    a = torch.tensor([-3.0, 0.5])
    b = torch.tensor([7, -2], dtype=torch.int32)
    c = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    frame = Frame(
        "encoder.0",
        "Linear",
        4,
        "eval",
        entries=[
            Entry("weight", measure(a)),
            Entry("input[0]", measure(b)),
            Entry("output", measure(c)),
            Entry("input[1]", note="None"),
            Entry("bias", measure(torch.empty(0, 2))),
        ],
    )
    (resolved,) = resolve([frame])
    assert (resolved.module_name, resolved.class_name, resolved.batch_number, resolved.phase) == (
        "encoder.0",
        "Linear",
        4,
        "eval",
    )
    weight, ints, output, none, bias = resolved.entries
    assert weight == ResolvedEntry("weight", 0.5, 3.0, "float32", (2,), None)
    assert ints == ResolvedEntry("input[0]", 2, 7, "int32", (2,), None)
    assert isinstance(ints.abs_max, int)
    assert output.abs_min == 1.0
    assert output.abs_max == math.inf
    assert output.dtype == "float16"
    assert output.non_finite
    assert none == ResolvedEntry("input[1]", None, None, None, None, "None")
    assert bias == ResolvedEntry("bias", None, None, "float32", (0, 2), "empty")
    assert resolved.non_finite
    assert not weight.non_finite
    assert not ints.non_finite


def test_resolve_keeps_frame_order_and_handles_a_measurement_shared_by_two_frames() -> None:
    # A module's output is the next module's input: the cache hands both frames the same Measurement object.
    shared = measure(torch.tensor([2.0, -9.0]))
    frames = [
        Frame("first", "A", 0, entries=[Entry("output", shared)]),
        Frame("second", "B", 0, entries=[Entry("input[0]", shared), Entry("output", measure(torch.ones(1)))]),
    ]
    first, second = resolve(frames)
    assert first.module_name == "first"
    assert second.module_name == "second"
    assert (first.entries[0].abs_min, first.entries[0].abs_max) == (2.0, 9.0)
    assert (second.entries[0].abs_min, second.entries[0].abs_max) == (2.0, 9.0)
    assert (second.entries[1].abs_min, second.entries[1].abs_max) == (1.0, 1.0)


def test_resolve_of_nothing() -> None:
    assert resolve([]) == []
    (empty,) = resolve([Frame("", "Model", 0)])
    assert empty.entries == ()
    assert not empty.non_finite


def test_nan_is_non_finite_in_resolved_entries() -> None:
    (frame,) = resolve([_frame("m", torch.tensor([float("nan"), 1.0]))])
    assert math.isnan(frame.entries[0].abs_max)  # type: ignore[arg-type]
    assert frame.non_finite
