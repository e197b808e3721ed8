"""What `nanwatch plot`'s two pictures share: the numbers drawn (`Heatmap`), what was drawn (`PlotResult`), the
colours, the image formats and the dtype's max. The heatmap (`plot`) and the lines (`plot_lines`) both import it.

matplotlib is imported only by `matplotlib_or_error` and the drawing functions, when a plot is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from nanwatch.cli.usage import CliError
from nanwatch.core.stats.dtypes import FLOAT_MAX, float_max
from nanwatch.errors import PlotError

__all__ = [
    "Heatmap",
    "PlotResult",
    "FORMATS",
    "DIRECTIONS",
    "SMALLEST_NORMAL",
    "dtype_max",
    "image_format",
    "matplotlib_or_error",
    "save_figure",
]

INF_COLOUR = "#e41a1c"
NAN_COLOUR = "#ff00ff"
MISSING_COLOUR = "#d0d0d0"
ZERO_COLOUR = "#ffffff"
HEADROOM_COLOUR = "#ff7f00"
# The image formats `-o NAME.EXT` (or `--format`) may ask for; matplotlib writes each with its own backend.
FORMATS = ("png", "pdf", "svg")
# What `--direction` may draw, and the records' directions each takes: the forward's values (with the recomputes of
# activation checkpointing, which run the forward again during backward), or the gradients.
DIRECTIONS = ("forward", "backward")
# How the picture names what it draws, and the lines its cells are the max of.
_WHAT = {
    "forward": ("forward values", "the module's float lines"),
    "backward": ("gradients", "the module's gradient lines"),
}
# The smallest normal number of the narrow dtypes, whose scale is fixed by default (bottom: this, top: the max);
# a test checks each against torch.finfo(...).smallest_normal.
SMALLEST_NORMAL: dict[str, float] = {
    "float16": 2.0**-14,
    "bfloat16": 2.0**-126,
    "float8_e4m3fn": 2.0**-6,
    "float8_e4m3fnuz": 2.0**-7,
    "float8_e5m2": 2.0**-14,
    "float8_e5m2fnuz": 2.0**-15,
}


@dataclass(frozen=True)
class Heatmap:
    """The numbers behind the picture.

    Attributes:
        rows: module names in model order (`ROOT_LABEL` for the model itself, first).
        batches: the batch numbers, ascending.
        cells: `cells[row][column]`: the largest abs max (inf or nan when any line was), None where not recorded.
        dtypes: the floating-point dtypes of the lines drawn.
        returned: for each row, its place in the order the modules' calls returned in a batch (children before
            their parent, the module that made an inf before those it reached); for gradients, the order autograd
            produced them; empty when not known.
        direction: what the cells hold: "forward" values or "backward" gradients (`DIRECTIONS`).
        left_out: how many float lines with a number the file holds in the other direction (not drawn).
    """

    rows: list[str]
    batches: list[int]
    cells: list[list[float | None]]
    dtypes: list[str]
    returned: list[float] = field(default_factory=list)
    direction: str = "forward"
    left_out: int = 0


@dataclass(frozen=True)
class PlotResult:
    """What was drawn, in numbers.

    Attributes:
        width: of the image, in pixels (at the dpi asked for; a pdf or svg is this size in points x dpi / 72).
        height: of the image, in pixels.
        cells: (left, top, width, height) of the grid of cells (for lines: of the axes), in pixels from the image's
            top-left corner.
        low: the bottom of the colour scale (for lines: of the y axis), in log10 units.
        high: the top of the colour scale (for lines: of the y axis), in log10 units.
        dtype: whose max is marked.
        dtype_max_on_scale: whether that max fits on the scale (and is marked on it).
        headroom: the headroom threshold (a fraction of that max) whose cells are outlined in orange, or None.
        format: the image format written ("png", "pdf", "svg").
        modules: the rows drawn (for lines: the modules that came closest to the max, closest first).
        direction: what was drawn: "forward" values or "backward" gradients.
    """

    width: int
    height: int
    cells: tuple[float, float, float, float]
    low: float
    high: float
    dtype: str
    dtype_max_on_scale: bool
    headroom: float | None = None
    format: str = "png"
    modules: tuple[str, ...] = ()
    direction: str = "forward"


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


def image_format(output: str | Path, asked: str | None = None) -> str:
    """The image format to write: `asked` (`--format`), else the extension of `output`; png for stdout (`-`).

    Raises:
        CliError: the format is not one of `FORMATS`, the name has no extension, or the two disagree.
    """
    todo = f"end -o's name in {', '.join('.' + f for f in FORMATS)}, or give --format {'|'.join(FORMATS)}"
    if asked is not None and asked not in FORMATS:
        raise CliError(f"--format {asked!r} is not an image format nanwatch writes", todo)
    if str(output) == "-":
        return asked or "png"
    suffix = Path(output).suffix.lower().lstrip(".")
    if asked is not None:
        if suffix and suffix != asked:
            raise CliError(f"-o {output} says {suffix}, --format says {asked}", "give one of them")
        return asked
    if not suffix:
        raise CliError(f"-o {output} has no extension to tell the image format", todo)
    if suffix not in FORMATS:
        raise CliError(f"-o {output}: {suffix!r} is not an image format nanwatch writes", todo)
    return suffix


def matplotlib_or_error() -> None:
    """Raises PlotError naming the extra to install when matplotlib is not there."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise PlotError(
            'nanwatch plot draws with matplotlib, which is not installed: pip install "nanwatch[plot]"'
        ) from error


def save_figure(figure: Any, output: str | Path | IO[bytes], fmt: str, dpi: int) -> None:
    """Write `figure` in `fmt` to a file, or to a binary stream (`-o -`: stdout)."""
    target = output if not isinstance(output, str | Path) else str(output)
    figure.savefig(target, format=fmt, dpi=dpi)
