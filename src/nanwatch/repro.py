"""Reproducibility helpers: seed everything, make kernels deterministic, and let one process go first.

Replaying a failing batch only helps when the run that produced it can be run again the same way; these are the
three things a training script needs for that, usable with or without a distributed launcher.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from nanwatch.core.distributed.ranks import world_size_and_rank
from nanwatch.errors import NanwatchError, NanwatchWarning

__all__ = ["set_seed", "enable_full_determinism", "main_process_first"]

_MAX_SEED = 2**32 - 1  # numpy's legacy seeding accepts no more, and every generator is seeded with the same value
# cuBLAS is deterministic only with one of these workspace settings; ":16:8" uses less memory, ":4096:8" is faster.
_DETERMINISTIC_CUBLAS = (":16:8", ":4096:8")


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed Python's `random`, numpy (when installed) and torch on the CPU and every CUDA device.

    Args:
        seed: an integer in [0, 2**32 - 1].
        deterministic: also make torch refuse operations that have no deterministic implementation
            (`torch.use_deterministic_algorithms(True)`). `enable_full_determinism` does this and sets what CUDA
            needs as well.

    Raises:
        ValueError: the seed is not an integer in range.
    """
    _check_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    # Seeds the CPU generator and, lazily, the generator of every CUDA device.
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def enable_full_determinism(seed: int, warn_only: bool = False) -> None:
    """Seed everything and make every torch operation deterministic, on the CPU and on CUDA.

    Sets `CUBLAS_WORKSPACE_CONFIG=":16:8"` (kept if it already holds ":4096:8", the other deterministic value) and
    `CUDA_LAUNCH_BLOCKING="1"`, turns on `torch.use_deterministic_algorithms`, makes cuDNN deterministic and turns its
    benchmark mode off. Call it before the first CUDA operation: cuBLAS reads its workspace setting once.

    Args:
        seed: an integer in [0, 2**32 - 1], passed to `set_seed`.
        warn_only: warn instead of raising when an operation has no deterministic implementation.

    Raises:
        ValueError: the seed is not an integer in range.

    Warns:
        NanwatchWarning: CUDA was already initialised with another cuBLAS workspace setting, which may then not apply.
    """
    _check_seed(seed)
    previous_cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if previous_cublas not in _DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            warnings.warn(
                "enable_full_determinism() was called after CUDA was initialised, with "
                f"CUBLAS_WORKSPACE_CONFIG={previous_cublas!r}: cuBLAS may keep its old workspace and stay "
                "non-deterministic. Call it at the start of the script, before any CUDA work.",
                NanwatchWarning,
                stacklevel=2,
            )
    # Kernel launches become synchronous, so an error or a race shows at the operation that caused it.
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    set_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def main_process_first(local: bool = True) -> Iterator[None]:
    """Run the block on the main process first, then on the others, e.g. to download or preprocess once.

    The others wait at a barrier until the main process has finished the block, then run it themselves (by then they
    usually find its result cached). Without a process group this simply runs the block. Every rank must enter the
    block, since the wait is a collective.

    Args:
        local: the main process is the first process of each node (`LOCAL_RANK` 0), for work cached on a node's own
            disk; with False it is rank 0 alone, for a cache that every node shares.

    Raises:
        NanwatchError: on a process that was waiting, when a main process failed inside the block; the main process
            itself raises its own exception, unchanged.
    """
    world_size, rank = world_size_and_rank()
    if world_size == 1:
        yield
        return
    is_main = _local_rank(rank) == 0 if local else rank == 0
    if not is_main:
        if _main_failed(failed=False):
            which = "the first process of a node" if local else "rank 0"
            raise NanwatchError(
                f"main_process_first: {which} raised inside the block, so rank {rank} does not run it; "
                f"see that process's error"
            )
        yield
        return
    try:
        yield
    except BaseException:
        # Release the waiting processes with the news, instead of leaving them at the barrier until it times out.
        _main_failed(failed=True)
        raise
    _main_failed(failed=False)


def _main_failed(*, failed: bool) -> bool:
    """The barrier itself: every rank contributes whether it failed as a main process; returns whether any did."""
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _local_rank(rank: int) -> int:
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        # Not started by torchrun (e.g. mp.spawn on one machine): the global rank is the local one.
        return rank
    try:
        return int(raw)
    except ValueError:
        raise NanwatchError(f"main_process_first: LOCAL_RANK must be an integer, got {raw!r}") from None


def _check_seed(seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer in [0, {_MAX_SEED}], got {seed!r} ({type(seed).__name__})")
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, {_MAX_SEED}], got {seed}")
