"""The exceptions and warnings nanwatch raises."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanwatch.core.culprit import Culprit

__all__ = ["NanwatchError", "NanwatchWarning", "NonFiniteError", "BatchLimitReached", "LossScaleBelowFloor"]


class NanwatchError(Exception):
    """Base class of every error nanwatch raises on purpose."""


class NanwatchWarning(UserWarning):
    """A problem in nanwatch's own bookkeeping; the training run goes on."""


class NonFiniteError(NanwatchError, ValueError):
    """inf or nan was found in a watched tensor.

    A subclass of `ValueError`, so code written for transformers' `DebugUnderflowOverflow` keeps catching it.

    Attributes:
        batch_number: the 0-indexed micro-batch in which inf/nan was seen.
        rank: the process that saw it first (0 when not distributed).
        module_name: the fully qualified name of the first module whose frame holds inf/nan.
        report: the text report (the same text that was logged and written to `report_dir`).
        optimizer_step: the optimizer step the micro-batch belongs to, when the caller knows it.
        epoch: the epoch, when the caller knows it.
        phase: "train" or "eval".
        culprit: the first module whose inputs and weights were finite but whose output was not (or where the
            inf/nan came in from instead), when this process saw it; None on the other ranks. `str()` of it is the
            one-line explanation that the message and the report end with.
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
        culprit: Culprit | None = None,
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

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments need help to survive pickling (multiprocessing, Lightning's spawn).
        return (_rebuild_non_finite_error, (self.args[0], self.__dict__.copy()))


def _rebuild_non_finite_error(message: str, state: dict[str, object]) -> NonFiniteError:
    error = NonFiniteError.__new__(NonFiniteError)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


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

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_loss_scale_error, (self.args[0], self.__dict__.copy()))


def _rebuild_loss_scale_error(message: str, state: dict[str, object]) -> LossScaleBelowFloor:
    error = LossScaleBelowFloor.__new__(LossScaleBelowFloor)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class BatchLimitReached(NanwatchError, ValueError):
    """`abort_after_batch_num` was reached: the run stops on purpose after that batch.

    Attributes:
        batch_number: the last batch that ran (0-indexed).
    """

    def __init__(self, message: str, *, batch_number: int) -> None:
        super().__init__(message)
        self.batch_number = batch_number

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_batch_limit, (self.args[0], self.batch_number))


def _rebuild_batch_limit(message: str, batch_number: int) -> BatchLimitReached:
    return BatchLimitReached(message, batch_number=batch_number)
