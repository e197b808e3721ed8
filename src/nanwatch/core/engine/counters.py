"""Where the run is: the phase, each phase's micro-batch counter, the framework's optimizer step and epoch."""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator, Mapping
from typing import Any, Generic, NamedTuple, SupportsIndex, TypeVar, cast, overload

import torch

from nanwatch.core.feature_api import KEEP, Kept, Phase

__all__ = ["KEEP", "PHASES", "Counters", "Kept", "Stamp"]

PHASES: tuple[Phase, ...] = ("train", "eval")
_T = TypeVar("_T")


class Stamp(NamedTuple):
    """What every frame made now carries: the current micro-batch of the current phase, and the phase."""

    batch_number: int
    phase: Phase


class _Restamps(Generic[_T]):
    """A counter whose every change renews `Counters.stamp` (kept in `_<name>`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._kept = f"_{name}"

    @overload
    def __get__(self, counters: None, owner: type) -> _Restamps[_T]: ...
    @overload
    def __get__(self, counters: Counters, owner: type) -> _T: ...
    def __get__(self, counters: Counters | None, owner: type) -> _T | _Restamps[_T]:
        if counters is None:
            return self
        value: _T = getattr(counters, self._kept)
        return value

    def __set__(self, counters: Counters, value: _T) -> None:
        setattr(counters, self._kept, value)
        counters._restamp()


class Counters:
    """The counters a report and an error carry, and the phase the next frames belong to. The engine's parts change
    them; everyone else reads them as `RunCounters` (core/feature_api.py), read-only.

    `batch_number` counts training micro-batches (what transformers' tool calls `batch_number`), `eval_batch_number`
    evaluation ones; `optimizer_step` and `epoch` are the framework's own counts, None where it keeps none.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._phase: Phase = "train"
        self._batch_number = 0
        self._eval_batch_number = 0
        # `(current_batch, phase)`, kept as the three change: what every frame made from now on carries (read at each
        # module call, where two attribute reads and a test add up).
        self.stamp = Stamp(0, "train")
        self.optimizer_step: int | None = None
        self.epoch: int | None = None
        self.batch_started = False  # a training forward ran since the last training micro-batch ended
        self._logger = logger

    # Each change of these renews `stamp`.
    phase = _Restamps[Phase]()
    batch_number = _Restamps[int]()
    eval_batch_number = _Restamps[int]()

    def _restamp(self) -> None:
        phase = self._phase
        self.stamp = Stamp(self._batch_number if phase == "train" else self._eval_batch_number, phase)

    @property
    def current_batch(self) -> int:
        """The current micro-batch of the current phase (derived once, in `_restamp`)."""
        return self.stamp.batch_number

    @property
    def last_batch(self) -> int:
        """The micro-batch that ran last: the current one, except in training between a micro-batch's end and the
        next one's start (a loop may end the micro-batch before its optimizer step)."""
        if self.phase == "eval" or self.batch_started or self.batch_number == 0:
            return self.current_batch
        return self.batch_number - 1

    def set(self, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """The framework's counters as they are now (numpy integers and 0-d tensors are taken as ints)."""
        if optimizer_step is not KEEP:
            self.optimizer_step = self.whole_number("optimizer_step", optimizer_step)
        if epoch is not KEEP:
            self.epoch = self.whole_number("epoch", epoch)

    def count_optimizer_step(self) -> None:
        """An optimizer step ran, and the framework keeps no count of its own."""
        self.optimizer_step = 1 if self.optimizer_step is None else self.optimizer_step + 1

    def advance(self) -> None:
        """The current micro-batch ended: its phase's counter moves on."""
        if self.phase == "train":
            self.batch_number += 1
            self.batch_started = False
        else:
            self.eval_batch_number += 1

    def snapshot(self) -> dict[str, Any]:
        """Everything a report or an error reads of where the run is: what `as_of` puts back for a while."""
        return {**self.state_dict(), "phase": self.phase, "batch_started": self.batch_started}

    @contextlib.contextmanager
    def as_of(self, snapshot: Mapping[str, Any]) -> Iterator[None]:
        """The counters as they were at `snapshot` inside the block (a check made then, concluded now), as they are
        after it."""
        now = self.snapshot()
        self._put(snapshot)
        try:
            yield
        finally:
            self._put(now)

    def _put(self, snapshot: Mapping[str, Any]) -> None:
        self.load_state_dict(snapshot)
        self.phase = snapshot["phase"]
        self.batch_started = snapshot["batch_started"]

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_number": self.batch_number,
            "eval_batch_number": self.eval_batch_number,
            "optimizer_step": self.optimizer_step,
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch_number = self.whole_number("batch_number", state["batch_number"]) or 0
        self.eval_batch_number = self.whole_number("eval_batch_number", state.get("eval_batch_number", 0)) or 0
        self.optimizer_step = self.whole_number("optimizer_step", state.get("optimizer_step"))
        self.epoch = self.whole_number("epoch", state.get("epoch"))

    def whole_number(self, name: str, value: object) -> int | None:
        """A counter as a plain int: frameworks hand over numpy integers, 0-d tensors, integral floats."""
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        try:
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, float) and value.is_integer():
                return int(value)
            return operator.index(cast(SupportsIndex, value))  # anything else raises TypeError here
        except (TypeError, ValueError, RuntimeError):
            self._logger.warning(f"nanwatch: {name} must be a whole number, got {value!r}; reports leave it out")
            return None
