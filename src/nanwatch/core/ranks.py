"""Rank handling, in one place: who am I, and did any rank see inf/nan? Without a collective of nanwatch's own.

A collective nanwatch runs on the user's process group pairs with whatever the user's ranks run next: with uneven
data (`ddp.join()`, which shadows collectives for ranks out of data) or a final `dist.barrier()` it paired with the
wrong thing, and a rank that stopped early held the others in it until the group's timeout. So ranks tell each other
of a detection through the process group's key-value store instead (the TCPStore every `init_process_group` sets up),
which pairs with nothing: a rank posts what it saw, and every rank settles on one verdict, the first rank to decide
fixing it for all (`compare_set`). Waiting for the others' posts is bounded by `wait_s`, never a hang.

Ranks do meet, without nanwatch, at the optimizer step: DDP all-reduces the gradients first, so a nan on any rank
makes every rank's gradients non-finite, and every rank's guard sees it at the same step.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist

__all__ = ["world_size_and_rank", "Detection", "DetectionBoard", "Kind"]

# What a detection rests on, most telling first: a frame that held inf/nan, or only the gradients about to be applied.
Kind = Literal["frames", "gradients"]
_KINDS: tuple[Kind, ...] = ("frames", "gradients")
_POLL_S = 0.01
# Each watcher in a process gets its own keys; every rank creates its watchers in the same order.
_generations = itertools.count()


def world_size_and_rank() -> tuple[int, int]:
    """`(world_size, rank)` of the default process group, `(1, 0)` when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclass(frozen=True)
class Detection:
    """One rank's detection, or the verdict all ranks settled on."""

    batch_number: int
    rank: int
    phase: str = "train"
    kind: Kind = "frames"

    def order(self) -> tuple[int, int, int, int]:
        # Frames before gradients alone (they say where it began), training before evaluation, then the earliest.
        return (_KINDS.index(self.kind), self.phase != "train", self.batch_number, self.rank)

    def encode(self) -> str:
        return f"{self.kind} {self.phase} {self.batch_number} {self.rank}"

    @classmethod
    def decode(cls, text: str | bytes) -> Detection:
        kind, phase, batch, rank = (text.decode() if isinstance(text, bytes) else text).split()
        if kind not in _KINDS:
            raise ValueError(f"not a nanwatch detection: {text!r}")
        return cls(int(batch), int(rank), phase, kind)


class DetectionBoard:
    """Where the ranks of one run post detections and settle on one verdict, through the process group's store.

    Args:
        store: the store (`torch.distributed` `Store`) shared by every rank.
        rank: this process's rank.
        world_size: the number of ranks.
        wait_s: how long `settle` waits for the other ranks' posts (or for another rank's verdict).
    """

    def __init__(self, store: Any, rank: int, world_size: int, wait_s: float) -> None:
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.wait_s = wait_s
        prefix = f"nanwatch/{next(_generations)}"
        self._count_key = f"{prefix}/count"
        self._verdict_key = f"{prefix}/verdict"
        self._rank_key = f"{prefix}/rank"
        self._posted = False

    @classmethod
    def for_this_run(cls, rank: int, world_size: int, wait_s: float) -> DetectionBoard | None:
        """The board of the default process group, or None when not distributed (or when it has no store)."""
        if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            return None
        return cls(store, rank, world_size, wait_s)

    def post(self, detection: Detection) -> None:
        """Tell the other ranks what this rank saw (once; later detections of this rank change nothing)."""
        if self._posted:
            return
        self._posted = True
        self._store.set(f"{self._rank_key}{self.rank}", detection.encode())
        self._store.add(self._count_key, 1)

    def posted_elsewhere(self) -> bool:
        """Whether any rank has posted a detection (one round trip to the store, no collective)."""
        return int(self._store.add(self._count_key, 0)) > 0

    def settle(self, mine: Detection | None, *, wait: bool = True) -> Detection:
        """The verdict every rank raises: the first decided, else the most telling detection posted.

        Args:
            mine: this rank's detection (posted first), or None when this rank saw nothing but others did.
            wait: wait up to `wait_s` for every rank's post before deciding (at the optimizer step, where a nan on
                one rank reaches every rank's gradients); without it, decide from what is posted now (a detection
                of kind "gradients" always waits).

        Raises:
            TimeoutError: this rank saw nothing, and within `wait_s` no rank posted or decided anything.
        """
        if mine is not None:
            self.post(mine)
            # Non-finite gradients alone are what every rank sees after DDP's all-reduce, never evidence of where the
            # nan began: such a rank waits for the others' posts (it is at an optimizer step, where the ranks meet).
            wait = wait or mine.kind == "gradients"
        deadline = time.monotonic() + self.wait_s
        while True:
            verdict = self._verdict()
            if verdict is not None:
                return verdict
            count = self._store.add(self._count_key, 0)
            late = time.monotonic() >= deadline
            # A rank that saw something decides once every rank posted (or it may not wait, or waited long enough);
            # one that saw nothing waits for that verdict, and decides only if the deciding rank never does.
            if mine is not None and (count >= self.world_size or not wait or late):
                break
            if mine is None and late:
                if count == 0:
                    raise TimeoutError(f"no rank posted a detection within {self.wait_s:g} s")
                break
            time.sleep(_POLL_S)
        posted = [self._read(rank) for rank in range(self.world_size)]
        best = min((p for p in posted if p is not None), key=Detection.order)
        # The first rank to get here fixes the verdict; every later one reads that instead of its own choice.
        return Detection.decode(self._store.compare_set(self._verdict_key, "", best.encode()))

    def _verdict(self) -> Detection | None:
        if not self._store.check([self._verdict_key]):
            return None
        return Detection.decode(self._store.get(self._verdict_key))

    def _read(self, rank: int) -> Detection | None:
        key = f"{self._rank_key}{rank}"
        return Detection.decode(self._store.get(key)) if self._store.check([key]) else None
