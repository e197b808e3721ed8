"""`nanwatch plot FILE --kind lines`: the modules that came closest to the dtype's max, their abs max over batches.

One line per module (the `--top` ones whose largest abs max came closest to the marked dtype's max; a module that
went inf or nan counts as closest, the earliest to go first), on a log scale, with the dtype's max drawn across in
red. A batch where a module's abs max was inf or nan is marked at the top edge, in the line's colour, with the
word; a batch where it was not recorded leaves a gap.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO

from nanwatch.cli._plot_common import (
    _WHAT,
    INF_COLOUR,
    SMALLEST_NORMAL,
    Heatmap,
    PlotResult,
    dtype_max,
    image_format,
    matplotlib_or_error,
    save_figure,
)
from nanwatch.errors import PlotError

__all__ = ["closest_modules", "draw_lines"]

_DECADES_TO_SHOW_MAX = 12.0  # as for the heatmap: a max further above the numbers would flatten every line
_WIDTH_INCH, _HEIGHT_INCH = 9.0, 4.8
_AXES = (0.08, 0.12, 0.6, 0.66)  # left, bottom, width, height: room above for the inf/nan words
_WORDS_PER_BATCH = 2  # inf/nan words stacked above a batch; more are counted in one "+N"


def closest_modules(heatmap: Heatmap, top: int) -> list[int]:
    """The rows of the `top` modules that came closest to overflowing, closest first.

    A module whose abs max was ever inf or nan comes before every finite one: the earliest batch first, and in one
    batch the module whose call returned first (the one that made the inf, before those it reached); the others by
    their largest abs max, largest first.
    """

    def closeness(row: int) -> tuple[int, float, float, int]:
        cells = heatmap.cells[row]
        returned = heatmap.returned[row] if heatmap.returned else row
        first_bad = next((i for i, v in enumerate(cells) if v is not None and not math.isfinite(v)), None)
        if first_bad is not None:
            return (0, float(first_bad), returned, row)
        largest = max((v for v in cells if v is not None), default=0.0)
        return (1, -largest, 0.0, row)

    return sorted(range(len(heatmap.rows)), key=closeness)[:top]


def draw_lines(
    heatmap: Heatmap,
    output: str | Path | IO[bytes],
    *,
    dtype: str,
    top: int = 8,
    title: str | None = None,
    dpi: int = 100,
    vmin: float | None = None,
    vmax: float | None = None,
    fmt: str | None = None,
) -> PlotResult:
    """Draw the abs max of the `top` modules closest to `dtype`'s max, one line each over the batches.

    Args:
        heatmap: from `build_heatmap` (its cells are the numbers drawn).
        output: the image file to write, or a binary stream.
        dtype: whose max is drawn across.
        top: how many modules.
        title: the first line of the title.
        dpi: pixels per inch.
        vmin: the bottom of the y axis (an abs max); default: below the smallest number drawn.
        vmax: the top of the y axis; default: above the largest number drawn, or the max when it is near.
        fmt: the image format; default: from `output`'s extension.

    Returns:
        The image's size, the axes' box and range (log10 units), and the modules drawn (`modules`), closest first.

    Raises:
        PlotError: matplotlib is not installed, `dtype` is not a floating-point dtype, or `vmin` >= `vmax`.
    """
    fmt = fmt if fmt is not None else image_format(output if isinstance(output, str | Path) else "-")
    limit = dtype_max(dtype)
    if vmin is not None and vmax is not None and not vmin < vmax:
        raise PlotError(f"--vmin must be below --vmax, got {vmin:g} and {vmax:g}")
    matplotlib_or_error()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rows = closest_modules(heatmap, top)
    finite = [v for r in rows for v in heatmap.cells[r] if v is not None and math.isfinite(v) and v > 0]
    largest = max(finite, default=1.0)
    smallest = min(finite, default=largest)
    shows_max = dtype in SMALLEST_NORMAL or math.log10(limit) - math.log10(largest) <= _DECADES_TO_SHOW_MAX
    bottom = vmin if vmin is not None else smallest / 3
    roof = vmax if vmax is not None else max(largest, limit if shows_max else largest) * 4
    if not bottom < roof:
        bottom, roof = (roof / 10, roof) if vmax is not None else (bottom, bottom * 10)

    figure = Figure(figsize=(_WIDTH_INCH, _HEIGHT_INCH), dpi=dpi)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_axes(_AXES)
    axes.set_yscale("log")
    axes.set_ylim(bottom, roof)
    batches = heatmap.batches
    colours = [f"C{index % 10}" for index in range(len(rows))]
    handles = []
    stacked: dict[int, int] = {}  # words already written above each batch: the next goes above them
    for row, colour in zip(rows, colours, strict=True):
        cells = heatmap.cells[row]
        ys = [v if v is not None and math.isfinite(v) and v > 0 else math.nan for v in cells]
        (line,) = axes.plot(batches, ys, marker="o", markersize=3, linewidth=1.4, color=colour)
        for batch, value in zip(batches, cells, strict=True):
            if value is not None and not math.isfinite(value):
                height = stacked.get(batch, 0)
                stacked[batch] = height + 1
                if not height:  # one marker per batch, in the colour of the module that went first
                    axes.plot([batch], [roof], marker="X", markersize=8, color=colour, clip_on=False, zorder=4)
                if height > _WORDS_PER_BATCH:
                    continue
                word = "nan" if math.isnan(value) else "inf"
                if height == _WORDS_PER_BATCH:
                    more = sum(1 for r in rows if _bad(heatmap.cells[r][batches.index(batch)])) - _WORDS_PER_BATCH
                    word, colour_here = f"+{more}", "black"
                else:
                    colour_here = colour
                axes.annotate(
                    word,
                    (batch, roof),
                    xytext=(0, 7 + 9 * height),
                    textcoords="offset points",
                    ha="center",
                    fontsize=7,
                    color=colour_here,
                    annotation_clip=False,
                )
        handles.append((line, _label(heatmap.rows[row], cells, batches)))
    on_scale = bottom <= limit <= roof
    if on_scale:
        axes.axhline(limit, color=INF_COLOUR, linestyle="--", linewidth=1.5)
        axes.annotate(
            f"{dtype} max {limit:.6g}",
            (batches[0], limit),
            xytext=(2, 3),
            textcoords="offset points",
            fontsize=7,
            color=INF_COLOUR,
        )
    axes.set_xlabel("batch", fontsize=9)
    axes.set_ylabel("abs max" if heatmap.direction == "forward" else "abs max of gradients", fontsize=9)
    axes.tick_params(labelsize=8)
    if len(batches) <= 30:
        axes.set_xticks(batches)
    axes.grid(True, which="major", linewidth=0.4, alpha=0.5)
    marker = Line2D([], [], marker="X", linestyle="none", color="black", markersize=7)
    figure.legend(
        [h for h, _ in handles] + [marker],
        [text for _, text in handles] + ["inf / nan in that batch"],
        loc="center left",
        bbox_to_anchor=(0.7, 0.48),
        fontsize=7,
        frameon=False,
    )
    what = _WHAT[heatmap.direction][0]
    second = f"{what}: {len(rows)} of {len(heatmap.rows)} modules, the closest to {dtype}'s max; {len(batches)} batches"
    if not on_scale:
        second += f"; {dtype} max {limit:.3g} is off the scale"
    figure.text(0.5, 0.95, title or "abs max per batch", ha="center", va="center", fontsize=10, weight="bold")
    figure.text(0.5, 0.905, second, ha="center", va="center", fontsize=8)
    save_figure(figure, output, fmt, dpi)
    width, height = canvas.get_width_height()
    left, bottom, axes_width, axes_height = _AXES
    box = (left * width, (1 - bottom - axes_height) * height, axes_width * width, axes_height * height)
    names = tuple(heatmap.rows[row] for row in rows)
    low, high = math.log10(bottom), math.log10(roof)
    return PlotResult(width, height, box, low, high, dtype, on_scale, None, fmt, names, heatmap.direction)


def _label(name: str, cells: list[float | None], batches: list[int]) -> str:
    first_bad = next(
        ((b, v) for b, v in zip(batches, cells, strict=True) if v is not None and not math.isfinite(v)), None
    )
    if first_bad is not None:
        word = "nan" if math.isnan(first_bad[1]) else "inf"
        return f"{name} ({word} at batch {first_bad[0]})"
    largest = max((v for v in cells if v is not None), default=0.0)
    return f"{name} (max {largest:.3g})"


def _bad(value: float | None) -> bool:
    return value is not None and not math.isfinite(value)
