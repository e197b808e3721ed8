"""Sentinel mode's part in a spike's report: which modules moved, told by replaying under a full watch.

Sentinel mode records no module, so a spike (core/features/spikes.py) cannot say from the run's own frames which
module's output jumped. It asks for this instead (the `SPIKE_REPLAY` readout): the spiking micro-batch's forward run
again from what the sentinel kept, every module watched, and the micro-batch before it run the same way. Both run on
the weights as they are now, so a module whose output is far above its level on the earlier micro-batch moved with
this micro-batch's data; when none did, the spike came with the weights (the steps in between), and the report says
so. Forward only: the gradients the first run computed are not replayed (the kept output gradient belongs to the
spiking micro-batch alone).
"""

from __future__ import annotations

from collections.abc import Sequence

from nanwatch.core.feature_api import EngineContext
from nanwatch.core.features.sentinel.kept import MicroBatch
from nanwatch.core.features.sentinel.replay import run_again
from nanwatch.core.frames import ResolvedFrame
from nanwatch.core.model_state import generators as own_generators
from nanwatch.core.readouts import ReplayedLevels

__all__ = ["KEPT_FOR_SPIKES", "replay_levels"]

# Micro-batches whose step was applied, kept (with spike_window) beyond the window a replay of inf/nan needs: the
# spiking micro-batch may have been checked after its step, and the one before it is the comparison.
KEPT_FOR_SPIKES = 2


def replay_levels(
    ctx: EngineContext,
    kept: Sequence[MicroBatch],
    batch_number: int,
    *,
    sharded: bool,
    generators: Sequence[own_generators.OwnGenerator],
) -> ReplayedLevels:
    """Micro-batch `batch_number` and the kept one before it, each replayed (forward) under a full watch of its own;
    what could not be replayed says why (`ReplayedLevels.why_not`)."""
    if sharded:
        return ReplayedLevels(
            batch_number,
            why_not="not replayed: the parameters are sharded (FSDP), and a forward on this rank alone would gather "
            "them through collectives no other rank runs",
        )
    spiking = next((micro for micro in reversed(kept) if micro.batch_number == batch_number), None)
    if spiking is None:
        return ReplayedLevels(batch_number, why_not=f"not replayed: micro-batch {batch_number} was not kept")
    changed = spiking.changed()
    if changed:
        return ReplayedLevels(batch_number, why_not=f"not replayed: {', '.join(changed)} changed since it ran")
    try:
        frames = _forward_frames(ctx, spiking, generators)
    except Exception as error:  # the user's forward failing again, or ours: the spike is still reported
        return ReplayedLevels(batch_number, why_not=f"the replay of micro-batch {batch_number} failed: {error!r}")
    earlier = [micro for micro in kept if micro.batch_number < batch_number]
    if not earlier:
        return ReplayedLevels(batch_number, frames, why_not="no earlier micro-batch was kept to compare with")
    baseline = earlier[-1]
    changed = baseline.changed()
    if changed:
        why = f"micro-batch {baseline.batch_number} was not replayed to compare with: {', '.join(changed)} changed"
        return ReplayedLevels(batch_number, frames, baseline.batch_number, why_not=why)
    try:
        before = _forward_frames(ctx, baseline, generators)
    except Exception as error:
        why = f"the replay of micro-batch {baseline.batch_number} failed: {error!r}"
        return ReplayedLevels(batch_number, frames, baseline.batch_number, why_not=why)
    return ReplayedLevels(batch_number, frames, baseline.batch_number, before)


def _forward_frames(
    ctx: EngineContext, micro: MicroBatch, generators: Sequence[own_generators.OwnGenerator]
) -> list[ResolvedFrame]:
    frames: list[ResolvedFrame] = []

    def run() -> None:
        run_again(ctx, micro, backward=False, parameters=(), generators=generators)

    ctx.rerun(run, batch_number=micro.batch_number, phase="train", gradients=False, frames=frames)
    return frames
