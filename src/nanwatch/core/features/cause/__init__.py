"""Why a run went non-finite: a cause on every detection, with its evidence, and the culprit's call for a repro.

The culprit feature says where the first inf/nan was made; this one says why, by testing the detection, never the
clean path:

- "data": the culprit is the model's input: the inputs of the micro-batch (kept by reference) are searched for the
  inf/nan, and the report names which input and the first positions;
- "precision": the culprit's micro-batch is run again eagerly (`rerun.py`: no trace left, no collective) to capture
  the culprit's call, which is recomputed in a wider dtype from the same inputs and weights (`precision.py`); finite
  there: the narrow dtype's range failed, and the first op past it is named;
- "compiler": the model runs compiled, and the same micro-batch run eagerly in the same dtype is finite at the
  culprit;
- "weights": a parameter held inf/nan when the forward began: born in the last optimizer step applied since the
  previous clean check (`born_in_step`);
- "loss": born outside the model; "unknown" where no test applies or one could not run (the evidence says why).

In full mode the feature keeps each micro-batch's outermost forward calls (`keeping.py`: references, the generators'
state, the buffers a forward changes). In sentinel mode the replay's own watch (full mode) tests the cause on the
forward it replays, and the run's adds what only it knows (the optimizer step that broke the weights).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanwatch.core.config import WatchConfig
from nanwatch.core.feature_api import EngineContext, Feature, OptimizerStage, Phase
from nanwatch.core.features.cause.compiled import compile_info
from nanwatch.core.features.cause.diagnose import Diagnosis, StepHistory, diagnose, weights_cause
from nanwatch.core.features.cause.keeping import CallKeeper
from nanwatch.core.features.cause.records import CAUSE_KINDS, Cause, CauseKind, CulpritCall
from nanwatch.core.formats.capsule import capsule_file_name, write_capsule
from nanwatch.core.frames import Frame
from nanwatch.core.log import warn
from nanwatch.core.report import Report, ReportSection

__all__ = ["CAUSE_KINDS", "Cause", "CauseFeature", "CauseKind", "cause_section"]

# Where the cause prints: just before the culprit line, which stays the report's last.
_ORDER = 9
# The section in which a replay's watch hands the culprit's call to the run's (removed before anything is published).
_CALL_KEY = "culprit_call"


@dataclass(frozen=True)
class CapsuleDue:
    """A capsule a report names, to write once that report is published."""

    path: str
    diagnosis: Diagnosis


class CauseFeature(Feature):
    """Adds the `cause` section to every detection (and writes the repro capsule, with `report_dir`)."""

    name = "cause"

    def __init__(self, config: WatchConfig) -> None:
        self._report_dir = config.report_dir
        self._mode = config.mode
        self._for_a_replay = config.watches_a_replay
        self._keeper = CallKeeper(None)  # replaced by `attach`, which knows the model
        self._children_kept = False  # the model's children's calls are kept too (`on_batch_end`)
        self._stepping: int | None = None  # the step being applied, as reports during it count steps
        self._last_applied: int | None = None
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self.last_call: CulpritCall | None = None  # the culprit's call captured for the last detection
        self._capsule_due: CapsuleDue | None = None  # the capsule the last report names, written once it is published

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        self._children_kept = False
        self._keeper = CallKeeper(ctx.model)
        if self._mode == "sentinel":  # the sentinel keeps the micro-batch; its replay's watch keeps the forward
            return
        if hasattr(type(ctx.model), "training_step"):
            # A LightningModule: its training_step calls its children (a call of the module itself, through a DDP
            # wrapper, runs training_step: nothing a rerun can call again as it was called).
            self._keep_children(ctx)
            return
        self._keep_calls_of(ctx, ctx.entry)

    def _keep_calls_of(self, ctx: EngineContext, module: torch.nn.Module) -> None:
        ctx.hooks.add_handle(module.register_forward_pre_hook(self._keeper.before, with_kwargs=True))
        ctx.hooks.add_handle(module.register_forward_hook(self._keeper.after, with_kwargs=True, always_call=True))

    def _keep_children(self, ctx: EngineContext) -> None:
        self._children_kept = True
        for name, child in ctx.model.named_children():
            self._keeper.names[id(child)] = name
            self._keep_calls_of(ctx, child)

    def on_batch_end(self, ctx: EngineContext, phase: Phase, batch_number: int) -> None:
        if (
            self._mode == "full"
            and phase == "train"
            and not self._keeper.calls
            and not self._children_kept
            and ctx.recording
        ):
            # A training micro-batch ran without calling the model itself: a LightningModule's training_step calls
            # its submodules. From now on the calls of the model's children are kept (once per model: a model of
            # many children called directly costs a hook call each, which only such a model pays).
            self._keep_children(ctx)
        self._keeper.clear()  # checked clean: its calls are not needed any more

    def on_optimizer_step(
        self, ctx: EngineContext, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None
    ) -> None:
        # Features hear of a step before its check runs, and some frameworks report no "after" (Lightning counts its
        # own steps): a step whose "before" came and went, and a later step began, was applied.
        if stage == "before":
            if self._stepping is not None:
                self._last_applied = self._stepping
            self._stepping = ctx.counters.optimizer_step if ctx.counters.optimizer_step is not None else 0
            if optimizer is not None:
                self._optimizer = weakref.ref(optimizer)
        elif stage == "after" and self._stepping is not None:
            self._last_applied = self._stepping

    def judge(self, ctx: EngineContext, report: Report, checked: Sequence[Frame]) -> Report | None:
        """A detection that is to be raised (the loss scaler's tolerated overflows never get here): its cause.

        Sentinel mode tests nothing itself: its replay's watch tested the cause on the forward it ran (leaving the
        model as the sentinel restores it) and handed the culprit's call on in a section of its report; the run adds
        what only it knows (the step that broke the weights) and writes the capsule."""
        culprit = report.culprit
        if self._mode == "sentinel":
            return self._from_the_replay(ctx, report)
        if culprit is None:
            return report.with_section(cause_section(_untestable(report)))
        if self._keeper.failed is not None and getattr(culprit, "kind", None) == "produced":
            reason = f"the micro-batch's forward could not be kept to run again: {self._keeper.failed}"
            return self._concluded(ctx, report, Diagnosis(Cause("unknown", reason, culprit.module_name), None))
        try:
            diagnosis = diagnose(
                culprit,
                calls=self._keeper.calls,
                model=ctx.model,
                hooks=ctx.hooks,
                compiled=compile_info(ctx.entry, ctx.model),
                steps=self._history(),
                weights_changed=ctx.weights_changed(),
            )
        except Exception as error:  # the report matters more than its cause
            diagnosis = Diagnosis(Cause("unknown", f"the cause could not be tested: {error!r}"), None)
        finally:
            self._keeper.clear()
        if self._for_a_replay and diagnosis.call is not None:  # for the run's watch, which writes the capsule
            report = report.with_section(ReportSection(_CALL_KEY, _ORDER, (), None, diagnosis.call))
        return self._concluded(ctx, report, diagnosis)

    def _from_the_replay(self, ctx: EngineContext, report: Report) -> Report:
        replayed, handed = report.cause, report.section(_CALL_KEY)
        report = report.without_section(_CALL_KEY)
        if not isinstance(replayed, Cause):
            return report.with_section(cause_section(_untestable(report)))
        call = handed.payload if handed is not None and isinstance(handed.payload, CulpritCall) else None
        culprit = report.culprit
        if replayed.kind == "weights" and culprit is not None:
            replayed = weights_cause(culprit, self._history())
        return self._concluded(ctx, report, Diagnosis(replayed, call))

    def _concluded(self, ctx: EngineContext, report: Report, diagnosis: Diagnosis) -> Report:
        """The report with its cause section, naming the capsule where a call was captured (`report_dir`): it is
        written once the report is published (`on_publish`: after the report is logged and on disk, and only for a
        report that is published, not a rank's own detection the ranks' agreement set aside)."""
        self.last_call = diagnosis.call
        self._capsule_due = None
        capsule = None
        if diagnosis.call is not None and self._report_dir is not None:
            capsule = str(Path(str(self._report_dir)) / capsule_file_name(ctx.rank, report.batch_number, report.phase))
            self._capsule_due = CapsuleDue(capsule, diagnosis)
        return report.with_section(cause_section(diagnosis.cause, capsule))

    def on_publish(self, ctx: EngineContext, report: Report) -> None:
        due, self._capsule_due = self._capsule_due, None
        if due is not None and report.capsule == due.path:
            self._write_capsule(ctx, report, due)

    def _write_capsule(self, ctx: EngineContext, report: Report, due: CapsuleDue) -> None:
        call, path = due.diagnosis.call, due.path
        assert call is not None
        compiled = compile_info(ctx.entry, ctx.model)
        try:
            write_capsule(
                path,
                call.module,
                call.args,
                call.kwargs,
                dtype=call.output_dtype or torch.float32,
                autocast=call.autocast,
                compile_backend=compiled.backend if compiled is not None else None,
                compile_mode=compiled.mode if compiled is not None else None,
                module_name=getattr(report.culprit, "module_name", None) or "",
                batch_number=report.batch_number,
                rank=ctx.rank,
                note=f"written by nanwatch for a detection; cause: {due.diagnosis.cause}",
            )
        except Exception as error:  # a full disk, a module that cannot be pickled: the run goes on without it
            warn(f"nanwatch could not write the repro capsule {path} that the report names: {error!r}")

    def _history(self) -> StepHistory:
        optimizer = self._optimizer() if self._optimizer is not None else None
        rates: tuple[float, ...] = ()
        if optimizer is not None:
            rates = tuple(float(group["lr"]) for group in optimizer.param_groups if _number(group.get("lr")))
        return StepHistory(self._last_applied, rates)

    def close(self, ctx: EngineContext) -> None:
        self._capsule_due = None
        self._keeper = CallKeeper(None)  # a closed watcher keeps nothing of the model
        self._optimizer = None
        self.last_call = None


def cause_section(cause: Cause, capsule: str | None = None) -> ReportSection:
    """The report's cause section: its line, its JSON (with the path of the capsule it names), the `Cause`."""
    data = cause.to_dict()
    data["capsule"] = capsule
    lines: tuple[str, ...] = (f"cause: {cause}",)
    if capsule is not None:
        lines += (f"repro capsule: {capsule} (`nanwatch repro` runs the culprit alone; see docs/why-nan.md)",)
    return ReportSection("cause", _ORDER, lines, data, cause)


def _untestable(report: Report) -> Cause:
    """The cause of a detection no culprit was named for: why no test applies."""
    replay = report.section("replay")
    verdict = replay.data.get("verdict") if replay is not None and isinstance(replay.data, dict) else None
    if verdict is not None:
        found = replay.data.get("cause") if replay is not None and isinstance(replay.data, dict) else None
        said = f", cause: {found}" if isinstance(found, str) else ""
        return Cause("unknown", f"sentinel mode's replay named no culprit to test (its verdict: {verdict}{said})")
    return Cause(
        "unknown",
        "no module's forward made it (first seen in the gradients, or in no recorded frame): no test applies",
        report.module_name,
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)
