"""`nanwatch plot`: the numbers behind the heatmap and the lines, and the images themselves (size, format, the colour
of chosen cells, the scale two runs share)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models import Cast
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
    SMALLEST_NORMAL,
    build_heatmap,
    draw_heatmap,
    figure_size,
    model_order,
)
from nanwatch.cli.plot_lines import draw_lines
from nanwatch.cli.show import restrict
from nanwatch.core.formats.jsonl_reader import read_blocks

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
    assert heatmap.rows == [ROOT_LABEL, "embed", "inject", "out"]  # model order: the model, then its children
    assert heatmap.batches == [0, 1, 2]
    assert heatmap.dtypes == ["float32"]
    records = [r for r in read_blocks(f"{trace_path(tmp_path)}:0")[0].records if r.module == "embed"]
    # The embed's int64 input (ids up to 99) is not a magnitude: the cell is the max of its weight and output.
    float_max = max(float(r.abs_max or 0) for r in records if r.dtype == "float32")
    assert float_max < 99
    assert heatmap.cells[1][0] == float_max
    root, inject, out = heatmap.cells[0], heatmap.cells[2], heatmap.cells[3]
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
    assert heatmap.rows == [ROOT_LABEL, "fc1", "act", "amp", "fc2"]
    result = draw_heatmap(heatmap, tmp_path / "again.png", dpi=80)
    assert capsys.readouterr().out == (
        f"wrote {png} (png, {result.width}x{result.height} pixels, 5 modules, 3 batches)\n"
    )
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
    amp = heatmap.cells[3]
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
        ROOT_LABEL,
        "amp",
        "fc2",
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
    assert (
        result.stderr
        == 'nanwatch plot: matplotlib is not installed, and plot draws with it; pip install "nanwatch[plot]"\n'
    )
    assert not (tmp_path / "x.png").exists()


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    capsys.readouterr()
    png = str(tmp_path / "x.png")
    assert main(["plot", str(trace_path(tmp_path)), "-o", png, "--dtype", "int8"]) == 2
    assert "dtype must name a floating-point torch dtype" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nanwatch-trace-rank0.txt"), "-o", png]) == 2
    assert "nanwatch-trace-rank0.txt is a nanwatch text trace (.txt); plot reads a nanwatch .jsonl file: give " in (
        capsys.readouterr().err
    )
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
    assert (out, err) == (f"wrote {png} (png, {out.split(', ')[1].split(' ')[0]} pixels, 4 modules, 3 batches)\n", "")

    # The same picture, drawn directly: rows without act, float16's max marked, its eighth as the headroom.
    heatmap = build_heatmap([restrict(b, {"fc1", "amp", "fc2", ""}) for b in read_blocks(str(trace))])
    assert heatmap.rows == [ROOT_LABEL, "fc1", "amp", "fc2"]
    result = draw_heatmap(heatmap, tmp_path / "direct.png", dtype="float16", dpi=80, headroom_fraction=0.125)
    assert result.dtype == "float16"
    assert result.headroom == 65504 * 0.125
    assert f"(png, {result.width}x{result.height} pixels" in out
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
    assert main(["plot", str(trace_path(tmp_path)), "-o", str(png), "--config", str(config)]) == 2
    assert "unknown field 'target_dtyp' (did you mean 'target_dtype'?" in capsys.readouterr().err
    argv = ["plot", str(trace_path(tmp_path)), "-o", str(png), "--dtype", "bfloat16", "--target-dtype", "float16"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "nanwatch plot: --dtype marks that dtype's max, --target-dtype the tightest of it and FILE's; "
        "give one of them\n"
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
        f"nanwatch plot: {binary} is a binary file (byte 0 is 0x89), not text; plot reads a nanwatch .jsonl file: "
        "report_dir holds nanwatch-report-*.jsonl and nanwatch-trace-*.jsonl"
    ]
    assert not png.exists()


# --------------------------------------------------------------------------------------------------------------------
# Rows in model order


def test_rows_are_in_model_order_even_when_a_report_begins_mid_batch(tmp_path: Path) -> None:
    # 5 frames: fc2 and the root of batch 1, then fc1, act and amp of batch 2 (amp's output is inf).
    model = build_amp_net()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED)).half()
    with pytest.raises(nanwatch.NonFiniteError):
        _overflow_at_2(model, x, tmp_path)
    blocks = read_blocks(str(tmp_path / "nanwatch-report-rank0-batch2.jsonl"))
    assert [record.module for record in blocks[0].records if record.label == "output"] == [
        "fc2",
        "",
        "fc1",
        "act",
        "amp",
    ]
    heatmap = build_heatmap(blocks)
    assert heatmap.rows == [ROOT_LABEL, "fc1", "act", "amp", "fc2"]  # as print(model) lists them


def _overflow_at_2(model: nn.Module, x: torch.Tensor, report_dir: Path) -> None:
    with nanwatch.watch(model, report_dir=report_dir, max_frames_to_save=5) as handle:
        for batch in range(3):
            model.amp.factor = 1e5 if batch == 2 else 1.0  # type: ignore[union-attr]
            model(x)
            handle.step()


def test_model_order_puts_a_module_above_its_children_and_siblings_in_call_order() -> None:
    # The return order of a small transformer: children before their parents, the root last.
    returned = ["wte", "h.0.attn", "h.0.mlp.fc", "h.0.mlp", "h.0", "h.1.attn", "h.1", "ln_f", ROOT_LABEL, "lm_head"]
    expected = [ROOT_LABEL, "wte", "h.0", "h.0.attn", "h.0.mlp", "h.0.mlp.fc", "h.1", "h.1.attn", "ln_f", "lm_head"]
    assert model_order([(returned, False)]) == expected
    # The same forward, seen as a report does: the end of one batch, then the start of the next.
    assert model_order([(returned[6:], True), (returned[:6], False)]) == expected


# --------------------------------------------------------------------------------------------------------------------
# Image formats, and stdout


def test_the_format_follows_the_extension(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    trace = str(trace_path(tmp_path))
    capsys.readouterr()
    for suffix, magic in ((".png", b"\x89PNG"), (".pdf", b"%PDF"), (".svg", b"<?xml")):
        path = tmp_path / f"heatmap{suffix}"
        assert main(["plot", trace, "-o", str(path)]) == 0
        assert path.read_bytes().startswith(magic), suffix
        assert capsys.readouterr().out.startswith(f"wrote {path} ({suffix[1:]}, ")
    assert b"<svg" in (tmp_path / "heatmap.svg").read_bytes()
    bad = {
        "x.jpg": "-o {dir}/x.jpg: 'jpg' is not an image format nanwatch writes; end -o's name in .png, .pdf, .svg, or "
        "give --format png|pdf|svg",
        "x": "-o {dir}/x has no extension to tell the image format; end -o's name in .png, .pdf, .svg",
    }
    for name, expected in bad.items():
        assert main(["plot", trace, "-o", str(tmp_path / name)]) == 2
        assert capsys.readouterr().err.startswith("nanwatch plot: " + expected.format(dir=tmp_path))
        assert not (tmp_path / name).exists()
    assert main(["plot", trace, "-o", str(tmp_path / "y.png"), "--format", "pdf"]) == 2
    assert f"-o {tmp_path / 'y.png'} says png, --format says pdf; give one of them" in capsys.readouterr().err
    assert main(["plot", trace, "-o", str(tmp_path / "heatmap"), "--format", "pdf"]) == 0
    assert (tmp_path / "heatmap").read_bytes().startswith(b"%PDF")


@pytest.mark.slow
def test_dash_writes_the_image_to_stdout_or_refuses_a_terminal(tmp_path: Path) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=2)
    argv = [sys.executable, "-m", "nanwatch", "plot", str(trace_path(tmp_path)), "-o", "-"]
    piped = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.startswith(b"\x89PNG")
    assert piped.stderr.decode().startswith("wrote stdout (png, ")
    svg = subprocess.run([*argv, "--format", "svg"], capture_output=True, timeout=120, check=False)
    assert b"<svg" in svg.stdout
    assert not (Path.cwd() / "-").exists()
    # A terminal as stdout: refused, nothing written.
    import pty

    leader, follower = pty.openpty()
    try:
        tty = subprocess.run(argv, stdout=follower, stderr=subprocess.PIPE, timeout=120, check=False)
    finally:
        os.close(follower)
        os.close(leader)
    assert tty.returncode == 2
    assert tty.stderr.decode() == (
        f"nanwatch plot: -o - would write PNG bytes to the terminal; redirect stdout to a file (nanwatch plot "
        f"{trace_path(tmp_path)} -o - > plot.png) or give -o FILE\n"
    )


# --------------------------------------------------------------------------------------------------------------------
# The colour scale: fixed by the dtype (float16, bfloat16, float8), or by --vmin / --vmax, so two runs compare


def _trace_scaled(report_dir: Path, factor: float, dtype: torch.dtype) -> Path:
    """AmpNet, amp multiplying by `factor` in every batch: fc1 and act are the same whatever the factor."""
    model = build_amp_net(dtype)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED)).to(dtype)
    model.amp.factor = factor
    with nanwatch.watch(model, trace_batch_nums=[0, 1], report_dir=report_dir) as handle:
        for _ in range(2):
            model(x)
            handle.step()
    return trace_path(report_dir)


def test_float16_runs_share_a_scale_fixed_by_the_dtype(tmp_path: Path) -> None:
    # Before: each file's colours were relative to its own numbers, so a healthy run was yellow everywhere.
    quiet = build_heatmap(read_blocks(str(_trace_scaled(tmp_path / "quiet", 1.0, torch.float16))))
    loud = build_heatmap(read_blocks(str(_trace_scaled(tmp_path / "loud", 300.0, torch.float16))))
    results = []
    for name, heatmap in (("quiet", quiet), ("loud", loud)):
        png = tmp_path / f"{name}.png"
        result = draw_heatmap(heatmap, png, dpi=80)
        left, top, width, height = result.cells
        row = heatmap.rows.index("fc1")
        results.append((result, _pixel(png, left + 0.25 * width, top + (row + 0.5) * height / len(heatmap.rows))))
    (quiet_result, quiet_fc1), (loud_result, loud_fc1) = results
    low = math.log10(2.0**-14)  # float16's smallest normal ...
    high = math.log10(65504) + 0.04 * (math.log10(65504) - low)  # ... to its max, a little room above
    assert (quiet_result.low, quiet_result.high) == (loud_result.low, loud_result.high) == (low, high)
    assert quiet.cells[quiet.rows.index("fc1")] == loud.cells[loud.rows.index("fc1")]
    assert quiet_fc1 == loud_fc1  # the same number, the same colour, in both pictures


def test_vmin_and_vmax_set_the_scale_of_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [str(_trace_scaled(tmp_path / name, factor, torch.float32)) for name, factor in (("a", 1.0), ("b", 1e4))]
    own = [draw_heatmap(build_heatmap(read_blocks(run)), tmp_path / f"own{i}.png") for i, run in enumerate(runs)]
    assert own[0].high != own[1].high  # float32: by default each around its own numbers
    colours = []
    for index, run in enumerate(runs):
        png = tmp_path / f"fixed{index}.png"
        assert main(["plot", run, "-o", str(png), "--dpi", "80", "--vmin", "1e-3", "--vmax", "1e3"]) == 0
        heatmap = build_heatmap(read_blocks(run))
        result = draw_heatmap(heatmap, tmp_path / "same.png", dpi=80, vmin=1e-3, vmax=1e3)
        assert (result.low, result.high) == (-3.0, 3.0)
        left, top, width, height = result.cells
        rows = len(heatmap.rows)
        colours.append([_pixel(png, left + 0.25 * width, top + (r + 0.5) * height / rows) for r in range(rows)])
        if index == 1:  # amp, fc2 and the root pass 1e3: beyond the scale, they take its top colour
            beyond = [row for row in range(rows) if (heatmap.cells[row][0] or 0) > 1e3]
            assert [heatmap.rows[row] for row in beyond] == [ROOT_LABEL, "amp", "fc2"]
            for row in beyond:
                assert _near({colours[1][row]}, "#fde725", tolerance=2), heatmap.rows[row]  # viridis at 1.0
    heatmap = build_heatmap(read_blocks(runs[0]))
    fc1 = heatmap.rows.index("fc1")
    assert colours[0][fc1] == colours[1][fc1]
    capsys.readouterr()
    assert main(["plot", runs[0], "-o", str(tmp_path / "x.png"), "--vmin", "10", "--vmax", "1"]) == 2
    assert "--vmin must be below --vmax, got 10 and 1" in capsys.readouterr().err
    assert main(["plot", runs[0], "-o", str(tmp_path / "x.png"), "--vmin", "0"]) == 2
    assert "argument --vmin: expected a finite abs max > 0, got '0'" in capsys.readouterr().err


def test_smallest_normals_are_torchs() -> None:
    for name, value in SMALLEST_NORMAL.items():
        assert value == torch.finfo(getattr(torch, name)).smallest_normal, name


# --------------------------------------------------------------------------------------------------------------------
# --kind lines: the modules closest to the dtype's max, over the batches


@pytest.mark.slow
def test_lines_show_the_modules_closest_to_the_max(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    trace = str(trace_path(tmp_path))
    png = tmp_path / "lines.png"
    capsys.readouterr()
    assert main(["plot", trace, "-o", str(png), "--kind", "lines", "--top", "3", "--dpi", "80"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {png} (png, ")
    assert out.endswith(", 3 of 5 modules, 3 batches)\n")
    heatmap = build_heatmap(read_blocks(trace))
    result = draw_lines(heatmap, tmp_path / "again.png", dtype="float16", top=3, dpi=80)
    # amp made the inf at batch 2; fc2 and the model's output got it from amp: closest first.
    assert result.modules == ("amp", "fc2", ROOT_LABEL)
    assert result.dtype_max_on_scale
    pixels = image.imread(str(png))
    assert pixels.shape[:2] == (result.height, result.width)
    # float16's max is drawn across the axes in red, at its height on the log scale.
    left, top, width, height = result.cells
    y = top + (result.high - math.log10(65504)) / (result.high - result.low) * height
    right_half = range(int(left + width / 2), int(left + width) - 5, 3)  # away from the label at the left
    found = {_pixel(png, x, y + dy) for x in right_half for dy in range(-3, 4)}
    assert _near(found, INF_COLOUR)


def test_lines_of_a_finite_run_rank_by_abs_max(tmp_path: Path) -> None:
    trace = _float32_trace_near_float16_max(tmp_path)
    heatmap = build_heatmap(read_blocks(str(trace)))
    result = draw_lines(heatmap, tmp_path / "f16.svg", dtype="float16", top=2)
    peaks = {name: max(v or 0.0 for v in cells) for name, cells in zip(heatmap.rows, heatmap.cells, strict=True)}
    assert list(result.modules) == sorted(peaks, key=lambda name: -peaks[name])[:2]
    assert result.format == "svg"
    assert (tmp_path / "f16.svg").read_bytes().startswith(b"<?xml")
    far = draw_lines(heatmap, tmp_path / "f32.png", dtype="float32")
    assert not far.dtype_max_on_scale  # 3.4e38 is 33 decades above these numbers: not drawn, said in the title
    assert len(far.modules) == 5


# --------------------------------------------------------------------------------------------------------------------
# Forward values and gradients drawn apart (--direction)


class _Mixed(nn.Module):
    """float32 layers around a float16 middle: the forward is marked against float16's max, while the float32
    gradients of a loss multiplied by 3e4 pass it (fc2's bias gets 1.2e5) without ever being float16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.half_ = Cast(torch.float16)
        self.act = nn.Tanh()
        self.float_ = Cast(torch.float32)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.float_(self.act(self.half_(self.fc1(x)))))


def _gradients_trace(report_dir: Path) -> Path:
    torch.manual_seed(0)
    model = _Mixed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8)
    watching = {"trace_batch_nums": [0, 1], "report_dir": report_dir, "watch_gradients": True}
    with nanwatch.watch(model, optimizer=optimizer, **watching) as handle:
        for _ in range(2):
            (model(x).sum() * 3e4).backward()
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
    return trace_path(report_dir)


def _maxima(blocks: list[Any], directions: set[str]) -> dict[tuple[str, int], float]:
    found: dict[tuple[str, int], float] = {}
    for record in (r for block in blocks for r in block.records):
        if record.direction.value in directions and record.abs_max is not None and "float" in (record.dtype or ""):
            key = (record.module or ROOT_LABEL, record.batch)
            found[key] = max(found.get(key, 0.0), float(record.abs_max))
    return found


def test_forward_values_and_gradients_are_drawn_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the gradients joined the forward's cells, so fc2 and the model showed 1.2e5, outlined in red as above
    # float16's max, though no forward value came near it and those gradients are float32.
    trace = _gradients_trace(tmp_path)
    blocks = read_blocks(str(trace))
    model_rows = [ROOT_LABEL, "fc1", "half_", "act", "float_", "fc2"]
    forward = build_heatmap(blocks)
    assert forward.rows == model_rows
    assert forward.dtypes == ["float16", "float32"]
    expected = _maxima(blocks, {"forward", "recompute"})
    assert {
        (row, batch): forward.cells[r][c] for r, row in enumerate(forward.rows) for c, batch in enumerate([0, 1])
    } == expected
    assert max(expected.values()) < 3  # nothing near float16's max in the forward
    assert forward.direction == "forward"
    backward_lines = sum(1 for block in blocks for r in block.records if r.direction.value == "backward")
    assert forward.left_out == backward_lines > 0

    gradients = build_heatmap(blocks, direction="backward")
    assert gradients.direction == "backward"
    assert gradients.rows == model_rows  # in model order, although autograd produced them the other way round
    expected = _maxima(blocks, {"backward"})
    assert {
        (row, batch): gradients.cells[r][c] for r, row in enumerate(gradients.rows) for c, batch in enumerate([0, 1])
    } == expected
    assert expected[("fc2", 0)] > 65504  # fc2's bias gradient, float32
    assert gradients.dtypes == ["float16", "float32"]  # the gradients through the float16 middle are float16
    assert gradients.returned[gradients.rows.index("fc2")] < gradients.returned[gradients.rows.index("fc1")]

    # Each is drawn against the tightest dtype of its own values, and says what it shows.
    drawn = draw_heatmap(forward, tmp_path / "forward.png", dpi=60)
    assert (drawn.direction, drawn.dtype) == ("forward", "float16")
    drawn = draw_heatmap(gradients, tmp_path / "gradients.png", dpi=60)
    assert (drawn.direction, drawn.dtype) == ("backward", "float16")
    lines = draw_lines(gradients, tmp_path / "lines.png", dtype="float32", top=2, dpi=60)
    assert (lines.direction, lines.modules) == ("backward", ("fc2", "fc1"))

    capsys.readouterr()
    png = tmp_path / "cli.png"
    assert main(["plot", str(trace), "-o", str(png), "--dpi", "60"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith(", 6 modules, 2 batches)\n")
    assert err == (
        f"nanwatch plot: note: {trace} also holds {backward_lines} gradient lines (watch_gradients), not drawn here; "
        "--direction backward draws them\n"
    )
    assert main(["plot", str(trace), "-o", str(png), "--dpi", "60", "--direction", "backward"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith(", gradients, 6 modules, 2 batches)\n")
    assert err == ""


def test_direction_backward_without_gradients_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    png = tmp_path / "x.png"
    capsys.readouterr()
    assert main(["plot", str(trace_path(tmp_path)), "-o", str(png), "--direction", "backward"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "nanwatch plot: nothing to plot in the backward direction: the file holds no gradient line (they are "
        "recorded with watch_gradients=True); see nanwatch plot --help\n"
    )
    assert main(["plot", str(trace_path(tmp_path)), "-o", str(png), "--direction", "sideways"]) == 2
    assert "argument --direction: invalid choice: 'sideways'" in capsys.readouterr().err
    assert not png.exists()
