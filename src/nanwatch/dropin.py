"""A drop-in for transformers' `DebugUnderflowOverflow` and `detect_overflow`: change the import, nothing else.

Same signatures, same batch counting (a batch ends when the top-level module's forward returns), the same stdout
byte for byte, and `ValueError` subclasses where transformers raises `ValueError`. This path measures every tensor
as it is seen (a host sync each), like the original; `nanwatch.watch()` is the fast path.

Deliberate differences, none visible in a run transformers completes: empty, bool, float8 and meta tensors get a line
instead of crashing the hook; the frame ring stays bounded after a traced batch (transformers turns it into an
unbounded list, so a detection long after a trace prints every frame since the trace; this prints the last
`max_frames_to_save`); and the hooks can be removed with `close()` or a `with` block.
"""

from __future__ import annotations

import collections
from types import TracebackType
from typing import Any

import torch

from nanwatch.core.frames import Entry, RecordedFrame, Role, resolve
from nanwatch.core.report import MODULE_INDENT, TABLE_HEADER, format_entry, format_note_line
from nanwatch.core.stats.measure import measure
from nanwatch.core.torch_glue.hooks import HookSet
from nanwatch.errors import BatchLimitReached, NonFiniteError

__all__ = ["DebugUnderflowOverflow", "detect_overflow"]


def detect_overflow(var: torch.Tensor, ctx: str) -> bool:
    """Print `"{ctx} has nans"` / `"{ctx} has infs"` and return True if `var` holds any (as transformers does)."""
    if not isinstance(var, torch.Tensor) or var.device.type == "meta" or var.numel() == 0:
        return False
    detected = False
    if torch.isnan(var).any().item():
        detected = True
        print(f"{ctx} has nans")
    if torch.isinf(var).any().item():
        detected = True
        print(f"{ctx} has infs")
    return detected


class DebugUnderflowOverflow:
    """Forward hooks on every module of `model` that report the frames leading to the first inf/nan.

    Args:
        model: the model to debug.
        max_frames_to_save: how many frames to keep and print when inf/nan appears.
        trace_batch_nums: 0-indexed batches whose every frame is printed as it happens (detection is off in them).
        abort_after_batch_num: raise once this batch has finished.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_frames_to_save: int = 21,
        trace_batch_nums: list[int] | None = None,
        abort_after_batch_num: int | None = None,
    ) -> None:
        self.model = model
        self.trace_batch_nums = [] if trace_batch_nums is None else trace_batch_nums
        self.abort_after_batch_num = abort_after_batch_num
        self.frames: collections.deque[str] = collections.deque([], max_frames_to_save)
        self.frame: list[str] = []
        self.batch_number = 0
        self.total_calls = 0
        self.detected_overflow = False
        self.prefix = MODULE_INDENT
        self.module_names = {module: name for name, module in model.named_modules()}
        self._hooks = HookSet()
        # model.apply, like transformers: a module shared under two parents gets two hooks, and two frames per call.
        model.apply(lambda module: self._hooks.add_forward(module, self.forward_hook))

    # ------------------------------------------------------------------------------------------ frame text

    def save_frame(self, frame: str | None = None) -> None:
        if frame is not None:
            self.expand_frame(frame)
        self.frames.append("\n".join(self.frame))
        self.frame = []

    def expand_frame(self, line: str) -> None:
        self.frame.append(line)

    def trace_frames(self) -> None:
        print("\n".join(self.frames))
        self.frames.clear()

    def reset_saved_frames(self) -> None:
        self.frames.clear()

    def dump_saved_frames(self) -> None:
        print(f"\nDetected inf/nan during batch_number={self.batch_number}")
        print(f"Last {len(self.frames)} forward frames:")
        print(TABLE_HEADER)
        print("\n".join(self.frames))
        print("\n\n")
        self.frames.clear()

    def analyse_variable(self, var: Any, ctx: str) -> None:
        if isinstance(var, torch.Tensor):
            # One tensor at a time, as transformers does: its role does not matter to the line printed.
            entry = resolve([RecordedFrame("", "", 0, entries=[Entry(ctx, Role.OUTPUT, measure(var))])])[0].entries[0]
            self.expand_frame(format_entry(entry))
            if detect_overflow(var, ctx):
                self.detected_overflow = True
        elif var is None:
            self.expand_frame(format_note_line("None", ctx))
        else:
            self.expand_frame(format_note_line("not a tensor", ctx))

    def batch_start_frame(self) -> None:
        self.expand_frame(f"\n\n{self.prefix} *** Starting batch number={self.batch_number} ***")
        self.expand_frame(TABLE_HEADER)

    def create_frame(self, module: torch.nn.Module, input: Any, output: Any) -> None:
        self.expand_frame(f"{self.prefix} {self.module_names[module]} {module.__class__.__name__}")
        for name, param in module.named_parameters(recurse=False):
            self.analyse_variable(param, name)
        if isinstance(input, tuple):
            for i, x in enumerate(input):
                self.analyse_variable(x, f"input[{i}]")
        else:
            self.analyse_variable(input, "input")
        if isinstance(output, tuple):
            for i, x in enumerate(output):
                if isinstance(x, tuple):
                    for j, y in enumerate(x):
                        self.analyse_variable(y, f"output[{i}][{j}]")
                else:
                    self.analyse_variable(x, f"output[{i}]")
        else:
            self.analyse_variable(output, "output")
        self.save_frame()

    # ------------------------------------------------------------------------------------------------ hook

    def forward_hook(self, module: torch.nn.Module, input: Any, output: Any) -> None:
        last_frame_of_batch = False
        trace_mode = self.batch_number in self.trace_batch_nums
        if trace_mode:
            self.reset_saved_frames()
        if self.total_calls == 0:
            self.batch_start_frame()
        self.total_calls += 1
        # The top-level module's hook fires last, when its forward returns: that is the end of a batch.
        if module is self.model:
            self.batch_number += 1
            last_frame_of_batch = True
        self.create_frame(module, input, output)
        if trace_mode:
            self.trace_frames()
        if last_frame_of_batch:
            self.batch_start_frame()
        if self.detected_overflow and not trace_mode:
            self.dump_saved_frames()
            raise NonFiniteError(
                "DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
                "Please scroll up above this traceback to see the activation values prior to this event.",
                # The printed header keeps transformers' count, which the root's own frame has already advanced.
                batch_number=self.batch_number - 1 if last_frame_of_batch else self.batch_number,
                rank=0,
                module_name=self.module_names.get(module),
                report="",
            )
        if self.abort_after_batch_num is not None and self.batch_number > self.abort_after_batch_num:
            raise BatchLimitReached(
                f"DebugUnderflowOverflow: aborting after {self.batch_number} batches due to"
                f" `abort_after_batch_num={self.abort_after_batch_num}` arg",
                batch_number=self.batch_number - 1,
            )

    # ---------------------------------------------------------------------------------------- extras

    def close(self) -> None:
        """Remove every hook (transformers' class cannot)."""
        self._hooks.remove_all()

    def __enter__(self) -> DebugUnderflowOverflow:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
