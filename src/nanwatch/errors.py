"""Every exception and warning nanwatch raises. The bottom layer: it imports nothing from nanwatch."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BatchLimitReached",
    "CheckpointReadError",
    "ConfigError",
    "JsonlError",
    "LossScaleBelowFloor",
    "NanwatchError",
    "NanwatchWarning",
    "NonFiniteCheckpoint",
    "NonFiniteError",
    "PlotError",
    "StepsSkippedInARow",
    "ReplayError",
    "CapsuleError",
]


class NanwatchError(Exception):
    """Base class of every error nanwatch raises on purpose."""


class NanwatchWarning(UserWarning):
    """A problem in nanwatch's own bookkeeping; the training run goes on."""


class ConfigError(NanwatchError, ValueError):
    """A config file or value is wrong; the message names the field and what was received."""


class JsonlError(NanwatchError, ValueError):
    """A JSON Lines file is not one nanwatch wrote (or not one this version reads); the message names the line."""


class ReplayError(NanwatchError, ValueError):
    """A replay file or the model it is replayed on is not usable; the message says what is wrong."""


class CapsuleError(NanwatchError, ValueError):
    """A repro capsule cannot be written or read: not a capsule, of a newer format, its module's class does not
    import, or the module cannot be saved; the message says which, in one line."""


class CheckpointReadError(NanwatchError, ValueError):
    """A file or folder given as a checkpoint cannot be read as one: not a torch or safetensors file, a folder with no
    checkpoint file, a file that `weights_only=True` refuses; the message says which, in one line."""


class PlotError(NanwatchError, ValueError):
    """A plot cannot be drawn (matplotlib missing, nothing to draw, too many rows); the message says why."""


class NonFiniteError(NanwatchError, ValueError):
    """inf or nan was found in a watched tensor.

    A subclass of `ValueError`, so code written for transformers' `DebugUnderflowOverflow` keeps catching it.

    Attributes:
        batch_number: the 0-indexed micro-batch in which inf/nan was seen.
        rank: the process that saw it first (0 when not distributed).
        module_name: the fully qualified name of the first module whose frame holds inf/nan; when no frame held any
            and only the gradients about to be applied did, the module that owns the first of them (the message then
            says so: it is where the gradient is, not where the inf/nan began).
        report: the text report (the same text that was logged and written to `report_dir`).
        optimizer_step: the optimizer step the micro-batch belongs to, when the caller knows it.
        epoch: the epoch, when the caller knows it.
        phase: "train" or "eval".
        culprit: a `nanwatch.core.features.culprit.Culprit`: the first module whose inputs and weights were finite but
            whose output was not (or where the inf/nan came in from instead), when this process saw it; None on the
            other ranks. `str()` of it is the one-line explanation that the message and the report end with.
        replay: in sentinel mode, what running the micro-batch again found: "reproduced" (the report is the one full
            mode would have written), "not_reproduced" (everything was restored and the numbers came out finite: a
            non-deterministic kernel, a race or a fault), "not_replayable" (something it needs had changed or could
            not be run again; the report says what); None in full mode and on the other ranks.
        cause: why it went non-finite, as far as a test on this detection could tell (`nanwatch.core.features.cause.
            Cause`: `kind` is "data", "precision", "compiler", "weights", "loss" or "unknown", `evidence` the line
            the report's `cause:` ends with); None on the other ranks, or where no cause was looked for.
        born_in_step: with a cause in the weights: the optimizer step whose update made them non-finite, as reports
            count steps (the `optimizer_step` a report made during that step carries); None otherwise.
        capsule: the path of the repro capsule written for this detection (`nanwatch repro CAPSULE` runs the culprit
            alone), or None when none was written (no `report_dir`, or the culprit's call could not be captured).
    """

    def __init__(
        self,
        message: str,
        *,
        batch_number: int,
        rank: int,
        module_name: str | None,
        report: str,
        optimizer_step: int | None = None,
        epoch: int | None = None,
        phase: str = "train",
        culprit: Any = None,
        replay: str | None = None,
        cause: Any = None,
        capsule: str | None = None,
    ) -> None:
        super().__init__(message)
        self.batch_number = batch_number
        self.rank = rank
        self.module_name = module_name
        self.report = report
        self.optimizer_step = optimizer_step
        self.epoch = epoch
        self.phase = phase
        self.culprit = culprit
        self.replay = replay
        self.cause = cause
        self.born_in_step: int | None = getattr(cause, "born_in_step", None)
        self.capsule = capsule

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments need help to survive pickling (multiprocessing, Lightning's spawn).
        return (_rebuild, (type(self), self.args[0], self.__dict__.copy()))


class LossScaleBelowFloor(NonFiniteError):
    """Under a `GradScaler`, the loss scale fell below `min_loss_scale`: gradients overflow however small it gets.

    A `NonFiniteError` (the scale only goes down when gradients hold inf/nan), so code catching that catches this.

    Attributes:
        loss_scale: the scale that was read.
        min_loss_scale: the floor it fell below.
        scale_history: `(batch_number, optimizer_step, scale)` for the first reading and each change since
            (the most recent 64), oldest first.
    """

    def __init__(
        self,
        message: str,
        *,
        loss_scale: float,
        min_loss_scale: float,
        scale_history: list[tuple[int, int | None, float]],
        **details: Any,
    ) -> None:
        super().__init__(message, **details)
        self.loss_scale = loss_scale
        self.min_loss_scale = min_loss_scale
        self.scale_history = scale_history


class StepsSkippedInARow(NonFiniteError):
    """`on_detect="skip"`: inf/nan again, after `max_consecutive_skips` optimizer steps skipped in a row; the run
    stops here (a `NonFiniteError`, whose report is this last detection's).

    Attributes:
        skipped: the steps skipped in a row before this one.
    """

    def __init__(self, message: str, *, skipped: int, **details: Any) -> None:
        super().__init__(message, **details)
        self.skipped = skipped


class NonFiniteCheckpoint(NanwatchError, ValueError):
    """A checkpoint holds inf/nan. One about to be written was not written under the name it was to have; one read
    back (`nanwatch.verify_checkpoint`, an adapter's resume) is refused before it is trained on.

    Attributes:
        path: where the checkpoint was to be written, or where it was read from.
        non_finite: `(where, "inf" | "nan")` for each tensor that is not finite (where: `state_dict.fc.weight`).
        quarantine_path: where it was written aside instead (`checkpoint_guard="quarantine"`), else None.
        last_good: `(path, optimizer step)` of the last checkpoint this run verified finite, the one to resume from;
            None when none was.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str,
        non_finite: list[tuple[str, str]],
        quarantine_path: str | None = None,
        last_good: tuple[str, int | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.non_finite = non_finite
        self.quarantine_path = quarantine_path
        self.last_good = last_good

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args[0], self.__dict__.copy()))


class BatchLimitReached(NanwatchError, ValueError):
    """`abort_after_batch_num` was reached: the run stops on purpose after that batch.

    Attributes:
        batch_number: the last batch that ran (0-indexed).
    """

    def __init__(self, message: str, *, batch_number: int) -> None:
        super().__init__(message)
        self.batch_number = batch_number

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args[0], self.__dict__.copy()))


def _rebuild(cls: type[Exception], message: str, state: dict[str, object]) -> Exception:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error
