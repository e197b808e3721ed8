"""Summary mode with a real `Accelerator`: the abs max per module reaches the other trackers via `accelerator.log`."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402
from tests.models import small_mlp  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from nanwatch.adapters.accelerate import OverflowTracker  # noqa: E402


class RecordingTracker(GeneralTracker):  # type: ignore[misc]
    """A real Accelerate tracker that keeps what it is given, as TensorBoard or W&B would write it."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, Any]]] = []

    @property
    def tracker(self) -> RecordingTracker:
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((step, dict(values)))


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def train(trackers: list[GeneralTracker], overflow: OverflowTracker, micro_batches: int = 8) -> list[float]:
    """The usual loop, gradient accumulation 2; returns the root module's abs max (input or output) per micro-batch."""
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True, log_with=[overflow, *trackers])
    accelerator.init_trackers("summary-test")
    model = small_mlp(scale=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(2 * micro_batches, 4) * 20, torch.randn(2 * micro_batches, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2))
    overflow.attach(accelerator, model)
    root_absmax = []
    for x, y in loader:
        with accelerator.accumulate(model):
            out = model(x)
            root_absmax.append(max(float(x.abs().max()), float(out.detach().abs().max())))
            loss = torch.nn.functional.mse_loss(out, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.end_training()
    return root_absmax


def test_the_summary_reaches_the_other_trackers() -> None:
    recorder = RecordingTracker()
    overflow = OverflowTracker(summary_every_n_batches=2)
    root_absmax = train([recorder], overflow)

    # Micro-batch N ends when N+1's forward starts: the 8th never does, so summaries after 2, 4 and 6 batches,
    # each at the optimizer steps done by then.
    assert [(step, values["nanwatch/batch_number"]) for step, values in recorder.logged] == [
        (1, 1.0),
        (2, 3.0),
        (3, 5.0),
    ]
    for _, values in recorder.logged:
        assert set(values) == {
            "nanwatch/absmax/0",
            "nanwatch/absmax/1",
            "nanwatch/absmax/2",
            "nanwatch/absmax/(root)",
            "nanwatch/absmax/(loss)",  # the loss given to accelerator.backward()
            "nanwatch/absmax_global",
            "nanwatch/batch_number",
        }
        batch = int(values["nanwatch/batch_number"])
        assert values["nanwatch/absmax/(root)"] == root_absmax[batch]
        assert values["nanwatch/absmax_global"] == max(v for k, v in values.items() if "/absmax/" in k)


def test_without_other_trackers_the_summary_goes_to_the_nanwatch_logger(
    nanwatch_log: pytest.LogCaptureFixture,
) -> None:
    train([], OverflowTracker(summary_every_n_batches=3))
    summaries = [r.getMessage() for r in nanwatch_log.records if r.getMessage().startswith("nanwatch summary")]
    assert [line.split(":")[0] for line in summaries] == [
        "nanwatch summary of batch_number=2",
        "nanwatch summary of batch_number=5",
    ]
