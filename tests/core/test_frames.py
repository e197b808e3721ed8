"""core/frames.py: the bounded ring, typed roles and directions, and reading numbers back to the host."""

from __future__ import annotations

import math

import torch

from nanwatch.core.frames import (
    Direction,
    Entry,
    Frame,
    FrameRing,
    RecordedFrame,
    ResolvedEntry,
    ResolvedFrame,
    Role,
    resolve,
)
from nanwatch.core.stats.measure import measure

FREE = {"non_finite_counts": (0, 0)}  # nan/inf counts known for free from a finite abs max


def _frame(name: str, *tensors: torch.Tensor, batch: int = 0) -> Frame:
    entries = [Entry(f"input[{i}]", Role.INPUT, measure(t)) for i, t in enumerate(tensors)]
    return RecordedFrame(name, "Linear", batch, entries=entries)


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


def test_ring_last_gives_the_most_recent_frames_oldest_first() -> None:
    ring = FrameRing(4)
    frames = [_frame(str(i), torch.ones(1)) for i in range(6)]
    ring.extend(frames)
    assert ring.last(2) == frames[-2:]
    assert ring.last(10) == frames[-4:]
    assert ring.last(0) == []


def test_a_backward_frame_shows_its_class_with_the_suffix_but_keeps_it_plain() -> None:
    (frame,) = resolve([RecordedFrame("0", "Linear", 0, entries=[], direction=Direction.BACKWARD)])
    assert frame.class_name == "Linear"
    assert frame.is_backward
    assert frame.shown_class == "Linear (backward)"
    assert ResolvedFrame("0", "Linear", 0, "train", ()).shown_class == "Linear"


def test_resolve_reads_back_every_number() -> None:
    a = torch.tensor([-3.0, 0.5])
    b = torch.tensor([7, -2], dtype=torch.int32)
    c = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    frame = RecordedFrame(
        "encoder.0",
        "Linear",
        4,
        "eval",
        entries=[
            Entry("weight", Role.PARAMETER, measure(a)),
            Entry("input[0]", Role.INPUT, measure(b)),
            Entry("output", Role.OUTPUT, measure(c)),
            Entry("input[1]", Role.INPUT, note="None"),
            Entry("bias", Role.PARAMETER, measure(torch.empty(0, 2))),
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
    assert weight == ResolvedEntry("weight", Role.PARAMETER, 0.5, 3.0, "float32", (2,), None, FREE)
    assert ints == ResolvedEntry("input[0]", Role.INPUT, 2, 7, "int32", (2,), None, FREE)
    assert isinstance(ints.abs_max, int)
    assert output.abs_min == 1.0
    assert output.abs_max == math.inf
    assert output.dtype == "float16"
    assert output.non_finite
    assert output.stats == {}  # inf: its counts are not known for free
    assert none == ResolvedEntry("input[1]", Role.INPUT, None, None, None, None, "None")
    assert bias == ResolvedEntry("bias", Role.PARAMETER, None, None, "float32", (0, 2), "empty")
    assert resolved.non_finite
    assert not weight.non_finite
    assert not ints.non_finite


def test_resolve_keeps_frame_order_and_handles_a_measurement_shared_by_two_frames() -> None:
    # A module's output is the next module's input: the cache hands both frames the same Measurement object.
    shared = measure(torch.tensor([2.0, -9.0]))
    frames = [
        RecordedFrame("first", "A", 0, entries=[Entry("output", Role.OUTPUT, shared)]),
        RecordedFrame(
            "second",
            "B",
            0,
            entries=[Entry("input[0]", Role.INPUT, shared), Entry("output", Role.OUTPUT, measure(torch.ones(1)))],
        ),
    ]
    first, second = resolve(frames)
    assert first.module_name == "first"
    assert second.module_name == "second"
    assert (first.entries[0].abs_min, first.entries[0].abs_max) == (2.0, 9.0)
    assert (second.entries[0].abs_min, second.entries[0].abs_max) == (2.0, 9.0)
    assert (second.entries[1].abs_min, second.entries[1].abs_max) == (1.0, 1.0)


def test_resolve_of_nothing() -> None:
    assert resolve([]) == []
    (empty,) = resolve([RecordedFrame("", "Model", 0)])
    assert empty.entries == ()
    assert not empty.non_finite


def test_nan_is_non_finite_in_resolved_entries() -> None:
    (frame,) = resolve([_frame("m", torch.tensor([float("nan"), 1.0]))])
    assert math.isnan(frame.entries[0].abs_max)  # type: ignore[arg-type]
    assert frame.non_finite
