"""Rank handling, in one place: who am I, and did any rank see inf/nan?"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["world_size_and_rank", "GlobalDetection", "agree_on_detection"]

_NO_DETECTION = torch.iinfo(torch.int64).max


def world_size_and_rank() -> tuple[int, int]:
    """`(world_size, rank)` of the default process group, `(1, 0)` when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclass(frozen=True)
class GlobalDetection:
    """The first detection across all ranks: the lowest batch number, then the lowest rank."""

    batch_number: int
    rank: int


def _collective_device() -> torch.device:
    backend = dist.get_backend()
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_detection(local_batch: int | None, rank: int, world_size: int) -> GlobalDetection | None:
    """Tell every rank whether any rank saw inf/nan, with one all-reduce of one int64.

    Every rank must call this at the same point of the step (it is a collective): never from a rank-zero-only path.

    Args:
        local_batch: the batch in which this rank saw inf/nan, or None.
        rank: this process's rank.
        world_size: the number of processes.

    Returns:
        The first detection over all ranks, or None when every rank was clean.
    """
    code = _NO_DETECTION if local_batch is None else local_batch * world_size + rank
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        flag = torch.tensor([code], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        code = int(flag.item())
    if code == _NO_DETECTION:
        return None
    return GlobalDetection(batch_number=code // world_size, rank=code % world_size)
