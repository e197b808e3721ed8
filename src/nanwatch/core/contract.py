"""What an adapter may use of the engine: every member, declared once (the engine's side of `EngineContext`).

Adapters (adapters/) hold their watcher typed as `AdapterContract`, so mypy rejects a member not declared here; the
engine (core/watcher.py) implements it. A micro-batch, as an adapter tells it:

    start_batch("train")                    the forwards that follow belong to a training micro-batch
      watch_loss(loss)                      a loss computed outside the watched modules
      set_phase("eval") ... set_phase("train")   evaluation inside the open micro-batch, and back
    end_batch()                             check it (one host read); counters advance
    on_optimizer_step("before", optimizer)  check the gradients about to be applied; every rank agrees here
    on_optimizer_step("after", optimizer)   the step ran (counted unless the framework counts)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from nanwatch.core.feature_api import KEEP, EngineState, Kept, OptimizerStage, Phase, WriteAside

if TYPE_CHECKING:
    import torch

    from nanwatch.core.frames import Frame
    from nanwatch.core.readouts import GradScalerLike, LossScaleHistory, Readout, Summary
    from nanwatch.core.report import Report
    from nanwatch.core.rewinds import Restorer, Rewind, RewindPoint

__all__ = ["KEEP", "AdapterContract"]

_T = TypeVar("_T")


class AdapterContract(EngineState, Protocol):
    """The engine as an adapter sees it: what `EngineState` offers to read, and the members below."""

    # ----------------------------------------------------------------------------------------- set-up, close

    @property
    def attached(self) -> bool:
        """Whether the engine's hooks are on the model."""

    summary_sink: Callable[[Summary], None] | None
    """Where a due summary goes: the logger by default; an adapter sends it to its framework's logger, or nowhere
    (None) on ranks whose logger writes nothing."""

    def attach(self, modules: Iterable[tuple[str, torch.nn.Module]] | None = None) -> None:
        """Put a forward hook on every module (or on the given `(name, module)` pairs) that the config's scope keeps.

        Raises:
            ConfigError: an `include_modules`/`exclude_modules` pattern matches none of the modules, or together
                they leave none; no hook is added then.
        """

    def close(self, *, check: bool = True, raise_detection: bool = False) -> Report | None:
        """Stop watching: check what is still pending (no collective), remove every hook, let features sum up.

        Args:
            check: check the pending frames first, and publish a report if they hold inf/nan.
            raise_detection: then raise `NonFiniteError` for that report (on this rank).

        Returns:
            The report published at close, or None.
        """

    def outside_graph(
        self, module: torch.nn.Module, hook: Callable[..., Any], *placeholders: Any
    ) -> Callable[..., Any]:
        """An adapter's hook on `module` that a compiled graph runs outside the graph (bookkeeping only)."""

    # ------------------------------------------------------------------------------------------ the batch

    def start_batch(self, phase: Phase, *, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """A micro-batch of `phase` starts (or goes on: idempotent within a micro-batch); the forwards that follow
        belong to it. Raises when another rank stopped: this rank stops too, before its next forward."""

    def set_phase(self, phase: Phase) -> None:
        """The forwards that follow belong to `phase` ("train": counted as `batch_number`; "eval": counted apart,
        watched only with `watch_eval`), in the micro-batch already open (evaluation in the middle of a training
        micro-batch, and back)."""

    def end_batch(self, *, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """The current micro-batch is over: check it, then advance its phase's counter.

        A training detection raises at once in a single process; distributed, it is published now and raised at the
        next optimizer step, where every rank meets (with no guarded optimizer: now). An evaluation detection
        raises now (evaluation may run on some ranks only; the others stop at their next check).

        Raises:
            NonFiniteError: this rank, or another, saw inf/nan.
            BatchLimitReached: `abort_after_batch_num` was the batch that just ended.
        """

    def agreement_point(self, *, hold: bool = True) -> None:
        """Check now (before backward, say) rather than at the end of the micro-batch; a detection raises as in
        `end_batch()` (`hold=False`: at once, on every rank that meets this check)."""

    def on_optimizer_step(
        self, stage: OptimizerStage, optimizer: torch.optim.Optimizer | None = None, *, optimizer_step: Kept = KEEP
    ) -> None:
        """An optimizer step is at `stage`: "guarded" (the adapter will report "before" for each of its steps),
        "before" it applies the gradients (the recorded frames and the gradients are checked, and every rank agrees:
        a step that would apply inf/nan never runs), "after" it ran (counted), "settled" (the loss scaler decided
        the last micro-batch's step), or "settling" (the same, said from inside a hook: the scale is copied on its
        device and read at the next check, never synchronising in the hook). `optimizer_step`: the framework's own count
        of completed steps, if it keeps one.
        """

    def guards(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether some adapter already checks before each step of `optimizer`."""

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Record a loss computed outside the watched modules."""

    def watch_scaler(
        self, scaler: GradScalerLike, *, read_scale: Literal["at_batch_end", "when_settled"] = "at_batch_end"
    ) -> None:
        """Follow a `torch.amp.GradScaler`: inf/nan gradients on steps it skips are expected (core/features/
        loss_scale/). `read_scale`: when its scale is read, as each micro-batch ends or at the "settled" stage.

        Raises:
            TypeError: `scaler` is not a GradScaler.
            ValueError: `read_scale` is neither of the two.
        """

    def verify_checkpoint(
        self,
        state: Any,
        path: str,
        *,
        step: int | None = None,
        write_aside: WriteAside | None = None,
    ) -> None:
        """Before a checkpoint is written to `path`: check that every floating-point tensor of `state` (dicts,
        lists, modules, optimizers) is finite (`checkpoint_guard`), but for the inf/nan a buffer of the watched model
        held from the start (an additive attention mask); a finite one becomes the last good checkpoint, named in
        every later report. `step`: its optimizer step (the watcher's count when None). `write_aside`: how to write it
        into a folder of its own, out of the framework's way, for `checkpoint_guard="quarantine"`.

        Raises:
            NonFiniteCheckpoint: it holds inf/nan (the framework must not write it).
        """

    @property
    def skipped(self) -> list[dict[str, object]]:
        """Under `on_detect="skip"`: each micro-batch whose optimizer step was skipped, as `report_dir/skipped.jsonl`
        lists them (`batch_number`, `rank`, `optimizer_step`, `epoch`, `skipped_in_a_row`), oldest first."""

    def restore_with(self, restorer: Restorer) -> None:
        """Under `on_detect="rewind"`: how this adapter puts a certified checkpoint back into its live objects, in
        place (core/rewinds.py); nothing otherwise."""

    def note_rewind_point(self, point: RewindPoint) -> None:
        """A checkpoint verified finite (`verify_checkpoint`) is now written: under `on_detect="rewind"` the one a
        rewind restores from now on, on every rank (announced through the store); nothing otherwise."""

    @property
    def rewinds(self) -> list[Rewind]:
        """Under `on_detect="rewind"`: each rewind made, oldest first (`report_dir/rewinds.jsonl`)."""

    # ------------------------------------------------------------------------------------- counters, state

    def set_counters(self, *, optimizer_step: Kept = KEEP, epoch: Kept = KEEP) -> None:
        """The framework's counters as they are now."""

    def state_dict(self) -> dict[str, Any]:
        """The counters, for a framework's checkpoint."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the counters from a checkpoint."""

    # --------------------------------------------------------------------------------------------- reading

    def read(self, readout: Readout[Callable[[], _T]]) -> _T | None:
        """What a feature offers (core/readouts.py), or None where none does."""

    def summary(self) -> Summary | None:
        """The per-module abs max of the last training batch checked clean, or None."""

    def loss_scale_history(self) -> LossScaleHistory | None:
        """The loss scale's history under a GradScaler, or None without one."""

    def recent_frames(self) -> list[Frame]:
        """The ring's frames, then those not yet checked."""
