"""`nanwatch plot FILE -o heatmap.png`: log10(abs max) per module (rows) per batch (columns), the dtype's max marked.

Each cell is the largest abs max over the module's floating-point lines in that batch (its parameters, inputs and
outputs, every call of it): the picture of how close each module comes to its dtype's limit, batch after batch.
Integer tensors (token ids, masks) are left out, as their values are not magnitudes. inf and nan cells get colours
of their own, a module that did not run in a batch is left grey, and an abs max of exactly 0 is drawn white.
Finite cells above the marked dtype's max (a float32 run judged against float16 with `--dtype float16`) are
outlined in red: they would overflow in that dtype. With a headroom fraction, cells at or above that fraction of
the marked max (where nanwatch warns while watching) are outlined in orange, and the fraction is marked on the bar.

With a config (`--config FILE` or the options generated from `WatchConfig`), `include_modules` / `exclude_modules`
choose the rows, `target_dtype` joins the candidates for the marked max, and `headroom_warn_fraction` (when set)
draws the headroom outlines.

matplotlib is imported only here, when a plot is drawn (`pip install "nanwatch[plot]"`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanwatch.cli.options import ToolHelpFormatter, add_config_arguments, fields_epilog, tool_config
from nanwatch.cli.show import chosen_modules, restrict
from nanwatch.core.formats.jsonl import Block, JsonlError, read_blocks
from nanwatch.core.stats.dtypes import FLOAT_MAX, float_max
from nanwatch.errors import ConfigError, PlotError

__all__ = [
    "register",
    "Heatmap",
    "PlotResult",
    "PlotError",
    "build_heatmap",
    "draw_heatmap",
    "figure_size",
    "dtype_max",
    "marked_dtype",
    "USED_FIELDS",
]

ROOT_LABEL = "(root)"
MAX_ROWS = 600  # at 0.2 inch a row, more would make an image no viewer opens comfortably: use --depth
INF_COLOUR = "#e41a1c"
NAN_COLOUR = "#ff00ff"
MISSING_COLOUR = "#d0d0d0"
ZERO_COLOUR = "#ffffff"
HEADROOM_COLOUR = "#ff7f00"
# A dtype's max is put on the colour scale when it lies at most this many decades above the largest value drawn;
# further up (float32's 3.4e38 for a model whose numbers stay near 1) it would squash every colour into one.
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


@dataclass(frozen=True)
class Heatmap:
    """The numbers behind the picture.

    Attributes:
        rows: module names in the order they first ran (`ROOT_LABEL` for the model itself).
        batches: the batch numbers, ascending.
        cells: `cells[row][column]`: the largest abs max (inf or nan when any line was), None where not recorded.
        dtypes: the floating-point dtypes of the lines drawn.
    """

    rows: list[str]
    batches: list[int]
    cells: list[list[float | None]]
    dtypes: list[str]


@dataclass(frozen=True)
class PlotResult:
    """What was drawn, in numbers.

    Attributes:
        width: of the image, in pixels.
        height: of the image, in pixels.
        cells: (left, top, width, height) of the grid of cells, in pixels from the image's top-left corner.
        low: the bottom of the colour scale, in log10 units.
        high: the top of the colour scale, in log10 units.
        dtype: whose max is marked.
        dtype_max_on_scale: whether that max fits on the colour scale (and is marked on the colour bar).
        headroom: the headroom threshold (a fraction of that max) whose cells are outlined in orange, or None.
    """

    width: int
    height: int
    cells: tuple[float, float, float, float]
    low: float
    high: float
    dtype: str
    dtype_max_on_scale: bool
    headroom: float | None = None


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


def build_heatmap(blocks: Sequence[Block], *, depth: int | None = None) -> Heatmap:
    """Reduce records to one number per (module, batch): the max over the module's float lines.

    Args:
        blocks: traced batches (or reports) read from a .jsonl file; a batch held twice keeps its last block.
        depth: gather modules by the first `depth` parts of their names (`transformer.h.0` for depth 3).

    Raises:
        PlotError: no floating-point line holds a number.
    """
    by_batch: dict[int, dict[str, float]] = {}
    rows: dict[str, None] = {}
    dtypes: set[str] = set()
    for block in blocks:
        seen: dict[int, dict[str, float]] = {}
        for record in block.records:
            if record.abs_max is None or not _is_float(record.dtype):
                continue
            assert record.dtype is not None
            name = _row_name(record.module, depth)
            rows.setdefault(name, None)
            dtypes.add(record.dtype)
            batch_cells = seen.setdefault(record.batch, {})
            batch_cells[name] = _merge(batch_cells.get(name), float(record.abs_max))
        by_batch.update(seen)  # a later block of the same batch (a reused report_dir) replaces the earlier one
    if not by_batch:
        raise PlotError("nothing to plot: no floating-point tensor line holds a number")
    batches = sorted(by_batch)
    names = list(rows)
    cells = [[by_batch[batch].get(name) for batch in batches] for name in names]
    return Heatmap(names, batches, cells, sorted(dtypes))


def dtype_max(dtype: str) -> float:
    """The largest finite value of a floating-point dtype named as in the records ("float16", "bfloat16", ...).

    Raises:
        PlotError: not a floating-point dtype torch knows.
    """
    found = float_max(dtype)
    if found is None:
        known = ", ".join(FLOAT_MAX)
        raise PlotError(f"dtype must name a floating-point torch dtype ({known}), got {dtype!r}")
    return found


def marked_dtype(heatmap: Heatmap, target_dtype: str | None = None) -> str:
    """The dtype whose max a plot marks: the tightest of the dtypes drawn and `target_dtype` (when given).

    Raises:
        PlotError: `target_dtype` is not a floating-point dtype.
    """
    candidates = [*heatmap.dtypes, *([target_dtype] if target_dtype is not None else [])]
    return min(candidates, key=dtype_max)


def figure_size(heatmap: Heatmap) -> tuple[float, float, float, float]:
    """(width, height, left margin, plot width) in inches: the picture grows with the rows, columns and names."""
    columns = len(heatmap.batches)
    plot_width = min(max(2.5, columns * 0.45), max(9.0, columns * 0.06))
    left = 0.3 + _CHAR_INCH * max(len(name) for name in heatmap.rows)
    plot_height = max(1.2, len(heatmap.rows) * _ROW_INCH)
    return left + plot_width + _RIGHT_INCH, _TOP_INCH + plot_height + _BOTTOM_INCH, left, plot_width


def draw_heatmap(
    heatmap: Heatmap,
    output: str | Path,
    *,
    dtype: str | None = None,
    title: str | None = None,
    dpi: int = 100,
    headroom_fraction: float | None = None,
) -> PlotResult:
    """Draw `heatmap` to a PNG file.

    Args:
        heatmap: from `build_heatmap`.
        output: the image file to write.
        dtype: whose max to mark; by default the tightest of the dtypes drawn (float16 in a mixed-precision run).
        title: the first line of the title.
        dpi: pixels per inch.
        headroom_fraction: outline in orange the finite cells at or above this fraction of the marked max (and at
            most the max), and mark the fraction on the colour bar; None: no headroom marks.

    Returns:
        The image's size, where its cells are, and its colour scale.

    Raises:
        PlotError: matplotlib is not installed, `dtype` is not a floating-point dtype, or `headroom_fraction` is not
            in (0, 1].
    """
    if headroom_fraction is not None and not 0 < headroom_fraction <= 1:
        raise PlotError(f"headroom_fraction must be in (0, 1], got {headroom_fraction!r}")
    try:
        import numpy as np
        from matplotlib import colormaps, colors
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PatchCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as error:
        raise PlotError(
            'nanwatch plot draws with matplotlib, which is not installed: pip install "nanwatch[plot]"'
        ) from error

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
    low = float(logs[positive].min()) if positive.any() else limit_log - 1
    high = float(logs[positive].max()) if positive.any() else limit_log
    on_scale = limit_log - high <= _MAX_DECADES_TO_DTYPE_MAX
    if on_scale and high <= limit_log:
        high = limit_log + 0.04 * (limit_log - low)  # a little room above, so the mark is not lost on the bar's edge
    if high - low < 1:
        low, high = low - 0.5, high + 0.5
    logs[zero] = low - 1  # below the scale: drawn in the "under" colour

    width, height, left, plot_width = figure_size(heatmap)
    figure = Figure(figsize=(width, height), dpi=dpi)
    canvas = FigureCanvasAgg(figure)
    plot_height = height - _TOP_INCH - _BOTTOM_INCH
    axes = figure.add_axes((left / width, _BOTTOM_INCH / height, plot_width / width, plot_height / height))
    axes.set_facecolor(MISSING_COLOUR)
    colour_map = colormaps["viridis"].with_extremes(under=ZERO_COLOUR)
    image = axes.imshow(
        np.ma.masked_invalid(logs),
        cmap=colour_map,
        norm=colors.Normalize(vmin=low, vmax=high),
        aspect="auto",
        interpolation="nearest",
    )
    for mask, colour in ((is_inf, INF_COLOUR), (is_nan, NAN_COLOUR)):
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
    bar = figure.colorbar(image, cax=bar_axes, extend="min" if zero.any() else "neither")
    bar.set_label("log10(abs max)", fontsize=9)
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

    first_line = title or "log10(abs max) per module and batch"
    second = f"cell: max over the module's float lines; {rows} modules, {columns} batches"
    if not on_scale:
        second += f"; {marked} max {limit:.3g} is off the scale, {limit_log - high:.0f} decades above"
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
    for columns in range(len(legend), 0, -1):
        placed = figure.legend(
            handles=legend,
            loc="lower left",
            bbox_to_anchor=(left / width, 0.05 / height),
            ncol=columns,
            fontsize=7,
            frameon=False,
        )
        if columns == 1 or placed.get_window_extent(renderer).x1 <= width * dpi:
            break
        placed.remove()
    figure.savefig(str(output), format="png", dpi=dpi)
    pixels: tuple[int, int] = canvas.get_width_height()
    cells = (left * dpi, _TOP_INCH * dpi, plot_width * dpi, plot_height * dpi)
    return PlotResult(pixels[0], pixels[1], cells, low, high, marked, on_scale, headroom)


def _run(args: argparse.Namespace) -> int:
    settings = tool_config(args, args.parser)
    config = settings.config
    if args.dtype is not None and "target_dtype" in settings.from_line:
        args.parser.error("--dtype marks that dtype's max, --target-dtype the tightest of it and FILE's: give one")
    for flag in settings.unused_options(USED_FIELDS):
        print(f"nanwatch plot: note: {flag} is not used by plot (see nanwatch plot --help)", file=sys.stderr)
    # Applied only when set: a default fraction would add marks that nobody asked for.
    headroom = config.headroom_warn_fraction if "headroom_warn_fraction" in settings.given else None
    try:
        blocks = read_blocks(args.file)
        if config.include_modules or config.exclude_modules:
            names = [record.module for block in blocks for record in block.records]
            modules = chosen_modules(names, config.include_modules, config.exclude_modules, source=args.file)
            blocks = [restrict(block, modules) for block in blocks]
        heatmap = build_heatmap(blocks, depth=args.depth)
        if len(heatmap.rows) > MAX_ROWS:
            raise PlotError(
                f"{len(heatmap.rows)} modules make more than {MAX_ROWS} rows; gather them with --depth N "
                "(rows named by the first N parts of the module names)"
            )
        dtype = args.dtype if args.dtype is not None else marked_dtype(heatmap, config.target_dtype)
        result = draw_heatmap(
            heatmap,
            args.output,
            dtype=dtype,
            title=args.title or Path(args.file).name,
            dpi=args.dpi,
            headroom_fraction=headroom,
        )
    except (JsonlError, PlotError, ConfigError) as error:
        print(f"nanwatch plot: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"nanwatch plot: error: cannot write {args.output!r}: {error.strerror or error}", file=sys.stderr)
        return 2
    rows, columns = len(heatmap.rows), len(heatmap.batches)
    print(f"wrote {args.output} ({result.width}x{result.height} pixels, {rows} modules, {columns} batches)")
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw log10(abs max) per module per batch as a heatmap PNG",
        description=(
            "Draw a heatmap of a trace (or report) .jsonl file: one row per module, one column per batch, the "
            "colour log10 of the largest abs max over the module's float lines, inf and nan in colours of their "
            'own, and the dtype\'s max marked on the colour bar. Needs matplotlib: pip install "nanwatch[plot]". '
            "Exit status: 0, or 2 on bad input."
        ),
        epilog=fields_epilog("plot", USED_FIELDS),
        formatter_class=ToolHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE[:BATCH]", help="a .jsonl file written by nanwatch")
    parser.add_argument("-o", "--output", required=True, help="the PNG file to write")
    parser.add_argument(
        "--depth", type=_positive, default=None, help="gather modules by the first N parts of their names"
    )
    parser.add_argument(
        "--dtype", default=None, help="whose max to mark (default: the tightest of the file's dtypes and target_dtype)"
    )
    parser.add_argument("--title", default=None, help="title (default: the file's name)")
    parser.add_argument("--dpi", type=_positive, default=100, help="pixels per inch (default: 100)")
    add_config_arguments(parser, used=USED_FIELDS)
    parser.set_defaults(func=_run, parser=parser)
