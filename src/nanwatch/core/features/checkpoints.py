"""The checkpoint guard: a checkpoint that holds inf/nan is never written under the framework's name.

Users of long runs lose them this way: a nan reaches the weights (or an optimizer's moments), the next checkpoint saves
it, the healthy ones rotate out, and an automatic resume loads the nan again. Each adapter hands what is about to be
written (`Watcher.verify_checkpoint`) before the framework writes it: one fused finiteness check of every floating-point
tensor in it (core/stats/finite.py), small next to the write it guards. A finite checkpoint becomes the run's "last good
one", which every later report names as where to resume; a non-finite one raises `NonFiniteCheckpoint` before anything
is written (and before a framework rotates older checkpoints out).

What is poison: inf/nan in a weight or an optimizer's state, or in a buffer that did not hold it from the start. A
buffer that held inf/nan when watching began (an additive attention mask) may hold the same again, in the same places
(buffer_masks.py); a checkpoint that holds it is written.

Under `quarantine` the refused checkpoint is first written aside, as `<name>.nonfinite` in a folder that the adapter
names (`WriteAside.folder`: `nanwatch-quarantine`, out of every folder the framework scans for a checkpoint to resume
from or rotates), and the error says where.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nanwatch.core.feature_api import EngineContext, Feature, WriteAside
from nanwatch.core.features.buffer_masks import BufferMasks
from nanwatch.core.frames import ResolvedFrame
from nanwatch.core.readouts import LAST_GOOD_CHECKPOINT, Readout
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.stats.finite import MAX_NAMED, non_finite_tensors
from nanwatch.errors import NonFiniteCheckpoint

__all__ = ["CheckpointGuard", "QUARANTINE_SUFFIX", "quarantine_path"]

QUARANTINE_SUFFIX = ".nonfinite"


class CheckpointGuard(Feature):
    name = "checkpoints"

    def __init__(self, policy: str) -> None:
        self._policy = policy
        self._masks = BufferMasks()
        self.last_good: tuple[str, int | None] | None = None

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        if self._policy != "off":
            self._masks.learn(ctx.model)  # the buffers as watching begins: which hold inf/nan by design

    def on_checkpoint(
        self,
        ctx: EngineContext,
        state: Any,
        path: str,
        step: int | None,
        write_aside: WriteAside | None,
    ) -> None:
        if self._policy == "off":
            return
        self._masks.learn(ctx.model)  # only buffers registered since watching began (a lazily built mask)
        bad, checked = non_finite_tensors(state, self._masks.known(ctx.model))
        if not bad:
            self.last_good = (path, step)
            return
        aside, failed = None, ""
        if self._policy == "quarantine" and write_aside is not None:
            target = quarantine_path(path, write_aside.folder)
            try:
                write_aside.write(target)
                aside = target
            except Exception as error:  # a full disk: the checkpoint is still refused, never let through
                failed = f" (writing it aside failed: {error!r})"
        shown = ", ".join(f"{where} {word}" for where, word in bad[:MAX_NAMED])
        more = f" and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
        written = f"written aside as {aside!r} instead" if aside is not None else f"not written{failed}"
        message = (
            f"nanwatch: the checkpoint {path!r} (optimizer step {step}) holds inf/nan: {shown}{more} ({len(bad)} of "
            f"{checked} floating-point tensors); {written}. {_resume_from(self.last_good)}"
        )
        ctx.logger.error(message)
        raise NonFiniteCheckpoint(message, path=path, non_finite=bad, quarantine_path=aside, last_good=self.last_good)

    def annotate(self, ctx: EngineContext, report: Report, resolved: Sequence[ResolvedFrame], first: int) -> Report:
        if self.last_good is None:  # nothing saved through the guard yet: no line (a report stays transformers' own)
            return report
        path, step = self.last_good
        data = {"path": path, "optimizer_step": step}
        return report.with_section(ReportSection("checkpoint", 90, (_resume_from(self.last_good),), data))

    def readouts(self) -> Mapping[Readout[Any], Callable[[], Any]]:
        return {LAST_GOOD_CHECKPOINT: lambda: self.last_good}


def quarantine_path(path: str, folder: str) -> str:
    """Where a refused checkpoint to be written to `path` goes instead: `<folder>/<its name>.nonfinite`."""
    return os.path.join(folder, f"{os.path.basename(path.rstrip('/'))}{QUARANTINE_SUFFIX}")


def _resume_from(last_good: tuple[str, int | None] | None) -> str:
    if last_good is None:
        return "No checkpoint of this run was verified finite before it."
    path, step = last_good
    return f"Last checkpoint verified finite: {path!r} (optimizer step {step}): resume from there."
