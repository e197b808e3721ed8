"""Where a summary goes (`summary_every_n_batches`): into a framework's own logging where it has one, on the process
that logs there; otherwise to the "nanwatch" logger (the watcher's default sink). Duck-typed: no framework imported."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from nanwatch.core.contract import AdapterContract
from nanwatch.core.readouts import Summary

__all__ = ["Sink", "to_loggers", "to_trackers", "HeldForLog"]

Sink = Callable[[Summary], None]  # a watcher's `summary_sink`


def to_loggers(trainer: Any) -> Sink:
    """Lightning: straight to `trainer.loggers` at its global step, at the interval nanwatch was given (`log_dict`
    would also apply `log_every_n_steps`)."""

    def send(summary: Summary) -> None:
        metrics = summary.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    return send


def to_trackers(accelerator: Any, watcher: AdapterContract, tracker: object) -> Sink:
    """Accelerate, whose trackers log on the main process only (the other ranks have no sink: they never read a
    summary back, and there is no collective here): to the trackers other than `tracker` through
    `accelerator.log`, at the optimizer steps done so far (`tracker`'s own log() ignores it); to the "nanwatch" logger
    when there are none (asked at each summary, not once at attach)."""

    def send(summary: Summary) -> None:
        if not any(other is not tracker for other in accelerator.trackers):
            watcher.logger.info(summary.to_text())
            return
        step = watcher.optimizer_step if watcher.optimizer_step is not None else watcher.batch_number
        accelerator.log(summary.metrics(), step=step)

    return send


class HeldForLog:
    """The HF Trainer: a summary, due on every rank alike, waits for the Trainer's next log event. Every rank asks the
    Trainer to log then (`due`): its logging gathers the loss across ranks, and asking on one rank only would leave
    the others out of that collective."""

    def __init__(self) -> None:
        self._metrics: dict[str, float] | None = None

    def hold(self, summary: Summary) -> None:
        """The watcher's sink: keep the summary's metrics until `put_into`."""
        self._metrics = summary.metrics()

    @property
    def due(self) -> bool:
        return self._metrics is not None

    def put_into(self, logs: MutableMapping[str, Any] | None, log_history: list[dict[str, Any]], step: int) -> None:
        """Into the Trainer's `logs` (what the callbacks after this one receive), and into the copy of them that
        `Trainer.log()` appended to `log_history` just before calling `on_log` (when it is this `step`'s)."""
        metrics = self._metrics
        if metrics is None or logs is None:
            return
        self._metrics = None
        logs.update(metrics)
        if log_history and log_history[-1].get("step") == step:
            log_history[-1].update(metrics)
