"""Summary mode and scope in a hand-written loop: `handle.summary()` and `summary_every_n_batches` from `step()`."""

from __future__ import annotations

import pytest
import torch
from tests.models import small_mlp
from torch import nn

import nanwatch


def _summaries(log: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in log.records if r.getMessage().startswith("nanwatch summary")]


def test_summary_returns_the_metrics_and_logs_them(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = small_mlp(scale=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, optimizer=optimizer) as handle:
        assert handle.summary() == {}  # nothing checked yet
        x = torch.randn(3, 4) * 30
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()  # the guard checks here: the forward's frames are checked clean
        optimizer.zero_grad()
        handle.step()
        metrics = handle.summary()

    assert set(metrics) == {
        "nanwatch/absmax/0",
        "nanwatch/absmax/1",
        "nanwatch/absmax/2",
        "nanwatch/absmax/(root)",
        "nanwatch/absmax_global",
        "nanwatch/batch_number",
    }
    assert metrics["nanwatch/absmax/(root)"] == pytest.approx(float(x.abs().max()), rel=1e-6)
    assert metrics["nanwatch/absmax_global"] == max(v for k, v in metrics.items() if "/absmax/" in k)
    assert metrics["nanwatch/batch_number"] == 0.0
    logged = _summaries(nanwatch_log)
    assert len(logged) == 1
    assert logged[0].startswith("nanwatch summary of batch_number=0: largest abs max ")


def test_step_logs_a_summary_every_n_batches(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = small_mlp(scale=False)
    with nanwatch.watch(model, summary_every_n_batches=3) as handle:
        for _ in range(7):
            model(torch.randn(2, 4)).sum().backward()
            handle.step()
    logged = _summaries(nanwatch_log)
    assert [line.splitlines()[0].split(":")[0] for line in logged] == [
        "nanwatch summary of batch_number=2",
        "nanwatch summary of batch_number=5",
    ]


def test_a_ddp_wrapped_model_is_summarised_under_its_own_names() -> None:
    # DataParallel stands in for DDP (the same unwrapping) without a process group.
    model = small_mlp(scale=False)
    with nanwatch.watch(nn.DataParallel(model), include_modules=["0", "2"]) as handle:
        model(torch.randn(2, 4)).sum().backward()
        handle.step()
        metrics = handle.summary()
    assert sorted(metrics) == [
        "nanwatch/absmax/0",
        "nanwatch/absmax/2",
        "nanwatch/absmax_global",
        "nanwatch/batch_number",
    ]
