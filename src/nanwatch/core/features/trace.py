"""Tracing (`trace_batch_nums`): every frame of a traced batch is written out as it is recorded.

With `report_dir`, the frames go to `report_dir/nanwatch-trace-rank{R}.txt` and `.jsonl`, and the log gets one line
per traced batch saying where they went (a traced batch is hundreds of lines: on stderr they would bury everything
else). Without `report_dir`, or once a write there has failed, every frame is logged instead.

The slow path: each traced frame is read back on its own. Its tensors are still alive, so statistics that are only
measured while tracing (nan/inf counts of the lines whose abs max is inf or nan) are measured here. The engine
decides which batches are traced, and on which ranks (`trace_ranks`); this feature only writes them out.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nanwatch.core.feature_api import EngineContext, Feature, Phase
from nanwatch.core.formats.files import append_trace, append_trace_records, trace_paths
from nanwatch.core.formats.jsonl_writer import trace_records
from nanwatch.core.frames import Frame, ResolvedEntry, ResolvedFrame, counter_name, resolve
from nanwatch.core.log import warn
from nanwatch.core.report import TABLE_HEADER, format_batch_start, format_frame
from nanwatch.core.stats import registry
from nanwatch.core.walk import call_leaves

__all__ = ["TraceFeature"]


class TraceFeature(Feature):
    name = "trace"

    def __init__(self) -> None:
        self._batch: int | None = None  # the batch whose header was written
        self._frames = 0  # frames traced in it
        self._files_failed = False  # a write to report_dir failed: the trace goes on in the log only

    def on_frame(
        self, ctx: EngineContext, frame: Frame, module: torch.nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        # Each traced batch opens with its own header, consecutive ones (149 and 150) included.
        opens_batch = self._batch != frame.batch_number
        if opens_batch:
            self._batch = frame.batch_number
            self._frames = 0
        header = [format_batch_start(frame.batch_number, ctx.rank, ctx.world_size), TABLE_HEADER]
        resolved = resolve([frame])[0]
        frame_text = format_frame(resolved)
        text = "\n".join([*header, frame_text] if opens_batch else [frame_text])
        report_dir = ctx.config.report_dir
        if report_dir is None or self._files_failed:
            ctx.logger.info(text)
            self._frames += 1
            return
        try:
            append_trace(report_dir, ctx.rank, text)
            resolved = _measure_traced(resolved, module, args, output)
            records = trace_records(
                resolved,
                frame_index=self._frames,
                rank=ctx.rank,
                world_size=ctx.world_size,
                optimizer_step=ctx.counters.optimizer_step,
                epoch=ctx.counters.epoch,
            )
            append_trace_records(report_dir, ctx.rank, records)
        except (OSError, ValueError) as error:  # a full disk, a quota, a file where the folder was
            # Writing stops; watching does not: a trace file is never worth missing the inf/nan it leads to. The
            # trace goes on in the log, from this frame on, under its batch's header.
            self._files_failed = True
            message = f"nanwatch stopped writing the trace to {report_dir} (watching goes on): {error}"
            warn(message)
            ctx.logger.info("\n".join([*header, frame_text]))
        else:
            if opens_batch:
                ctx.logger.info(_where_it_went(frame, ctx.rank, ctx.world_size, *trace_paths(report_dir, ctx.rank)))
        self._frames += 1

    def on_batch_end(self, ctx: EngineContext, phase: Phase, batch_number: int) -> None:
        if phase == "eval":  # an evaluation inside a traced batch: the batch's header opens its frames again
            self._batch = None


def _where_it_went(frame: Frame, rank: int, world_size: int, text_path: Path, jsonl_path: Path) -> str:
    """The one line the log gets for a batch traced to files."""
    counter = counter_name(frame.phase)
    where = f" on rank {rank}" if world_size > 1 else ""
    return f"nanwatch: tracing {counter}={frame.batch_number}{where} to {text_path} and {jsonl_path.name} beside it"


def _measure_traced(
    resolved: ResolvedFrame, module: torch.nn.Module, args: tuple[Any, ...], output: Any
) -> ResolvedFrame:
    """The frame with the values of trace-only statistics that are not known for free, measured on its live tensors.

    A line whose tensor cannot be found again (or no longer matches) keeps null values; that includes the lines of
    frames recorded outside a forward hook (backward frames): they are traced with no inputs or output.
    """
    statistics = [(s, s.traced_kernel()) for s in registry.extras()]
    wanted = [(s, kernel) for s, kernel in statistics if kernel is not None]
    missing = [
        index
        for index, entry in enumerate(resolved.entries)
        if entry.abs_max is not None and any(s.name not in entry.stats for s, _ in wanted)
    ]
    if not missing:
        return resolved
    tensors: dict[str, torch.Tensor] = {n: p for n, p in module._parameters.items() if p is not None}
    tensors.update((label, leaf) for label, _, leaf, _ in call_leaves(args, output) if isinstance(leaf, torch.Tensor))
    launched: list[tuple[int, str, torch.Tensor]] = []
    for index in missing:
        entry = resolved.entries[index]
        tensor = tensors.get(entry.label)
        if tensor is None or not _matches(tensor, entry):
            continue
        for statistic, kernel in wanted:
            if statistic.name not in entry.stats:
                vector = kernel(tensor.detach())
                if vector is not None:
                    launched.append((index, statistic.name, vector))
    if not launched:
        return resolved
    by_name = {statistic.name: statistic for statistic, _ in wanted}
    rows = [vector.tolist() for _, _, vector in launched]  # the slow path: a few lines, a transfer each
    entries = list(resolved.entries)
    for (index, name, _), row in zip(launched, rows, strict=True):
        entry = entries[index]
        entries[index] = replace(entry, stats={**entry.stats, name: by_name[name].read(row)})
    return replace(resolved, entries=tuple(entries))


def _matches(tensor: torch.Tensor, entry: ResolvedEntry) -> bool:
    if str(tensor.dtype).replace("torch.", "") != entry.dtype:
        return False
    return entry.shape is None or (not tensor.is_nested and tuple(tensor.shape) == entry.shape)
