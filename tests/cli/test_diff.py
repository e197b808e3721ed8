"""`nanwatch diff`: line two traced batches up and name the first line where they diverge."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tests.trace_models import run_amp_net, trace_path

import nanwatch
from nanwatch.cli import main
from nanwatch.cli.diff import compare, diff_text, divergence
from nanwatch.core.formats.jsonl_reader import Block, read_blocks
from nanwatch.core.formats.jsonl_schema import LineRecord
from nanwatch.core.stats import registry
from nanwatch.core.stats.base import Column, Statistic, Values


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
    assert divergence(a, with_max(None), rtol=1.0) == "numbers in A only"
    assert divergence(with_max(None), with_max(None), rtol=0.0) is None
    assert divergence(with_max(0.0), with_max(0.0), rtol=0.0) is None
    # Beyond atol (and no rtol): the message still gives the relative difference, and rtol as given.
    assert divergence(a, with_max(100.2), rtol=0.0, atol=0.1) == "relative difference 2.00e-03 > rtol 0"
    # Integer tensors (token ids, masks) compare their abs max as numbers too.
    assert divergence(with_max(5), with_max(6), rtol=1e-3) == "relative difference 1.67e-01 > rtol 0.001"
    # Only the abs max is compared: abs min may differ as much as it likes.
    assert divergence(replace(a, abs_min=0.0), replace(a, abs_min=99.0), rtol=0.0) is None


class Negatives(Statistic):
    """A toy statistic: how many elements are negative, printed as `neg=N` after the label."""

    name = "negatives"
    columns = (Column("negatives", integer=True),)

    def format(self, values: Values) -> str | None:
        return f"neg={values[0]}"


@pytest.fixture
def negatives() -> Iterator[Statistic]:
    statistic = registry.register(Negatives())
    yield statistic
    registry.unregister(statistic)


def test_a_registered_statistic_judges_after_the_abs_range_and_prints_after_the_label(
    tmp_path: Path, negatives: Statistic
) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    (block,) = read_blocks(f"{trace_path(tmp_path)}:0")

    def counted(at_line_6: tuple[int] | None, abs_max: float | None = None) -> Block:
        """`block` with negatives=1 on every line but the 6th (act's output), which gets `at_line_6`."""
        records = []
        for index, record in enumerate(block.records):
            stats = {key: value for key, value in record.stats.items() if key != negatives.name}
            values = at_line_6 if index == 5 else (1,)
            if values is not None:
                stats[negatives.name] = values
            if index == 5 and abs_max is not None:
                record = replace(record, abs_max=abs_max)
            records.append(replace(record, stats=stats))
        return replace(block, records=tuple(records))

    a = counted((1,))
    assert compare(a, counted((1,))).first is None
    result = compare(a, counted((2,)))
    assert (result.first, result.diverging) == (5, 1)
    assert result.rows[5].key == ("act", 0, "output")
    assert result.rows[5].reason == "negatives 1 in A, 2 in B"
    lines = diff_text(result, a_name="A", b_name="B", a=a, b=counted((2,))).splitlines()
    assert lines[2].startswith("first divergence at line 6 of 14: 'act' (ReLU) output: abs max ")
    assert lines[2].endswith(" (negatives 1 in A, 2 in B)")
    # Its text follows the label: once where A and B agree, both sides where they do not.
    assert [line for line in lines if line.startswith(">")] == [
        next(line for line in lines if line.endswith("  output  A: neg=1  B: neg=2   <- negatives 1 in A, 2 in B"))
    ]
    assert next(line for line in lines if "input[0]" in line and "act" not in line).endswith("input[0]  neg=1")
    # The abs range judges first: when it diverges too, its reason is the one given.
    assert compare(a, counted((2,), abs_max=1e6)).rows[5].reason.startswith("relative difference ")
    # Measured on one side only (a run without the statistic): nothing to compare.
    assert compare(a, counted(None)).first is None


def test_nan_and_inf_counts_judge_lines_whose_abs_max_agree(tmp_path: Path) -> None:
    (block,) = read_blocks(str(_two_runs_with_different_modules(tmp_path)[0]))
    record = replace(block.records[0], abs_max=math.nan)

    def counts(nan: int, inf: int) -> LineRecord:
        return replace(record, stats={**record.stats, "non_finite_counts": (nan, inf)})

    assert divergence(counts(1, 2), counts(1, 2), rtol=0.0) is None
    assert divergence(counts(1, 2), counts(3, 2), rtol=1.0) == "nan 1 in A, 3 in B"
    assert divergence(counts(1, 2), counts(1, 0), rtol=1.0) == "inf 2 in A, 0 in B"
    # A report does not count its non-finite lines (null): the abs range alone decides, as it always did.
    assert divergence(counts(1, 2), replace(record, stats={}), rtol=0.0) is None
    assert divergence(counts(1, 2), replace(counts(1, 2), abs_max=math.inf), rtol=0.0) == "nan in A, inf in B"


def test_bad_input_exits_2_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_amp_net(tmp_path, overflow_at=None, batches=2)
    trace = trace_path(tmp_path)
    status, out, err = _diff([str(trace), str(trace)], capsys)
    assert (status, out) == (2, "")
    assert f"nanwatch diff: {trace} holds more than one batch" in err
    assert f"name one as {trace}:BATCH" in err
    status, _, err = _diff([f"{trace}:5", f"{trace}:0"], capsys)
    assert status == 2
    assert "holds no batch 5" in err
    assert main(["diff", f"{trace}:0", f"{trace}:1", "--rtol", "-1"]) == 2
    assert capsys.readouterr().err == (
        "nanwatch diff: argument --rtol: expected a finite number >= 0, got '-1'; see nanwatch diff --help\n"
    )


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
    assert main(["diff", f"{trace}:0", f"{trace}:1", "--config", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"config file {str(config)!r}: unknown field 'include_module' (did you mean 'include_modules'?" in err
    status, out, err = _diff([f"{trace}:0", f"{trace}:1", "--include-modules", "fc9"], capsys)
    assert (status, out) == (2, "")
    assert "include_modules: the pattern 'fc9' matches none of the 5 modules in" in err
    status, _, err = _diff([f"{trace}:0", f"{trace}:1", "--max-frames-to-save", "3"], capsys)
    assert status == 0
    assert err == "nanwatch diff: note: --max-frames-to-save is not used by diff (see nanwatch diff --help)\n"


def test_a_file_that_is_not_utf8_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: UnicodeDecodeError and a traceback.
    run_amp_net(tmp_path, overflow_at=None, batches=1)
    trace = trace_path(tmp_path)
    binary = tmp_path / "copied-wrong.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00")
    for a, b in ((trace, binary), (binary, trace)):
        status, out, err = _diff([f"{a}:0", f"{b}:0"], capsys)
        assert (status, out) == (2, "")
        assert err.splitlines() == [
            f"nanwatch diff: {binary} is a binary file (byte 0 is 0x89), not text; diff reads a nanwatch .jsonl "
            f"file: those beside it: {trace.name}"
        ]
