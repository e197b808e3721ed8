"""A step's check decided on the device: the optimizer skips the update itself, the host reads the verdict a step later.

Where the optimizer takes a device-side `found_inf` (torch's fused Adam, AdamW, SGD, Adagrad; core/optimizers.py),
sentinel mode need not stop the host before each step to read its flags: the check's parts are folded into one
value on the device (core/stats/readback.py `fold`), turned into the optimizer's `found_inf` (1.0 when anything is
inf/nan), and the optimizer skips its update on the device when it is set, as it does for a `GradScaler`. The folded
value is copied to the host behind the step (on CUDA: into pinned memory, with an event), and read when the next
step is about to run: by then the GPU finished it long ago, so the read waits for nothing.

Nothing changes for a finite step (`found_inf` 0.0 leaves a fused optimizer's update exactly as without it). A step
that held inf/nan applied nothing, and the detection is concluded a step late, as of the step it refused: the
counters are put back to that step while it is reviewed, reported and raised (or listed as skipped).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch.core.engine.checker import Launched

__all__ = ["DecidedOnDevice", "skip_flag"]


def skip_flag(launched: Launched) -> torch.Tensor | None:
    """The optimizer's `found_inf` for this check: a 0-d float32 tensor, 1.0 when anything it looks at holds inf/nan
    and 0.0 otherwise, made on the device in one op or two, from what detects inf/nan only (the frames, the guard,
    the sentinel; never a feature that only warns); None when that spans several devices."""
    if launched.detecting != 1:  # nothing that detects, or several devices: the host decides
        return None
    summary = launched.folded[0].summary  # what detects only: a warning (headroom) never skips a step
    # Each level of the summary is 0 (fine) or nan (tripped): their sum too, and nan becomes 1.0.
    level = summary.reshape(()) if summary.numel() == 1 else summary.sum()
    return torch.nan_to_num(level.float(), nan=1.0)


@dataclass
class DecidedOnDevice:
    """A check handed to an optimizer as its `found_inf`, to be read once the next step is queued.

    Args:
        launched: the check's first half (core/engine/checker.py).
        optimizer: the optimizer that took the flag.
        counters: where the run was when the check was launched (`Counters.snapshot`).
        flag: the `found_inf` handed to the optimizer.
    """

    launched: Launched
    optimizer: torch.optim.Optimizer
    counters: Mapping[str, Any]
    flag: torch.Tensor  # the `found_inf` handed to the optimizer
    _host: list[torch.Tensor]
    _ready: Any = None  # a CUDA event recorded behind the copies to pinned memory
    # Each module's `training` as the step ran: put back while it is concluded (a replay runs the step's forward
    # as it ran, even when an evaluation between the steps is what concludes it).
    training: list[tuple[torch.nn.Module, bool]] | None = None

    @classmethod
    def start(
        cls,
        launched: Launched,
        optimizer: torch.optim.Optimizer,
        counters: Mapping[str, Any],
        flag: torch.Tensor,
        model: torch.nn.Module,
    ) -> DecidedOnDevice:
        """Copy the folded summaries to the host behind the work queued so far (no wait)."""
        host, ready = [], None
        for folded in launched.folded:
            summary = folded.summary
            if summary.device.type == "cuda":
                copy = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=True)
                copy.copy_(summary, non_blocking=True)
                host.append(copy)
                if ready is None:
                    ready = torch.cuda.Event()
            else:  # the CPU computed it already; another accelerator is read as it is, a step late
                host.append(summary)
        if ready is not None:
            ready.record()
        training = [(module, module.training) for module in model.modules()]
        return cls(launched, optimizer, counters, flag, host, ready, training)

    @contextlib.contextmanager
    def as_it_ran(self) -> Iterator[None]:
        """The modules in the training modes they had as the step ran, inside the block; as they are after it."""
        now = [(module, module.training) for module, _ in self.training or ()]
        try:
            for module, training in self.training or ():
                module.training = training
            yield
        finally:
            for module, training in now:
                module.training = training

    def values(self) -> list[list[float]]:
        """The summaries on the host: a step after they were queued, the copy is long done."""
        if self._ready is not None:
            self._ready.synchronize()
        return [copy.tolist() for copy in self._host]
