"""core/stats/registry.py: a statistic declared in one place reaches every output.

The toy statistic below is declared in this module and nowhere else: registering it is all it takes for watchers to
launch its kernel and for the text report, the JSON report, JSON Lines, `nanwatch show`, `nanwatch diff` and the
summaries to carry it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.cli import main
from nanwatch.core.config import WatchConfig
from nanwatch.core.formats.jsonl_reader import read_records
from nanwatch.core.stats import Column, Statistic, registry
from nanwatch.core.stats.base import Kernel, Values


class PositiveCount(Statistic):
    """How many values of a floating-point tensor are > 0 (a toy: sign-flipped tensors share their abs range)."""

    name = "positive"
    columns = (Column("positives", integer=True),)
    summary_metric = "positives"

    def kernel(self, config: WatchConfig) -> Kernel | None:
        def launch(tensor: torch.Tensor) -> torch.Tensor | None:
            return (tensor > 0).sum().reshape(1) if tensor.is_floating_point() else None

        return launch

    def format(self, values: Values) -> str | None:
        return f"positives={values[0]}"

    def summary_value(self, values: Values | None) -> float | None:
        return None if values is None or values[0] is None else float(values[0])


@pytest.fixture
def toy() -> Iterator[PositiveCount]:
    statistic = registry.register(PositiveCount())
    try:
        yield statistic
    finally:
        registry.unregister(statistic)


def _run(report_dir: Path, x: torch.Tensor, *, inf: bool) -> None:
    model = nn.Sequential(nn.Identity(), nn.Identity())
    with nanwatch.watch(model, trace_batch_nums=[0], report_dir=report_dir) as handle:
        model(x)
        if not inf:
            handle.step()
            return
        model(torch.where(x > 0, x, torch.tensor(float("inf"))))
        with pytest.raises(nanwatch.NonFiniteError):
            handle.step()


def test_a_toy_statistic_reaches_every_output(
    toy: PositiveCount, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = torch.tensor([[1.0, -2.0, 3.0]])
    _run(tmp_path, x, inf=True)
    text = (tmp_path / "nanwatch-report-rank0-batch0.txt").read_text()
    assert "1.00e+00 3.00e+00 input[0]  positives=2\n" in text  # the text report (and so the log and the error)
    report = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text())
    first = report["frames"][0]["entries"][0]
    assert first["positive"] == {"positives": 2}  # the JSON report
    records = read_records(tmp_path / "nanwatch-report-rank0-batch0.jsonl")
    assert records[0].column("positives") == 2  # JSON Lines
    raw = json.loads((tmp_path / "nanwatch-report-rank0-batch0.jsonl").read_text().splitlines()[0])
    assert raw["positives"] == 2
    assert main(["show", str(tmp_path / "nanwatch-report-rank0-batch0.jsonl")]) == 0
    assert capsys.readouterr().out == text  # `nanwatch show`: the .txt, byte for byte, positives included


def test_a_toy_statistic_decides_a_diff_the_abs_range_cannot(
    toy: PositiveCount, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = torch.tensor([[1.0, -2.0, 3.0]])
    _run(tmp_path / "a", x, inf=False)
    _run(tmp_path / "b", -x, inf=False)  # the same abs range everywhere, other signs
    a, b = (str(tmp_path / run / "nanwatch-trace-rank0.jsonl") for run in ("a", "b"))
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "first divergence at line 1 of 6: '0' (Identity) input[0]" in out
    assert "(positives 2 in A, 1 in B)" in out
    assert "A: positives=2  B: positives=1" in out  # the lines around it show the statistic too
    assert main(["diff", a, a]) == 0


def test_a_toy_statistic_joins_the_summaries(toy: PositiveCount) -> None:
    model = nn.Sequential(nn.Identity())
    with nanwatch.watch(model) as handle:
        model(torch.tensor([1.0, -2.0, 3.0]))
        handle.step()
        metrics = handle.summary()
    assert metrics["nanwatch/positives/0"] == 2.0
    assert metrics["nanwatch/absmax/0"] == 3.0


def test_registering_checks_names_and_columns(toy: PositiveCount) -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register(PositiveCount())

    class Clash(Statistic):
        name = "clash"
        columns = (Column("abs_max"),)

    class Reserved(Statistic):
        name = "reserved"
        columns = (Column("label"),)

    for statistic in (Clash(), Reserved()):
        with pytest.raises(ValueError, match="column names taken"):
            registry.register(statistic)
    with pytest.raises(TypeError, match="takes a nanwatch Statistic"):
        registry.register("positives")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be removed"):
        registry.unregister(registry.lead())
    assert [s.name for s in registry.statistics()] == ["abs_range", "non_finite_counts", "underflow", "positive"]


def test_the_reserved_names_are_the_fields_of_a_record_and_a_report_entry(tmp_path: Path) -> None:
    x = torch.tensor([[1.0, float("inf")]])
    _run(tmp_path, x, inf=True)
    record = json.loads((tmp_path / "nanwatch-report-rank0-batch0.jsonl").read_text().splitlines()[0])
    columns = {column.name for statistic in registry.statistics() for column in statistic.columns}
    assert set(record) - columns <= registry.RESERVED_COLUMNS
    entry = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text())["frames"][0]["entries"][0]
    names = {s.name for s in registry.statistics()}
    assert set(entry) - columns - names <= registry.RESERVED_COLUMNS
