"""The counters' stamp (core/engine/counters.py): what every new frame carries, kept as the counters change."""

from __future__ import annotations

import logging

from nanwatch.core.engine.counters import Counters


def test_the_stamp_follows_every_change_of_phase_and_batch_numbers() -> None:
    counters = Counters(logging.getLogger("test"))
    assert counters.stamp == (0, "train")
    counters.advance()
    assert counters.stamp == (1, "train") == (counters.batch_number, counters.phase)
    counters.phase = "eval"
    assert counters.stamp == (0, "eval")
    counters.advance()
    counters.eval_batch_number += 4
    assert counters.stamp == (5, "eval")
    counters.phase = "train"
    counters.batch_number = 7
    assert counters.stamp == (7, "train")
    counters.load_state_dict({"batch_number": 3, "eval_batch_number": 9})
    assert counters.stamp == (3, "train")
    counters.phase = "eval"
    assert counters.stamp == (9, "eval")
