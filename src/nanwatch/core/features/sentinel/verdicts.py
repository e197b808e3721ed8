"""What sentinel mode's report says of a replay: one of four verdicts, each a section of its own ("replay") whose data
carries the verdict for the JSON report and `NonFiniteError.replay`.

- "reproduced": the replay went non-finite too; its full report stands for the detection.
- "born_in_the_loss": the gradient w.r.t. the model's output was non-finite when the backward entered the model.
- "not_replayable": something the replay needs had changed or could not be restored, named, with what to do.
- "not_reproduced": two replays with everything restored stayed finite; whether they agreed with each other tells a
  transient fault ("cause": "transient_fault") from a computation that differs from run to run ("non_deterministic").

Apart from the replay itself because this is wording: what users act on, and what the docs show.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from nanwatch.core.features.sentinel.kept import MicroBatch
from nanwatch.core.report import Report, ReportSection
from nanwatch.core.runstate import determinism_flags

__all__ = [
    "RESTORED",
    "born_in_the_loss",
    "not_replayable",
    "not_reproduced",
    "not_restored",
    "reproduced",
    "unreplayed",
]

# What every replay restores, as the report lists it.
RESTORED = (
    "the inputs (copied, or unchanged since by their version counters), the weights (the step never ran), the "
    "buffers, the random generators (Python's, numpy's, torch's on the CPU and every CUDA device, and those the "
    "model's modules hold), the autocast and grad modes, and the modules' plain Python attributes"
)


def reproduced(found: Report, original: Report, micro: MicroBatch, *, backward: bool, second: bool = False) -> Report:
    """The replay's own report (`found`), with how it was replayed and what the sentinel first saw. `second`: only the
    second replay went non-finite, the first stayed finite (so the numbers differ between runs)."""
    line = (
        f"reproduced by replaying micro-batch {micro.batch_number} with every module watched (the same inputs, "
        "random generator states, autocast state and buffers; the same weights, since the step never ran)"
    )
    if backward:
        line += (
            "; its backward was driven by the gradient w.r.t. the model's output kept from the first run, into "
            "parameters of the replay's own (the run's .grad and its hooks untouched); the grad weight lines are "
            "their gradients summed over the window so far, as .grad holds them"
        )
    if second:
        line += (
            ". The first replay of the same micro-batch stayed finite and this second one did not: the same "
            f"computation gives different numbers from run to run (a non-deterministic kernel; {_pinning()})"
        )
    data = {"reproduced": True, "verdict": "reproduced", "replays": 2 if second else 1}
    report = found.with_section(ReportSection("replay", 30, (line,), data))
    for key in ("sentinel", "gradients"):
        section = original.section(key)
        if section is not None:
            report = report.with_section(section)
    return report


def born_in_the_loss(report: Report, micro: MicroBatch, label: str) -> Report:
    """The detection's report, saying that the gradient w.r.t. the model's output was already non-finite when the
    backward entered the model: the loss made it, computed outside the model from a finite output."""
    line = (
        f"born in the loss: the gradient w.r.t. the model's {label} in micro-batch {micro.batch_number}, kept from "
        "the run, was already inf/nan when the backward entered the model, whose output was finite; so the loss, "
        "computed outside the model, made it (look at a log, sqrt, division or exp of the output, or a torch.where "
        "whose other branch is inf/nan: its gradient is nan even where it is not chosen). Nothing was replayed, and "
        "nothing here points at the hardware."
    )
    # The micro-batch whose loss made it, as a reproduced verdict names the micro-batch it replayed (the detection
    # was at the step, after the window's last micro-batch).
    report = dataclasses.replace(report, module_name="(loss)", batch_number=micro.batch_number)
    data = {"reproduced": None, "verdict": "born_in_the_loss", "micro_batch": micro.batch_number, "output": label}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def not_reproduced(report: Report, window: Sequence[MicroBatch], world_size: int, *, replays_agree: bool) -> Report:
    """The detection's report, saying that replaying `window` twice gave finite numbers, everything restored, and
    what that points at: two replays that disagree, a non-deterministic computation; that agree, a transient fault."""
    batches = ", ".join(str(micro.batch_number) for micro in window)
    plural = "es" if len(window) > 1 else ""
    line = f"not reproduced: micro-batch{plural} {batches} replayed twice with everything restored ({RESTORED}) "
    if replays_agree:
        line += (
            "gave finite numbers, the same bits both times, where the run had inf/nan. A computation that repeats "
            "itself exactly but went non-finite once points at a transient fault of that run: the device (run its "
            "memory and compute checks; look for the same device failing again), or a race (another stream or "
            "thread writing these tensors while the step ran)."
        )
        cause = "transient_fault"
    else:
        line += (
            "gave finite numbers that differ from one replay to the other: the same computation gives different "
            f"numbers from run to run, which points at a non-deterministic kernel ({_pinning()})"
        )
        line += "."
        cause = "non_deterministic"
    if report.section("sentinel") is not None:
        report = _at_the_output(report)
    elif world_size > 1:  # seen only in the gradients, which the all-reduce averaged over every rank's micro-batch
        line += (
            " With several ranks, the gradients are averaged over all of them: the nan may have come from another "
            "rank's micro-batch (run with mode='full' and watch_gradients=True to see where)."
        )
    data = {"reproduced": False, "verdict": "not_reproduced", "cause": cause, "replays": 2}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def not_replayable(report: Report, changed: Sequence[str]) -> Report:
    """The detection's report, saying the micro-batch could not be run again as it ran, and what changed since."""
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    line = (
        f"not replayable: {shown} changed since the micro-batch ran (in place, by the forward itself or by the loop "
        "refilling a preallocated tensor; or another tensor put in its place), so a replay would run other "
        "values; sentinel mode keeps inputs larger than sentinel_copy_inputs allows, and most buffers, by "
        "reference. Nothing here points at the hardware. To see where inf/nan began, run with "
        "sentinel_copy_inputs='always', with mode='full', or with capture_on_detect=True and replay the file."
    )
    report = _at_the_output(report)
    data = {"reproduced": None, "verdict": "not_replayable", "changed": list(changed)}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def not_restored(report: Report, unsaved: Sequence[str]) -> Report:
    """The detection's report, saying two replays disagreed while state they depend on could not be restored."""
    line = (
        f"not replayable: two replays gave numbers that differ from each other, and {', '.join(unsaved)} could not "
        "be put back as it was when the micro-batch ran, so the replays did not run what failed. Nothing here points "
        "at the hardware. Create it before watching begins (its state is then kept with every call), or run with "
        "mode='full'."
    )
    report = _at_the_output(report)
    data = {"reproduced": None, "verdict": "not_replayable", "not_restored": list(unsaved)}
    return report.with_section(ReportSection("replay", 30, (line,), data))


def unreplayed(report: Report, line: str, **more: Any) -> Report:
    """The detection's report with why it was not replayed at all (a verdict of its own: never "not reproduced")."""
    data = {"reproduced": None, "verdict": "not_replayable", **more}
    return _at_the_output(report).with_section(ReportSection("replay", 30, (line,), data))


def _at_the_output(report: Report) -> Report:
    """A detection the sentinel saw at the model's output, unreplayed or unreproduced: no module's frame holds it, and
    a culprit drawn from the only frames recorded (a loss's) would say the loss made it from a finite output."""
    if report.section("sentinel") is None:
        return report
    culprit = report.culprit
    if culprit is not None and getattr(culprit, "kind", None) == "loss":
        # Nor the cause drawn from that culprit.
        dropped = ("culprit", "cause")
        report = dataclasses.replace(report, sections=tuple(s for s in report.sections if s.key not in dropped))
    return dataclasses.replace(report, module_name=None)


def _pinning() -> str:
    """The settings that would make the computation repeat itself, those not already set."""
    flags = determinism_flags()
    wanted = []
    if not flags["deterministic_algorithms"] or flags["warn_only"]:
        wanted.append("torch.use_deterministic_algorithms(True)")
    if torch.cuda.is_available():
        wanted.append("CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
        if not flags["cudnn_deterministic"]:
            wanted.append("torch.backends.cudnn.deterministic = True")
        if flags["cudnn_benchmark"]:
            wanted.append("torch.backends.cudnn.benchmark = False")
    if not wanted:
        return "deterministic algorithms are already on: a kernel without a deterministic variant, or a race"
    return "to pin it, set " + ", ".join(wanted)
