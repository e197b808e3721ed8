"""Sentinel mode (`mode="sentinel"`): cheap enough to leave on, and the exact report when it is needed.

No per-module hook. Hooks on the model the loop calls (or on its `torch.compile` wrapper, outside the compiled
graph; or, for a LightningModule, whose `training_step` is the loop's call, on its direct children) see each
outermost forward call. For a training call, a pre-hook keeps its args and kwargs (copies when they are small,
`sentinel_copy_inputs`; references with their version counters otherwise), the generator states (global, and those
the model holds), the autocast state and the grad mode, and, once per micro-batch, copies of the buffers a forward
changes (BatchNorm's running stats, from the micro-batch where they first change; the others are referenced, with
their version counters). The forward hook reads each float output once on the device, no host sync (its min and
max: either is inf or nan as soon as a value is, and neither overflows from finite values; an evaluation output is
summed and kept until its check), and puts a tensor hook on it that sums the gradients w.r.t. it over the backward
passes. They join the check's one host read, with the guard's gradients and the loss. Nothing more is kept, and only
for the current accumulation window (until the optimizer step; with no optimizer guarded, until the micro-batch
ends).

When one is inf/nan, that micro-batch is run again (`EngineContext.rerun`) on the unwrapped model, with every
module watched: the same inputs, generator states, autocast state and buffers, and the same weights (the step never
ran). When only the gradients about to be applied are non-finite, a kept gradient w.r.t. the output that is itself
non-finite says the loss made it; otherwise the window's micro-batches are replayed in order with their backward too,
driven by the kept gradients, into parameters of the replay's own that share the weights' storage (the run's `.grad`,
DDP's hooks and the user's are untouched; each parameter's gradient is checked), until one reproduces. A replay that
stays finite is run a second time, and the two compared, to tell a computation that differs from run to run from a
transient fault. What the report then says is one of four verdicts (`verdicts`). The buffers, the generators and the
modules' Python attributes end as they were; a replay that fails adds its error to the report and never replaces it.

A package, one job a module, so that the feature stays one unit to the features contract (no other feature imports
any of it): `feature` (the hooks, the check, the decision to replay), `kept` (what a micro-batch's replay is given),
`generators` (the generators a model holds), `outputs` (the one look at the model's output), `replay` (running a
micro-batch again), `verdicts` (what the report says of it).
"""

from __future__ import annotations

from nanwatch.core.features.sentinel.feature import SentinelFeature
from nanwatch.core.features.sentinel.kept import MAX_WINDOW

__all__ = ["SentinelFeature", "MAX_WINDOW"]
