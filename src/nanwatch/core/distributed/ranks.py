"""Who am I, and what a rank's detection says: the pieces the agreement (core/distributed/board.py) is made of.

A collective nanwatch runs on the user's process group pairs with whatever the user's ranks run next: with uneven
data (`ddp.join()`, which shadows collectives for ranks out of data) or a final `dist.barrier()` it paired with the
wrong thing, and a rank that stopped early held the others in it until the group's timeout. So ranks tell each other
of a detection through the process group's key-value store instead (the TCPStore every `init_process_group` sets up),
which pairs with nothing: a rank posts what it saw, and every rank settles on one verdict, the first rank to decide
fixing it for all (core/distributed/board.py). Every wait is bounded by `rank_wait_s`, never a hang.

Ranks do meet, without nanwatch, at the optimizer step: DDP all-reduces the gradients first, so a nan on any rank
makes every rank's gradients non-finite, and every rank's guard sees it at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

__all__ = ["world_size_and_rank", "Detection", "Kind"]

# What a detection rests on, most telling first: a frame that held inf/nan, or only the gradients about to be applied.
Kind = Literal["frames", "gradients"]
_KINDS: tuple[Kind, ...] = ("frames", "gradients")


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
