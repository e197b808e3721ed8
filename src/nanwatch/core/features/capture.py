"""Capture what replaying a failing forward needs (`capture_on_detect=True`).

A forward pre-hook on the root module copies, as each top-level forward begins, its inputs (args and kwargs), the
RNG states and every parameter and buffer. Only the latest copy is kept (the weight copies are reused, so steady
state allocates nothing new for them). Nothing is written until a detection is published: then the copy, labelled
with the batch it belongs to, goes to `report_dir/replay-rank{R}-batch{N}.pt` (core/formats/replay_file.py), next to
the report. `nanwatch replay` reads it back.

The copies are real copies (`detach().clone()`, then `copy_` into them): the optimizer changes the weights in place
between the forward and the check that finds the inf/nan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from nanwatch.core.feature_api import EngineContext, Feature
from nanwatch.core.formats.replay_file import replay_file_name, save_replay_file
from nanwatch.core.frames import counter_name
from nanwatch.core.report import Report
from nanwatch.core.runstate import autocast_state, capture_rng_states, determinism_flags

__all__ = ["ReplayCapture"]


def _clone_tree(value: Any) -> Any:
    """Copy every tensor in nested tuples, lists and dicts; other values are kept as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        items = [_clone_tree(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_clone_tree(item) for item in value]
    if isinstance(value, dict):
        return {key: _clone_tree(item) for key, item in value.items()}
    return value


def _copy_into(previous: dict[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Copy each tensor into last time's copy when it still fits (no allocation), else into a new one."""
    copies = {}
    for name, tensor in named:
        data = tensor.detach()
        old = previous.get(name)
        if old is not None and old.shape == data.shape and old.dtype == data.dtype and old.device == data.device:
            old.copy_(data)
            copies[name] = old
        else:
            copies[name] = data.clone()
    return copies


def _qualified_class_name(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


class ReplayCapture(Feature):
    """Keeps a copy of what the latest top-level forward started from; saves it when a detection is published."""

    name = "capture"

    def __init__(self) -> None:
        self._ctx: EngineContext | None = None
        self._parameters: dict[str, torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}
        self._rng: dict[str, Any] = {}
        self._training_modes: dict[str, bool] = {}
        self._autocast: dict[str, str] = {}
        self._grad_enabled = True
        self._num_threads = 1
        self._determinism: dict[str, bool] = {}
        self._device = "cpu"
        # (phase, batch) of the forward the copy belongs to; set when that forward returns, so a forward that
        # raised, or one whose phase the adapter decided late, is never mistaken for the one a report is about.
        self._label: tuple[str, int] | None = None
        self._taking = False
        self._failed: str | None = None

    def attach(self, ctx: EngineContext, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        """Register the root's pre-hook (copy) and forward hook (label); the engine's HookSet removes them."""
        self._ctx = ctx
        ctx.hooks.add_handle(ctx.model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        ctx.hooks.add_handle(ctx.model.register_forward_hook(self._after_forward))

    def close(self, ctx: EngineContext) -> None:
        self._release()

    @property
    def label(self) -> tuple[str, int] | None:
        """`(phase, batch_number)` of the forward held, or None when none completed since the last copy."""
        return self._label

    # ---------------------------------------------------------------------------------------------- copying

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ctx = self._ctx
        if ctx is None or self._failed is not None or ctx.disabled_reason is not None:
            return
        # An eval-mode forward is only checked with watch_eval; copying it would also overwrite the training copy.
        if not module.training and not ctx.config.watch_eval:
            return
        # An unwatched training batch records nothing, so nothing in it can be reported or replayed: no copy.
        if module.training and not ctx.watches_batch(ctx.counters.batch_number):
            return
        try:
            self._take(module, args, kwargs)
        except Exception as error:  # a capture problem must never kill a healthy run
            self._fail(ctx, f"copying the forward's inputs and weights failed: {error!r}")

    def _take(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._label = None
        self._taking = True
        with torch.no_grad():
            self._parameters = _copy_into(self._parameters, module.named_parameters())
            self._buffers = _copy_into(self._buffers, module.named_buffers())
            self._args = _clone_tree(tuple(args))
            self._kwargs = _clone_tree(dict(kwargs))
        self._rng = capture_rng_states()
        self._training_modes = {name: sub.training for name, sub in module.named_modules()}
        self._autocast = autocast_state()
        self._grad_enabled = torch.is_grad_enabled()
        self._num_threads = torch.get_num_threads()
        self._determinism = determinism_flags()
        first = next(iter(self._parameters.values()), None)
        self._device = str(first.device) if first is not None else "cpu"

    def _after_forward(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._taking and self._ctx is not None:
            self._taking = False
            self._label = (self._ctx.counters.phase, self._ctx.counters.current_batch)

    def _release(self) -> None:
        # The RNG states too: the CPU generator's alone is a 5,056-byte tensor. What a user keeps of a detection is
        # on disk by now (the replay file is written as the detection is published).
        self._label = None
        self._parameters, self._buffers, self._args, self._kwargs, self._rng = {}, {}, (), {}, {}

    def _fail(self, ctx: EngineContext, reason: str) -> None:
        self._failed = reason
        self._release()
        # Logged, not warned: tests turn NanwatchWarning into errors, and a capture problem is not the run's.
        ctx.logger.warning(f"nanwatch stopped capturing forwards for replay (the run goes on): {reason}")

    # ----------------------------------------------------------------------------------------------- saving

    def on_publish(self, ctx: EngineContext, report: Report) -> None:
        self.save(ctx, report)

    def save(self, ctx: EngineContext, report: Report) -> Path | None:
        """Write the copy of the forward `report` is about to `report_dir`; return its path, or None if there is none.

        Never raises: a replay file that cannot be written is logged, and the detection goes on to be raised.
        """
        report_dir = ctx.config.report_dir
        counter = counter_name(report.phase)
        if report_dir is None:
            return None
        if self._failed is not None:
            ctx.logger.warning(f"nanwatch saved no replay of {counter}={report.batch_number}: {self._failed}")
            return None
        if self._label != (report.phase, report.batch_number):
            held = "" if self._label is None else f" (the copy held is of {self._label[0]} batch {self._label[1]})"
            ctx.logger.warning(
                f"nanwatch saved no replay of {counter}={report.batch_number}: no forward of the watched model ran "
                f"to its end in that batch{held}"
            )
            return None
        path = Path(report_dir) / replay_file_name(report.rank, report.batch_number, report.phase)
        try:
            save_replay_file(self._payload(ctx, report), path)
        except Exception as error:
            ctx.logger.warning(f"nanwatch could not write the replay file {str(path)!r}: {error!r}")
            return None
        ctx.logger.info(
            f"nanwatch saved the failing forward to {path}\n"
            f"  replay it with: nanwatch replay {path} --model PACKAGE.MODULE:FACTORY"
        )
        return path

    def _payload(self, ctx: EngineContext, report: Report) -> dict[str, Any]:
        return {
            "torch_version": str(torch.__version__),
            "batch_number": report.batch_number,
            "phase": report.phase,
            "rank": report.rank,
            "world_size": report.world_size,
            "optimizer_step": report.optimizer_step,
            "epoch": report.epoch,
            "model_class": _qualified_class_name(ctx.model),
            "layout": {
                "parameters": {name: _describe(t) for name, t in self._parameters.items()},
                "buffers": {name: _describe(t) for name, t in self._buffers.items()},
            },
            "parameters": self._parameters,
            "buffers": self._buffers,
            "args": self._args,
            "kwargs": self._kwargs,
            "rng": self._rng,
            "training_modes": self._training_modes,
            "autocast": self._autocast,
            "grad_enabled": self._grad_enabled,
            "num_threads": self._num_threads,
            "determinism": self._determinism,
            "device": self._device,
            "config": ctx.config.model_dump(mode="json"),
            "report": report.to_dict(),
        }


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}
