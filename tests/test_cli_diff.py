"""`nanwatch diff`: line two traced batches up and name the first line where they diverge."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import nanwatch
from nanwatch.cli import main
from nanwatch.core.jsonl import LineRecord, read_blocks
from nanwatch.diff import compare, divergence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.trace_models import run_amp_net, trace_path  # noqa: E402


def _diff(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(["diff", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_batch_that_overflows_diverges_first_at_the_module_that_overflowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    trace = trace_path(tmp_path)
    status, out, err = _diff([f"{trace}:1", f"{trace}:2"], capsys)
    assert (status, err) == (1, "")
    lines = out.splitlines()
    assert lines[0] == f"A: {trace}:1 (trace of train batch 1, 5 frames, 14 lines, float16)"
    # Same input, same weights: fc1 and act agree; amp multiplies by 1e5 and float16 overflows there.
    assert lines[2].startswith("first divergence at line 8 of 14: 'amp' (Amplify) output: abs max ")
    assert lines[2].endswith(" in A, inf in B (non-finite in B only)")
    assert lines[3] == "first non-finite in A: none"
    assert lines[4] == "first non-finite in B: line 8, 'amp' (Amplify) output"
    marked = [line for line in lines if line.startswith(">")]
    assert len(marked) == 1
    assert marked[0].endswith("inf  output   <- non-finite in B only")
    assert any(line.strip() == "amp Amplify" for line in lines)


def test_identical_batches_and_identical_runs_are_equivalent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path / "one", overflow_at=None, batches=2)
    run_amp_net(tmp_path / "two", overflow_at=None, batches=2)
    one, two = trace_path(tmp_path / "one"), trace_path(tmp_path / "two")
    status, out, _ = _diff([f"{one}:0", f"{one}:1"], capsys)
    assert status == 0
    assert out.splitlines()[-1].startswith("equivalent: 14 lines match within rtol=0.001")
    status, out, _ = _diff([f"{one}:1", f"{two}:1"], capsys)
    assert status == 0
    assert "largest relative difference 0.00e+00" in out


def test_float16_against_float32_diverges_where_float16_overflows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path / "fp16", dtype=torch.float16, overflow_at=0, batches=1)
    run_amp_net(tmp_path / "fp32", dtype=torch.float32, overflow_at=0, batches=1)
    half, full = trace_path(tmp_path / "fp16"), trace_path(tmp_path / "fp32")
    # float16 rounds every number to 11 bits: 1e-2 lets those differences through, and only the overflow counts.
    status, out, _ = _diff([str(half), str(full), "--rtol", "1e-2"], capsys)
    assert status == 1
    assert "first divergence at line 8 of 14: 'amp' (Amplify) output: abs max inf in A, " in out
    assert "(non-finite in A only)" in out
    assert "first non-finite in B: none" in out
    # A tolerance finer than float16's rounding (2**-11 relative) finds that rounding first, at the first weight.
    status, out, _ = _diff([str(half), str(full), "--rtol", "1e-6"], capsys)
    assert status == 1
    first = next(line for line in out.splitlines() if line.startswith("first divergence"))
    assert first.startswith("first divergence at line 1 of 14: 'fc1' (Linear) weight: abs max ")
    assert first.endswith(" > rtol 1e-06)")


def _two_runs_with_different_modules(tmp_path: Path) -> tuple[Path, Path]:
    """One model with a ReLU called `extra` in the middle, one with a Sigmoid called `other` at the end."""
    paths = []
    for extra in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.add_module("lin", torch.nn.Linear(2, 2))
        if extra:
            model.add_module("extra", torch.nn.ReLU())
        model.add_module("tail", torch.nn.Tanh())
        if not extra:
            model.add_module("other", torch.nn.Sigmoid())
        directory = tmp_path / ("extra" if extra else "other")
        with nanwatch.watch(model, trace_batch_nums=[0], report_dir=directory) as handle:
            model(torch.ones(1, 2))
            handle.step()
        paths.append(trace_path(directory))
    return paths[0], paths[1]


def test_lines_without_a_partner_diverge_where_they_ran(tmp_path: Path) -> None:
    a, b = (read_blocks(str(path))[0] for path in _two_runs_with_different_modules(tmp_path))
    result = compare(a, b)
    unmatched = [(row.key[0], row.key[2], row.reason) for row in result.rows if row.a is None or row.b is None]
    assert unmatched == [
        ("extra", "input[0]", "only in A"),
        ("extra", "output", "only in A"),
        ("other", "input[0]", "only in B"),
        ("other", "output", "only in B"),
    ]
    first = result.first
    assert first is not None
    assert result.rows[first].key == ("extra", 0, "input[0]")
    # The root's output differs too (Sigmoid against Tanh), but lines are matched by key, not by position.
    root_output = next(row for row in result.rows if row.key == ("", 0, "output"))
    assert root_output.a is not None
    assert root_output.b is not None


def test_divergence_rules(tmp_path: Path) -> None:
    (block,) = read_blocks(str(_two_runs_with_different_modules(tmp_path)[0]))
    record = block.records[0]

    def with_max(value: float | None) -> LineRecord:
        return replace(record, abs_max=value)

    assert divergence(record, record, rtol=0.0) is None
    a, b = with_max(100.0), with_max(100.05)
    assert divergence(a, b, rtol=1e-3) is None
    assert divergence(a, b, rtol=1e-4) == "relative difference 5.00e-04 > rtol 0.0001"
    assert divergence(a, b, rtol=0.0, atol=0.1) is None
    inf, nan = with_max(math.inf), with_max(math.nan)
    assert divergence(inf, inf, rtol=0.0) is None
    assert divergence(nan, nan, rtol=0.0) is None
    assert divergence(inf, nan, rtol=1.0) == "inf in A, nan in B"
    assert divergence(a, inf, rtol=1.0) == "non-finite in B only"
    assert divergence(nan, a, rtol=1.0) == "non-finite in A only"
    assert divergence(with_max(None), a, rtol=1.0) == "numbers in B only"
    assert divergence(with_max(None), with_max(None), rtol=0.0) is None
    assert divergence(with_max(0.0), with_max(0.0), rtol=0.0) is None


def test_bad_input_exits_2_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=2)
    trace = trace_path(tmp_path)
    status, out, err = _diff([str(trace), str(trace)], capsys)
    assert (status, out) == (2, "")
    assert f"nanwatch diff: error: {trace} holds more than one batch" in err
    assert f"name one as {trace}:BATCH" in err
    status, _, err = _diff([f"{trace}:5", f"{trace}:0"], capsys)
    assert status == 2
    assert "holds no batch 5" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["diff", f"{trace}:0", f"{trace}:1", "--rtol", "-1"])
    assert exit_info.value.code == 2
    assert "expected a finite number >= 0, got '-1'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# The WatchConfig fields diff applies: --config FILE and the generated options


def test_a_config_file_and_options_choose_the_modules_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path, overflow_at=2, batches=3)
    trace = trace_path(tmp_path)
    a, b = f"{trace}:1", f"{trace}:2"
    config = tmp_path / "watch.yaml"
    # Before amp overflows, batches 1 and 2 agree: compared on fc1 and act only, they are equivalent.
    config.write_text("include_modules: [fc1, act]\nwatch_eval: true\n", encoding="utf-8")
    status, out, err = _diff([a, b, "--config", str(config)], capsys)
    assert (status, err) == (0, "")
    assert out.splitlines()[0] == f"A: {a} (trace of train batch 1, 2 frames, 6 lines, float16)"
    assert out.splitlines()[-1].startswith("equivalent: 6 lines match within rtol=0.001")
    # An option beats the file: with every module but amp, the first divergence is fc2's input, past amp.
    status, out, _ = _diff([a, b, "--config", str(config), "--include-modules", "--exclude-modules", "amp"], capsys)
    assert status == 1
    assert "first divergence at line 9 of 12: 'fc2' (Linear) input[0]: abs max " in out
    assert "'amp'" not in out
    # No config: every module, and amp first (as in the test above).
    status, out, _ = _diff([a, b], capsys)
    assert "first divergence at line 8 of 14: 'amp' (Amplify) output" in out


def test_diff_rejects_a_typo_in_the_config_and_says_what_it_does_not_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=2)
    trace = trace_path(tmp_path)
    config = tmp_path / "watch.json"
    config.write_text('{"include_module": ["fc1"]}', encoding="utf-8")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["diff", f"{trace}:0", f"{trace}:1", "--config", str(config)])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"config file {str(config)!r}: unknown field 'include_module' (did you mean 'include_modules'?" in err
    status, out, err = _diff([f"{trace}:0", f"{trace}:1", "--include-modules", "fc9"], capsys)
    assert (status, out) == (2, "")
    assert "include_modules: the pattern 'fc9' matches none of the 5 modules in" in err
    status, _, err = _diff([f"{trace}:0", f"{trace}:1", "--max-frames-to-save", "3"], capsys)
    assert status == 0
    assert err == "nanwatch diff: note: --max-frames-to-save is not used by diff (see nanwatch diff --help)\n"
