"""Sentinel mode (`mode="sentinel"`): cheap enough to leave on, and the exact report when it is needed.

No per-module hook. Hooks on the model the loop calls (or on its `torch.compile` wrapper, outside the compiled
graph; or, for a LightningModule, whose `training_step` is the loop's call, on its direct children) see each
outermost forward call. For a training call, a pre-hook keeps references (no copies) to its args and kwargs, the
generator states, the autocast state and the grad mode, and, once per micro-batch, copies of the buffers a forward
changes (BatchNorm's running stats; the others are referenced). The forward hook reads each float output once on
the device, no host sync (its min and max: either is inf or nan as soon as a value is, and neither overflows from
finite values; an evaluation output is summed and kept until its check, `_look_at`), and puts a tensor hook on it
that keeps a reference to the gradient w.r.t. it. They join the check's one host read, with the guard's gradients
and the loss. Nothing more is kept, and only for the current accumulation window (until the optimizer step; with no
optimizer guarded, until the micro-batch ends).

When one is inf/nan, that micro-batch is run again (`EngineContext.rerun`) on the unwrapped model, with every
module watched: the same inputs, generator states, autocast state and buffers, and the same weights (the step never
ran). When only the gradients about to be applied are non-finite, the window's micro-batches are replayed in order
with their backward too, driven by the kept gradient w.r.t. each output (through `torch.autograd.grad`: nothing is
accumulated into `.grad`, and no hook of a DDP wrapper fires), until one reproduces. The report is then that
replay's full report. A replay that stays finite is a finding of its own, and the report says so. The buffers and
the generators end as they were; a replay that fails adds its error to the report and never replaces it.

A package, one job a module, so that the feature stays one unit to the features contract (no other feature imports
any of it): `feature` (the hooks, the check, the decision to replay), `kept` (what a micro-batch's replay is given),
`outputs` (the one look at the model's output), `replay` (running a micro-batch again, and what the report says).
"""

from __future__ import annotations

from nanwatch.core.features.sentinel.feature import SentinelFeature
from nanwatch.core.features.sentinel.kept import MAX_WINDOW

__all__ = ["SentinelFeature", "MAX_WINDOW"]
