"""`nanwatch plot FILE -o heatmap.png`: abs max per module (rows) per batch (columns), the dtype's max marked.

Each cell is the largest abs max over the module's floating-point lines in that batch (its parameters, inputs and
outputs, every call of it): the picture of how close each module comes to its dtype's limit, batch after batch.
Integer tensors (token ids, masks) are left out, as their values are not magnitudes. inf and nan cells get colours
of their own, a module that did not run in a batch is left grey, and an abs max of exactly 0 is drawn white.
Finite cells above the marked dtype's max (a float32 run judged against float16 with `--dtype float16`) are
outlined in red: they would overflow in that dtype. With a headroom fraction, cells at or above that fraction of
the marked max (where nanwatch warns while watching) are outlined in orange, and the fraction is marked on the bar.

Forward values and gradients are drawn apart: `--direction forward` (the default) draws what the modules' forwards
saw (a forward that activation checkpointing ran again included), `--direction backward` the gradients recorded with
`watch_gradients` (`grad weight`, `grad output`, `grad input[0]`, ...), each against the tightest dtype of the values
drawn, and the picture says which it shows. A file that also holds lines of the other direction gets a note on
stderr saying how to draw them.

Rows are in model order (the order of `print(model)`: a module above its children, siblings in the order they ran),
rebuilt from the records' return order (the forward's, also for the gradients), also for a report whose frames begin
in the middle of a batch.

The colour scale is log10(abs max). Where the marked dtype is a narrow one (float16, bfloat16, float8), the scale is
fixed by that dtype: from its smallest normal number to its max, so two runs in that dtype get the same colours and
a healthy run sits in the middle; for wider dtypes it spans the file's own numbers. `--vmin` / `--vmax` set it by
hand (abs max values, e.g. `--vmin 1e-3 --vmax 1e5`) to compare any two runs; cells beyond it take the end colours.

`--kind lines` draws the other picture people ask for: the abs max of the modules that came closest to the dtype's
max, one line each over the batches, with that max drawn across (`plot_lines.py`).

The image format follows `-o`'s extension (png, pdf, svg) or `--format`; `-o -` writes the image to stdout.

With a config (`--config FILE` or the options generated from `WatchConfig`), `include_modules` / `exclude_modules`
choose the rows, `target_dtype` joins the candidates for the marked max, and `headroom_warn_fraction` (when set)
draws the headroom outlines.

matplotlib is imported only here, when a plot is drawn (`pip install "nanwatch[plot]"`).

Exit status: 0, or 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from nanwatch.cli import COMMANDS
from nanwatch.cli._plot_common import (
    _WHAT,
    DIRECTIONS,
    FORMATS,
    HEADROOM_COLOUR,
    INF_COLOUR,
    MISSING_COLOUR,
    NAN_COLOUR,
    SMALLEST_NORMAL,
    ZERO_COLOUR,
    Heatmap,
    PlotResult,
    dtype_max,
    image_format,
    matplotlib_or_error,
    save_figure,
)
from nanwatch.cli.inputs import read_jsonl_blocks
from nanwatch.cli.options import ToolHelpFormatter, add_config_arguments, fields_epilog, tool_config
from nanwatch.cli.show import chosen_modules, restrict
from nanwatch.cli.usage import CliError
from nanwatch.cli.validators import ABS_MAX, POSITIVE_INT
from nanwatch.core.formats.jsonl_reader import Block
from nanwatch.core.frames import Direction
from nanwatch.errors import PlotError

__all__ = [
    "register",
    "Heatmap",
    "PlotResult",
    "PlotError",
    "FORMATS",
    "SMALLEST_NORMAL",
    "build_heatmap",
    "draw_heatmap",
    "figure_size",
    "dtype_max",
    "marked_dtype",
    "model_order",
    "return_order",
    "image_format",
    "colour_scale",
    "USED_FIELDS",
    "DIRECTIONS",
]

ROOT_LABEL = "(root)"
MAX_ROWS = 600  # at 0.2 inch a row, more would make an image no viewer opens comfortably: use --depth
# The records' directions each of `DIRECTIONS` draws.
_DRAWN = {
    "forward": frozenset((Direction.FORWARD, Direction.RECOMPUTE)),
    "backward": frozenset((Direction.BACKWARD,)),
}
# A dtype's max is put on a data-relative scale when it lies at most this many decades above the largest value
# drawn; further up (float32's 3.4e38 for a model whose numbers stay near 1) it would squash every colour into one.
_MAX_DECADES_TO_DTYPE_MAX = 12.0
_ROW_INCH = 0.2
_CHAR_INCH = 0.062  # about one character of 8-point text
_TOP_INCH, _BOTTOM_INCH, _RIGHT_INCH = 0.6, 0.8, 1.8

# The WatchConfig fields `nanwatch plot` applies, and what each does here (printed by --help).
USED_FIELDS = {
    "include_modules": "only modules matching one of these globs get a row (as when watching: `*` crosses dots, the "
    "root is ''; matched before --depth gathers names); a pattern that matches no module in FILE is an error",
    "exclude_modules": "modules matching one of these globs get no row",
    "target_dtype": "the marked max is the tightest of FILE's dtypes and this one, so a float32 run judged as "
    "float16 has float16's max marked and the cells above it outlined in red (--dtype, when given, is marked instead)",
    "headroom_warn_fraction": "cells at or above this fraction of the marked max, where nanwatch warns while "
    "watching, are outlined in orange and the fraction is marked on the colour bar; null or 0: off",
}


def _is_float(dtype: str | None) -> bool:
    return dtype is not None and "float" in dtype  # float16, bfloat16, float32, float8_e4m3fn, ...


def _merge(current: float | None, value: float) -> float:
    # nan wins over inf, inf over any number: the cell says the worst thing any of its lines said.
    if current is None:
        return value
    if math.isnan(current) or math.isnan(value):
        return math.nan
    return max(current, value)


def _row_name(module: str, depth: int | None) -> str:
    if not module:
        return ROOT_LABEL
    return ".".join(module.split(".")[:depth]) if depth is not None else module


def build_heatmap(blocks: Sequence[Block], *, depth: int | None = None, direction: str = "forward") -> Heatmap:
    """Reduce records to one number per (module, batch): the max over the module's float lines of one direction.

    Args:
        blocks: traced batches (or reports) read from a .jsonl file; a batch held twice keeps its last block.
        depth: gather modules by the first `depth` parts of their names (`transformer.h.0` for depth 3).
        direction: "forward": the values the forwards saw; "backward": the gradients (`watch_gradients`).

    Raises:
        PlotError: `direction` is not one of `DIRECTIONS`, or no floating-point line of it holds a number.
    """
    if direction not in _DRAWN:
        raise PlotError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    drawn = _DRAWN[direction]
    by_batch: dict[int, dict[str, float]] = {}
    segments: list[tuple[list[str], bool]] = []  # each batch's names in return order, and whether it is cut at start
    forward_segments: list[tuple[list[str], bool]] = []  # the same for the forward alone: the model order
    dtypes: set[str] = set()
    left_out = 0
    for block in blocks:
        seen: dict[int, dict[str, float]] = {}
        order: dict[int, dict[str, None]] = {}
        forward_order: dict[int, dict[str, None]] = {}
        for record in block.records:
            if record.abs_max is None or not _is_float(record.dtype):
                continue
            assert record.dtype is not None
            name = _row_name(record.module, depth)
            if record.direction is Direction.FORWARD:
                forward_order.setdefault(record.batch, {}).setdefault(name, None)
            if record.direction not in drawn:
                left_out += 1
                continue
            order.setdefault(record.batch, {}).setdefault(name, None)
            dtypes.add(record.dtype)
            batch_cells = seen.setdefault(record.batch, {})
            batch_cells[name] = _merge(batch_cells.get(name), float(record.abs_max))
        by_batch.update(seen)  # a later block of the same batch (a reused report_dir) replaces the earlier one
        # A report's frames may begin in the middle of the batch before the detection: that batch's frames are the
        # end of a forward, the others begin at its start.
        for found, into in ((order, segments), (forward_order, forward_segments)):
            cut_first = block.kind == "report" and len(found) > 1
            for index, batch_names in enumerate(found.values()):
                into.append((list(batch_names), cut_first and index == 0))
    if not by_batch:
        if left_out and direction == "forward":
            raise PlotError(
                "nothing to plot in the forward direction: every number in the file is a gradient (--direction "
                "backward draws them)"
            )
        if direction == "backward":
            raise PlotError(
                "nothing to plot in the backward direction: the file holds no gradient line (they are recorded "
                "with watch_gradients=True)"
            )
        raise PlotError("nothing to plot: no floating-point tensor line holds a number")
    batches = sorted(by_batch)
    places = return_order(segments)
    # Rows in model order, as the forward ran (a backward runs the other way round), when it saw every row drawn.
    names = model_order(forward_segments)
    if not set(places) <= set(names):
        names = model_order(segments)
    names = [name for name in names if name in places]
    cells = [[by_batch[batch].get(name) for batch in batches] for name in names]
    return Heatmap(names, batches, cells, sorted(dtypes), [places[name] for name in names], direction, left_out)


def return_order(segments: Sequence[tuple[Sequence[str], bool]]) -> dict[str, float]:
    """Each name's place in the order the calls of one forward return, from the batches' records.

    Args:
        segments: each batch's names in the order they first returned, and whether the batch is cut at its start
            (the first batch of a report: its names are the end of a forward, so they go after any name it lacks).
    """
    everything = list(dict.fromkeys(name for names, _ in segments for name in names))
    size = len(everything)
    from_start: dict[str, int] = {}  # a name's place counted from the start of a batch: the surer one
    from_end: dict[str, int] = {}  # counted back from the end of a forward, for a batch cut at its start
    for names, cut_at_start in segments:
        for index, name in enumerate(names):
            places, place = (from_end, size - len(names) + index) if cut_at_start else (from_start, index)
            places[name] = min(places.get(name, place), place)
    return {name: from_start.get(name, from_end.get(name, size)) for name in everything}


def model_order(segments: Sequence[tuple[Sequence[str], bool]]) -> list[str]:
    """Module names in model order (as `print(model)`: a module above its children, siblings in the order they ran),
    from the order in which their calls returned (see `return_order` for `segments`).

    Returns:
        Every name once, `ROOT_LABEL` first when present.
    """
    position = return_order(segments)
    everything = list(position)
    size = len(everything)
    # Each name's key is the earliest place in its subtree: a module's children return before it, and siblings in
    # the order they were called, so sorting siblings by that key puts them in call order.
    tree: dict[str, list[str]] = {}
    key: dict[str, float] = {}
    first_seen = {name: index for index, name in enumerate(everything)}
    for name in everything:
        parts = [] if name == ROOT_LABEL else name.split(".")
        for depth in range(len(parts) + 1):
            node = ".".join(parts[:depth]) if depth else ROOT_LABEL
            key[node] = min(key.get(node, math.inf), position[name])
            if depth:
                parent = ".".join(parts[: depth - 1]) if depth > 1 else ROOT_LABEL
                children = tree.setdefault(parent, [])
                if node not in children:
                    children.append(node)
    ordered: list[str] = []
    present = set(everything)
    stack = [ROOT_LABEL]
    while stack:
        node = stack.pop()
        if node in present:
            ordered.append(node)
        children = sorted(tree.get(node, []), key=lambda child: (key[child], first_seen.get(child, size)))
        stack.extend(reversed(children))
    return ordered


def marked_dtype(heatmap: Heatmap, target_dtype: str | None = None) -> str:
    """The dtype whose max a plot marks: the tightest of the dtypes drawn and `target_dtype` (when given).

    Raises:
        PlotError: `target_dtype` is not a floating-point dtype.
    """
    candidates = [*heatmap.dtypes, *([target_dtype] if target_dtype is not None else [])]
    return min(candidates, key=dtype_max)


def colour_scale(
    positive_logs: Sequence[float], dtype: str, *, vmin: float | None = None, vmax: float | None = None
) -> tuple[float, float, bool]:
    """The colour scale (low, high, in log10 units) and whether the dtype's max lies on it.

    By hand with `vmin` / `vmax` (abs max values); else, for a narrow dtype (`SMALLEST_NORMAL`), from its smallest
    normal to its max, the same for every run in it; else around the numbers drawn, reaching up to the dtype's max
    when that is within `_MAX_DECADES_TO_DTYPE_MAX` decades of them.

    Raises:
        PlotError: `vmin` or `vmax` is not a finite number > 0, or `vmin` is not below `vmax`.
    """
    for name, value in (("vmin", vmin), ("vmax", vmax)):
        if value is not None and not 0 < value < math.inf:
            raise PlotError(f"--{name} must be a finite abs max > 0, got {value!r}")
    if vmin is not None and vmax is not None and not vmin < vmax:
        raise PlotError(f"--vmin must be below --vmax, got {vmin:g} and {vmax:g}")
    limit_log = math.log10(dtype_max(dtype))
    if dtype in SMALLEST_NORMAL:
        low = math.log10(SMALLEST_NORMAL[dtype])
        high = limit_log + 0.04 * (limit_log - low)  # a little room above, so the mark is not lost on the bar's edge
    else:
        low = min(positive_logs) if positive_logs else limit_log - 1
        high = max(positive_logs) if positive_logs else limit_log
        if limit_log - high <= _MAX_DECADES_TO_DTYPE_MAX and high <= limit_log:
            high = limit_log + 0.04 * (limit_log - low)
        if high - low < 1:
            low, high = low - 0.5, high + 0.5
    if vmin is not None:
        low = math.log10(vmin)
    if vmax is not None:
        high = math.log10(vmax)
    if not low < high:  # one end given beyond the other's default
        low, high = (high - 1, high) if vmax is not None else (low, low + 1)
    return low, high, low <= limit_log <= high


def figure_size(heatmap: Heatmap) -> tuple[float, float, float, float]:
    """(width, height, left margin, plot width) in inches: the picture grows with the rows, columns and names."""
    columns = len(heatmap.batches)
    plot_width = min(max(2.5, columns * 0.45), max(9.0, columns * 0.06))
    left = 0.3 + _CHAR_INCH * max(len(name) for name in heatmap.rows)
    plot_height = max(1.2, len(heatmap.rows) * _ROW_INCH)
    return left + plot_width + _RIGHT_INCH, _TOP_INCH + plot_height + _BOTTOM_INCH, left, plot_width


def draw_heatmap(
    heatmap: Heatmap,
    output: str | Path | IO[bytes],
    *,
    dtype: str | None = None,
    title: str | None = None,
    dpi: int = 100,
    headroom_fraction: float | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    fmt: str | None = None,
) -> PlotResult:
    """Draw `heatmap` to an image file (or a binary stream).

    Args:
        heatmap: from `build_heatmap`.
        output: the image file to write, or a binary stream.
        dtype: whose max to mark; by default the tightest of the dtypes drawn (float16 in a mixed-precision run).
        title: the first line of the title.
        dpi: pixels per inch.
        headroom_fraction: outline in orange the finite cells at or above this fraction of the marked max (and at
            most the max), and mark the fraction on the colour bar; None: no headroom marks.
        vmin: the abs max at the bottom of the colour scale (default: see `colour_scale`).
        vmax: the abs max at its top.
        fmt: the image format (`FORMATS`); default: from `output`'s extension (png for a stream).

    Returns:
        The image's size, where its cells are, and its colour scale.

    Raises:
        PlotError: matplotlib is not installed, `dtype` is not a floating-point dtype, `headroom_fraction` is not
            in (0, 1], or `vmin` / `vmax` are not a scale.
        CliError: the format is not one of `FORMATS`.
    """
    if headroom_fraction is not None and not 0 < headroom_fraction <= 1:
        raise PlotError(f"headroom_fraction must be in (0, 1], got {headroom_fraction!r}")
    fmt = fmt if fmt is not None else image_format(output if isinstance(output, str | Path) else "-")
    matplotlib_or_error()
    import numpy as np
    from matplotlib import colormaps, colors
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    marked = dtype if dtype is not None else marked_dtype(heatmap)
    limit = dtype_max(marked)
    limit_log = math.log10(limit)
    headroom = headroom_fraction * limit if headroom_fraction is not None else None

    values = np.array([[math.nan if v is None else v for v in row] for row in heatmap.cells], dtype=float)
    missing = np.array([[v is None for v in row] for row in heatmap.cells])
    is_nan = np.isnan(values) & ~missing
    is_inf = np.isinf(values)
    zero = values == 0
    positive = np.isfinite(values) & (values > 0)
    logs = np.full(values.shape, np.nan)
    logs[positive] = np.log10(values[positive])
    low, high, on_scale = colour_scale([float(v) for v in logs[positive]], marked, vmin=vmin, vmax=vmax)

    width, height, left, plot_width = figure_size(heatmap)
    figure = Figure(figsize=(width, height), dpi=dpi)
    canvas = FigureCanvasAgg(figure)
    plot_height = height - _TOP_INCH - _BOTTOM_INCH
    axes = figure.add_axes((left / width, _BOTTOM_INCH / height, plot_width / width, plot_height / height))
    axes.set_facecolor(MISSING_COLOUR)
    viridis = colormaps["viridis"]
    # Beyond the scale, a cell takes the colour of the scale's end (the bar's arrows say so).
    colour_map = viridis.with_extremes(under=viridis(0.0), over=viridis(1.0))
    image = axes.imshow(
        np.ma.masked_invalid(logs),
        cmap=colour_map,
        norm=colors.Normalize(vmin=low, vmax=high),
        aspect="auto",
        interpolation="nearest",
    )
    for mask, colour in ((is_inf, INF_COLOUR), (is_nan, NAN_COLOUR), (zero, ZERO_COLOUR)):
        if mask.any():
            axes.imshow(
                np.ma.masked_where(~mask, np.ones(values.shape)),
                cmap=colors.ListedColormap([colour]),
                aspect="auto",
                interpolation="nearest",
            )

    # Finite cells above the marked max (a float32 run judged against float16) get a red outline: they would overflow.
    above = np.isfinite(values) & (values > limit)
    if above.any():
        # Drawn a little inside each cell and above the white grid lines, so neighbours' outlines stay apart.
        outlines = [Rectangle((c - 0.42, r - 0.42), 0.84, 0.84) for r, c in zip(*np.nonzero(above), strict=True)]
        axes.add_collection(PatchCollection(outlines, facecolor="none", edgecolor=INF_COLOUR, linewidth=1.5, zorder=3))
    # Cells within the headroom (where watching would warn) but not above the max get an orange outline.
    near = np.isfinite(values) & (values >= headroom) & (values <= limit) if headroom is not None else None
    if near is not None and near.any():
        outlines = [Rectangle((c - 0.42, r - 0.42), 0.84, 0.84) for r, c in zip(*np.nonzero(near), strict=True)]
        axes.add_collection(
            PatchCollection(outlines, facecolor="none", edgecolor=HEADROOM_COLOUR, linewidth=1.5, zorder=3)
        )

    rows, columns = len(heatmap.rows), len(heatmap.batches)
    axes.set_yticks(range(rows), heatmap.rows, fontsize=8)
    step = max(1, math.ceil(columns / 30))
    axes.set_xticks(range(0, columns, step), [str(b) for b in heatmap.batches[::step]], fontsize=8)
    axes.set_xlabel("batch", fontsize=9)
    axes.set_xticks([x - 0.5 for x in range(1, columns)], minor=True)
    axes.set_yticks([y - 0.5 for y in range(1, rows)], minor=True)
    axes.grid(which="minor", color="white", linewidth=0.6)
    axes.tick_params(which="minor", length=0)

    bar_axes = figure.add_axes(
        ((left + plot_width + 0.85) / width, _BOTTOM_INCH / height, 0.18 / width, plot_height / height)
    )
    below_scale = bool((logs[positive] < low).any())
    above_scale = bool((logs[positive] > high).any())
    extend = {(True, True): "both", (True, False): "min", (False, True): "max"}.get((below_scale, above_scale))
    bar = figure.colorbar(image, cax=bar_axes, extend=extend or "neither")
    fixed = marked in SMALLEST_NORMAL and vmin is None and vmax is None
    bar.set_label(f"log10(abs max)\n{marked}'s normal range" if fixed else "log10(abs max)", fontsize=9)
    bar.ax.tick_params(labelsize=8)
    if on_scale:
        bar_axes.axhline(limit_log, color=INF_COLOUR, linewidth=2.5)
        bar_axes.annotate(
            f"{marked} max\n{limit:.6g}\n(log10 {limit_log:.2f})",
            xy=(0, limit_log),
            xycoords=("axes fraction", "data"),
            xytext=(-5, 0),
            textcoords="offset points",
            ha="right",
            va="top",  # below the mark, which often sits at the top of the bar
            fontsize=7,
            color=INF_COLOUR,
        )
    if headroom is not None and low <= math.log10(headroom) <= high:
        # No text beside it: it would overlap the max's; the legend names it.
        bar_axes.axhline(math.log10(headroom), color=HEADROOM_COLOUR, linewidth=2.0, linestyle="--")

    what, lines = _WHAT[heatmap.direction]
    first_line = title or f"log10(abs max) per module and batch: {what}"
    second = f"{what}; cell: max over {lines}; {rows} modules, {columns} batches"
    if not on_scale:
        where = "above" if limit_log > high else "below"
        second += f"; {marked} max {limit:.3g} is off the scale, {abs(limit_log - high):.0f} decades {where}"
    figure.text(0.5, 1 - 0.22 / height, first_line, ha="center", va="center", fontsize=10, weight="bold")
    figure.text(0.5, 1 - 0.44 / height, second, ha="center", va="center", fontsize=8)
    legend = [
        Patch(facecolor=INF_COLOUR, label="inf"),
        Patch(facecolor=NAN_COLOUR, label="nan"),
        Patch(facecolor=MISSING_COLOUR, label="not recorded"),
        Patch(facecolor=ZERO_COLOUR, edgecolor="black", linewidth=0.5, label="abs max 0"),
    ]
    if above.any():
        legend.append(Patch(facecolor="none", edgecolor=INF_COLOUR, linewidth=1.5, label=f"above {marked} max"))
    if near is not None and near.any():
        legend.append(
            Patch(
                facecolor="none",
                edgecolor=HEADROOM_COLOUR,
                linewidth=1.5,
                label=f">= {headroom_fraction:g} x {marked} max ({headroom:.3g})",
            )
        )
    # One row when it fits in the figure's width, else as many columns as fit (measured, not guessed).
    renderer = canvas.get_renderer()  # type: ignore[no-untyped-call]
    for legend_columns in range(len(legend), 0, -1):
        placed = figure.legend(
            handles=legend,
            loc="lower left",
            bbox_to_anchor=(left / width, 0.05 / height),
            ncol=legend_columns,
            fontsize=7,
            frameon=False,
        )
        if legend_columns == 1 or placed.get_window_extent(renderer).x1 <= width * dpi:
            break
        placed.remove()
    save_figure(figure, output, fmt, dpi)
    pixels: tuple[int, int] = canvas.get_width_height()
    cells = (left * dpi, _TOP_INCH * dpi, plot_width * dpi, plot_height * dpi)
    return PlotResult(
        pixels[0],
        pixels[1],
        cells,
        low,
        high,
        marked,
        on_scale,
        headroom,
        fmt,
        modules=tuple(heatmap.rows),
        direction=heatmap.direction,
    )


# --------------------------------------------------------------------------------------------------------------------
# The command


def _run(args: argparse.Namespace) -> int:
    settings = tool_config(args)
    config = settings.config
    if args.dtype is not None and "target_dtype" in settings.from_line:
        raise CliError(
            "--dtype marks that dtype's max, --target-dtype the tightest of it and FILE's", "give one of them"
        )
    fmt = image_format(args.output, args.format)
    try:
        matplotlib_or_error()
    except PlotError:
        raise CliError("matplotlib is not installed, and plot draws with it", 'pip install "nanwatch[plot]"') from None
    to_stdout = args.output == "-"
    if to_stdout and sys.stdout.isatty():
        raise CliError(
            f"-o - would write {fmt.upper()} bytes to the terminal",
            f"redirect stdout to a file (nanwatch plot {args.file} -o - > plot.{fmt}) or give -o FILE",
        )
    for flag in settings.unused_options(USED_FIELDS):
        print(f"nanwatch plot: note: {flag} is not used by plot (see nanwatch plot --help)", file=sys.stderr)
    # Applied only when set: a default fraction would add marks that nobody asked for.
    headroom = config.headroom_warn_fraction if "headroom_warn_fraction" in settings.given else None
    blocks = read_jsonl_blocks(args.file, "plot")
    if config.include_modules or config.exclude_modules:
        names = [record.module for block in blocks for record in block.records]
        modules = chosen_modules(names, config.include_modules, config.exclude_modules, source=args.file)
        blocks = [restrict(block, modules) for block in blocks]
    heatmap = build_heatmap(blocks, depth=args.depth, direction=args.direction)
    if heatmap.left_out and args.direction == "forward":  # drawn apart: say where the gradients went
        print(
            f"nanwatch plot: note: {args.file} also holds {heatmap.left_out} gradient lines (watch_gradients), "
            "not drawn here; --direction backward draws them",
            file=sys.stderr,
        )
    dtype = args.dtype if args.dtype is not None else marked_dtype(heatmap, config.target_dtype)
    dtype_max(dtype)  # a bad --dtype is an error before anything is drawn
    output: str | IO[bytes] = sys.stdout.buffer if to_stdout else args.output
    title = args.title or Path(args.file).name
    try:
        if args.kind == "lines":
            from nanwatch.cli.plot_lines import draw_lines

            result = draw_lines(
                heatmap,
                output,
                dtype=dtype,
                top=args.top,
                title=title,
                dpi=args.dpi,
                vmin=args.vmin,
                vmax=args.vmax,
                fmt=fmt,
            )
        else:
            if len(heatmap.rows) > MAX_ROWS:
                raise PlotError(
                    f"{len(heatmap.rows)} modules make more than {MAX_ROWS} rows; gather them with --depth N "
                    "(rows named by the first N parts of the module names), or draw --kind lines"
                )
            result = draw_heatmap(
                heatmap,
                output,
                dtype=dtype,
                title=title,
                dpi=args.dpi,
                headroom_fraction=headroom,
                vmin=args.vmin,
                vmax=args.vmax,
                fmt=fmt,
            )
    except OSError as error:
        raise CliError(
            f"cannot write {args.output!r}: {error.strerror or error}",
            "give -o a path in a folder that exists and can be written",
        ) from None
    if fmt == "png":
        size = f"{result.width}x{result.height} pixels"
    else:
        size = f"{result.width / args.dpi:.1f}x{result.height / args.dpi:.1f} in"
    rows = len(heatmap.rows)
    what = f"{len(result.modules)} of {rows} modules" if args.kind == "lines" else f"{rows} modules"
    if heatmap.direction == "backward":
        what = f"gradients, {what}"
    message = f"wrote {'stdout' if to_stdout else args.output} ({fmt}, {size}, {what}, {len(heatmap.batches)} batches)"
    print(message, file=sys.stderr if to_stdout else sys.stdout)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plot",
        help=COMMANDS["plot"].summary,
        description=(
            "Draw a trace (or report) .jsonl file. --kind heatmap (the default): one row per module in model order, "
            "one column per batch, the colour log10 of the largest abs max over the module's float lines, inf and "
            "nan in colours of their own, and the dtype's max marked on the colour bar; the scale is fixed by the "
            "dtype for float16, bfloat16 and float8 (smallest normal to max), so runs compare, or set by --vmin and "
            "--vmax. --kind lines: the abs max over the batches of the --top modules that came closest to the "
            "dtype's max, that max drawn across. Forward values and gradients are drawn apart: --direction forward "
            "(the default) or backward (the gradients recorded with watch_gradients), each against the max of its "
            "own tightest dtype. The format follows -o's extension (png, pdf, svg); -o - writes to stdout. Needs "
            'matplotlib: pip install "nanwatch[plot]". Exit status: 0, or 2 on bad input (one line on stderr).'
        ),
        epilog=fields_epilog("plot", USED_FIELDS),
        formatter_class=ToolHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE[:BATCH]", help="a .jsonl file written by nanwatch")
    parser.add_argument(
        "-o", "--output", required=True, help="the image to write: NAME.png, NAME.pdf or NAME.svg; - for stdout"
    )
    parser.add_argument(
        "--kind", choices=("heatmap", "lines"), default="heatmap", help="the picture (default: heatmap)"
    )
    parser.add_argument(
        "--direction",
        choices=DIRECTIONS,
        default="forward",
        help="draw the forward's values, or the gradients recorded with watch_gradients (default: forward)",
    )
    parser.add_argument(
        "--format", choices=FORMATS, default=None, help="the image format (default: -o's extension; png for -o -)"
    )
    parser.add_argument(
        "--depth", type=POSITIVE_INT, default=None, help="gather modules by the first N parts of their names"
    )
    parser.add_argument(
        "--dtype", default=None, help="whose max to mark (default: the tightest of the file's dtypes and target_dtype)"
    )
    parser.add_argument("--vmin", type=ABS_MAX, default=None, help="abs max at the bottom of the scale, e.g. 1e-3")
    parser.add_argument("--vmax", type=ABS_MAX, default=None, help="abs max at the top of the scale, e.g. 1e5")
    parser.add_argument(
        "--top",
        type=POSITIVE_INT,
        default=8,
        help="--kind lines: how many modules, the closest to the max (default: 8)",
    )
    parser.add_argument("--title", default=None, help="title (default: the file's name)")
    parser.add_argument("--dpi", type=POSITIVE_INT, default=100, help="pixels per inch (default: 100)")
    add_config_arguments(parser, used=USED_FIELDS)
    parser.set_defaults(func=_run, parser=parser)
