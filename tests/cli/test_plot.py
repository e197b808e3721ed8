"""`nanwatch plot`: the numbers behind the heatmap, and the PNG itself (size, and the colour of chosen cells)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.trace_models import SEED, Inject, build_amp_net, run_amp_net, trace_path
from torch import nn

import nanwatch
from nanwatch.cli import main
from nanwatch.cli.plot import (
    HEADROOM_COLOUR,
    INF_COLOUR,
    MISSING_COLOUR,
    NAN_COLOUR,
    ROOT_LABEL,
    build_heatmap,
    draw_heatmap,
    figure_size,
)
from nanwatch.cli.show import restrict
from nanwatch.core.formats.jsonl import read_blocks

image = pytest.importorskip("matplotlib.image")


class Ids(nn.Module):
    """Embedding of integer ids, then an Inject: an integer input line the heatmap must leave out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 4)
        self.inject = Inject()
        self.out = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.inject(self.embed(ids)))


def _ids_trace(report_dir: Path) -> Path:
    torch.manual_seed(0)
    model = Ids()
    ids = torch.tensor([[99, 1], [2, 3]])
    with nanwatch.watch(model, trace_batch_nums=[0, 1, 2], report_dir=report_dir) as handle:
        for batch in range(3):
            model.inject.armed = batch == 2
            model(ids)
            if batch < 2:
                handle.step()
        with pytest.raises(nanwatch.NonFiniteError):
            handle.step()
    return trace_path(report_dir)


def _pixel(png: Path, x: float, y: float) -> str:
    pixels = image.imread(str(png))
    red, green, blue = (round(float(channel) * 255) for channel in pixels[int(y), int(x)][:3])
    return f"#{red:02x}{green:02x}{blue:02x}"


def test_cells_hold_the_max_over_float_lines_and_the_worst_non_finite(tmp_path: Path) -> None:
    heatmap = build_heatmap(read_blocks(str(_ids_trace(tmp_path))))
    assert heatmap.rows == ["embed", "inject", "out", ROOT_LABEL]
    assert heatmap.batches == [0, 1, 2]
    assert heatmap.dtypes == ["float32"]
    records = [r for r in read_blocks(f"{trace_path(tmp_path)}:0")[0].records if r.module == "embed"]
    # The embed's int64 input (ids up to 99) is not a magnitude: the cell is the max of its weight and output.
    float_max = max(float(r.abs_max or 0) for r in records if r.dtype == "float32")
    assert float_max < 99
    assert heatmap.cells[0][0] == float_max
    inject, out, root = heatmap.cells[1], heatmap.cells[2], heatmap.cells[3]
    assert inject[0] == inject[1]
    assert inject[2] is not None
    assert math.isnan(inject[2])  # one nan and two infs in the output: nan is the worst
    assert out[2] is not None
    assert math.isnan(out[2])
    assert root[2] is not None
    assert math.isnan(root[2])
    deep = build_heatmap(read_blocks(str(trace_path(tmp_path))), depth=1)
    assert deep.rows == heatmap.rows  # already one part deep


def test_plot_writes_a_png_of_the_expected_size_with_inf_cells_in_their_colour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    png = tmp_path / "heatmap.png"
    capsys.readouterr()
    assert main(["plot", str(trace_path(tmp_path)), "-o", str(png), "--dpi", "80"]) == 0
    heatmap = build_heatmap(read_blocks(str(trace_path(tmp_path))))
    assert heatmap.rows == ["fc1", "act", "amp", "fc2", ROOT_LABEL]
    result = draw_heatmap(heatmap, tmp_path / "again.png", dpi=80)
    assert capsys.readouterr().out == f"wrote {png} ({result.width}x{result.height} pixels, 5 modules, 3 batches)\n"
    pixels = image.imread(str(png))
    assert pixels.shape[:2] == (result.height, result.width)
    width, height, _, _ = figure_size(heatmap)  # inches: grows with the rows, the columns and the longest name
    assert abs(result.width - width * 80) <= 1
    assert abs(result.height - height * 80) <= 1
    assert result.dtype == "float16"
    assert result.dtype_max_on_scale
    assert math.log10(65504) < result.high < math.log10(65504) + 0.5
    left, top, cells_width, cells_height = result.cells

    def centre(row: int, column: int) -> tuple[float, float]:
        return left + (column + 0.5) * cells_width / 3, top + (row + 0.5) * cells_height / 5

    # Batch 2: amp's output is inf (float16 overflows), and what follows is inf or nan; batches 0 and 1 are finite.
    amp = heatmap.cells[2]
    assert amp[2] == math.inf
    assert all(value is not None and math.isfinite(value) for cells in heatmap.cells for value in cells[:2])
    for row, cells in enumerate(heatmap.cells):
        for column, value in enumerate(cells):
            assert value is not None
            colour = _pixel(png, *centre(row, column))
            if math.isnan(value):
                assert colour == NAN_COLOUR, (row, column)
            elif math.isinf(value):
                assert colour == INF_COLOUR, (row, column)
            else:
                assert colour not in (INF_COLOUR, NAN_COLOUR, MISSING_COLOUR), (row, column)
    # PIL reads it too (what a browser or a README renderer would use).
    from PIL import Image

    with Image.open(png) as opened:
        assert opened.format == "PNG"
        assert opened.size == (result.width, result.height)


def test_a_float32_run_judged_against_float16_outlines_what_would_overflow(tmp_path: Path) -> None:
    # float32 throughout; at batch 1 amp multiplies by 1e5: amp, fc2 and the root reach about 1e5 > 65504.
    run_amp_net(tmp_path, dtype=torch.float32, overflow_at=1, batches=2)
    heatmap = build_heatmap(read_blocks(str(trace_path(tmp_path))))
    plain = draw_heatmap(heatmap, tmp_path / "fp32.png")
    assert plain.dtype == "float32"
    assert not plain.dtype_max_on_scale  # 3.4e38 is far above the largest number, 1e5
    assert plain.high < 6
    png = tmp_path / "as-fp16.png"
    asked = draw_heatmap(heatmap, png, dtype="float16")
    assert asked.dtype == "float16"
    assert asked.dtype_max_on_scale
    left, top, cells_width, cells_height = asked.cells
    for row, cells in enumerate(heatmap.cells):
        for column, value in enumerate(cells):
            assert value is not None
            assert math.isfinite(value)
            y = top + (row + 0.5) * cells_height / 5
            # The outline runs 0.08 of a cell inside its left edge; the centre keeps the cell's own colour.
            edge = _pixel(png, left + (column + 0.08) * cells_width / 2, y)
            centre = _pixel(png, left + (column + 0.5) * cells_width / 2, y)
            assert centre != INF_COLOUR
            assert (edge == INF_COLOUR) is (value > 65504), (heatmap.rows[row], column, value)
    assert [name for name, cells in zip(heatmap.rows, heatmap.cells, strict=True) if (cells[1] or 0) > 65504] == [
        "amp",
        "fc2",
        ROOT_LABEL,
    ]


def test_missing_matplotlib_names_the_extra(tmp_path: Path) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if it were not installed: importing it raises ImportError\n"
        "from nanwatch.cli import main\n"
        f"sys.exit(main(['plot', {str(trace_path(tmp_path))!r}, '-o', {str(tmp_path / 'x.png')!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert 'pip install "nanwatch[plot]"' in result.stderr
    assert "nanwatch plot: error:" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    capsys.readouterr()
    png = str(tmp_path / "x.png")
    assert main(["plot", str(trace_path(tmp_path)), "-o", png, "--dtype", "int8"]) == 2
    assert "dtype must name a floating-point torch dtype" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nanwatch-trace-rank0.txt"), "-o", png]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert main(["plot", str(trace_path(tmp_path)), "-o", str(tmp_path / "no" / "such" / "dir.png")]) == 2
    assert "cannot write" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# The WatchConfig fields plot applies: --config FILE and the generated options


def _float32_trace_near_float16_max(report_dir: Path) -> Path:
    """float32 AmpNet; amp multiplies by 1, 2e4 and 1e5 in batches 0, 1, 2: below, near and above float16's max."""
    model = build_amp_net(torch.float32)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED))
    with nanwatch.watch(model, trace_batch_nums=[0, 1, 2], report_dir=report_dir) as handle:
        for factor in (1.0, 2e4, 1e5):
            model.amp.factor = factor
            model(x)
            handle.step()
    return trace_path(report_dir)


def _near(colours: set[str], target: str, tolerance: int = 40) -> bool:
    """Whether any of `colours` is within `tolerance` of `target` in every channel (a thin line is antialiased)."""
    wanted = [int(target[i : i + 2], 16) for i in (1, 3, 5)]
    return any(
        all(abs(int(colour[i : i + 2], 16) - w) <= tolerance for i, w in zip((1, 3, 5), wanted, strict=True))
        for colour in colours
    )


def _edges(png: Path, rows: int, columns: int, cells: tuple[float, float, float, float]) -> list[list[set[str]]]:
    """The colours found a few pixels around where each cell's outline would run (0.08 of a cell inside its left
    edge), so antialiasing of a 1.5-point line does not decide the test."""
    left, top, width, height = cells
    return [
        [
            {
                _pixel(png, left + (c + 0.08) * width / columns + dx, top + (r + 0.5) * height / rows)
                for dx in range(-2, 3)
            }
            for c in range(columns)
        ]
        for r in range(rows)
    ]


def test_a_config_file_and_options_choose_rows_the_marked_dtype_and_headroom(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _float32_trace_near_float16_max(tmp_path / "run")
    config = tmp_path / "watch.yaml"
    config.write_text(
        "target_dtype: float16\nheadroom_warn_fraction: 0.125\nexclude_modules: [act]\nwatch_eval: true\n",
        encoding="utf-8",
    )
    png = tmp_path / "from-file.png"
    capsys.readouterr()
    assert main(["plot", str(trace), "-o", str(png), "--config", str(config), "--dpi", "80"]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"wrote {png} ({out.split('(')[1].split(' ')[0]} pixels, 4 modules, 3 batches)\n", "")

    # The same picture, drawn directly: rows without act, float16's max marked, its eighth as the headroom.
    heatmap = build_heatmap([restrict(b, {"fc1", "amp", "fc2", ""}) for b in read_blocks(str(trace))])
    assert heatmap.rows == ["fc1", "amp", "fc2", ROOT_LABEL]
    result = draw_heatmap(heatmap, tmp_path / "direct.png", dtype="float16", dpi=80, headroom_fraction=0.125)
    assert result.dtype == "float16"
    assert result.headroom == 65504 * 0.125
    assert f"({result.width}x{result.height} pixels" in out
    values = [[value or 0.0 for value in row] for row in heatmap.cells]
    near = [v for row in values for v in row if 65504 * 0.125 <= v <= 65504]
    above = [v for row in values for v in row if v > 65504]
    assert near  # batch 1 lands between float16's max / 8 and its max, batch 2 above it
    assert above
    edges = _edges(png, 4, 3, result.cells)
    for r, row in enumerate(values):
        for c, value in enumerate(row):
            expected = INF_COLOUR if value > 65504 else HEADROOM_COLOUR if value >= 65504 * 0.125 else None
            found = {target for target in (INF_COLOUR, HEADROOM_COLOUR) if _near(edges[r][c], target)}
            assert found == ({expected} if expected else set()), (heatmap.rows[r], c, value)

    # Options beat the file: headroom off, and every module back.
    png_line = tmp_path / "from-line.png"
    argv = ["plot", str(trace), "-o", str(png_line), "--config", str(config), "--dpi", "80"]
    assert main([*argv, "--headroom-warn-fraction", "0", "--exclude-modules"]) == 0
    assert "5 modules, 3 batches" in capsys.readouterr().out
    full = build_heatmap(read_blocks(str(trace)))
    plain = draw_heatmap(full, tmp_path / "plain.png", dtype="float16", dpi=80)
    flat = [value or 0.0 for row in full.cells for value in row]
    edges = _edges(png_line, 5, 3, plain.cells)
    assert [_near(e, INF_COLOUR) for row in edges for e in row] == [v > 65504 for v in flat]
    assert not any(_near(e, HEADROOM_COLOUR) for row in edges for e in row)

    # No config: float32's max is marked (nothing outlined), as before.
    assert main(["plot", str(trace), "-o", str(tmp_path / "none.png"), "--dpi", "80"]) == 0
    capsys.readouterr()
    edges = _edges(tmp_path / "none.png", 5, 3, plain.cells)
    assert not any(_near(e, INF_COLOUR) or _near(e, HEADROOM_COLOUR) for row in edges for e in row)


def test_plot_rejects_a_typo_in_the_config_and_conflicting_dtypes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    config = tmp_path / "watch.yaml"
    config.write_text("target_dtyp: float16\n", encoding="utf-8")
    png = tmp_path / "x.png"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(trace_path(tmp_path)), "-o", str(png), "--config", str(config)])
    assert exit_info.value.code == 2
    assert "unknown field 'target_dtyp' (did you mean 'target_dtype'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(trace_path(tmp_path)), "-o", str(png), "--dtype", "bfloat16", "--target-dtype", "float16"])
    assert "--dtype marks that dtype's max, --target-dtype the tightest of it and FILE's: give one" in (
        capsys.readouterr().err
    )
    assert main(["plot", str(trace_path(tmp_path)), "-o", str(png), "--include-modules", "nothing.*"]) == 2
    assert "include_modules: the pattern 'nothing.*' matches none of the 5 modules" in capsys.readouterr().err
    assert not png.exists()


def test_a_file_that_is_not_utf8_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: UnicodeDecodeError and a traceback.
    binary = tmp_path / "nanwatch-trace-rank0.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00")
    png = tmp_path / "heatmap.png"
    assert main(["plot", str(binary), "-o", str(png)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"nanwatch plot: error: {binary} is not UTF-8 text (byte 0 is 0x89); expected a .jsonl file written by "
        "nanwatch (nanwatch-report-*.jsonl or nanwatch-trace-*.jsonl in report_dir)"
    ]
    assert not png.exists()
