"""Keyword inputs (`model(**batch)`, as transformers models are called) are recorded as `input.<name>` lines, and bad
data that came in through one is blamed on it. Real transformers models from small random configs."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
from tests.models import tiny_vit
from torch import nn

import nanwatch
from nanwatch import DebugUnderflowOverflow, NonFiniteError
from nanwatch.core.frames import ResolvedFrame, resolve
from nanwatch.core.report import format_entry

transformers = pytest.importorskip("transformers")


def _images(index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    return {"pixel_values": torch.randn(2, 3, 8, 8, generator=generator), "labels": torch.tensor([0, 2])}


def _lines(frame: ResolvedFrame) -> dict[str, str]:
    return {entry.label: format_entry(entry) for entry in frame.entries}


def test_a_nan_in_a_keyword_tensor_is_blamed_on_that_input_of_the_model() -> None:
    model = tiny_vit()

    def train() -> None:
        with nanwatch.watch(model) as handle:
            for index in range(4):
                batch = _images(index)
                if index == 2:
                    batch["pixel_values"][1, 0, 3, 3] = float("nan")
                model(**batch)
                handle.step()

    with pytest.raises(NonFiniteError) as caught:
        train()
    error = caught.value
    assert error.batch_number == 2
    assert error.module_name == "vit.embeddings.patch_embeddings.projection"  # the first frame that holds it
    assert error.culprit is not None
    assert error.culprit.kind == "model_input"
    assert error.culprit.message == (
        "nan entered through input.pixel_values of the top-level model (ViTForImageClassification)"
    )
    assert error.report.endswith(error.culprit.message)


def test_keyword_tensors_get_lines_of_their_own_after_the_positional_inputs() -> None:
    model = tiny_vit()
    batch = _images(0)
    with nanwatch.watch(model) as handle:
        model(**batch, output_attentions=False, return_dict=True)  # flags get no line
        root = [frame for frame in resolve(handle.watcher.recent_frames()) if frame.module_name == ""][-1]
    labels = [entry.label for entry in root.entries]
    assert labels == ["input.pixel_values", "input.labels", "output.loss", "output.logits"]
    pixels = batch["pixel_values"].abs()
    assert _lines(root)["input.pixel_values"] == f"{pixels.min():8.2e} {pixels.max():8.2e} input.pixel_values"
    assert _lines(root)["input.labels"] == f"{0:8.2e} {2:8.2e} input.labels"


class Mixed(nn.Module):
    """Takes a tensor positionally, and keyword arguments of every kind."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, cache: Any, scale: float, extra: Any) -> torch.Tensor:
        return self.fc(x) * mask * scale


def test_keyword_containers_are_walked_for_their_tensors_and_nothing_else_gets_a_line() -> None:
    torch.manual_seed(0)
    model = Mixed()
    past = (torch.full((2,), -3.0), None)
    with nanwatch.watch(model) as handle:
        model(torch.ones(2, 4), mask=torch.ones(2, 4), cache=past, scale=0.5, extra={"bias": torch.full((1,), 7.0)})
        frame = resolve(handle.watcher.recent_frames())[-1]
    assert [entry.label for entry in frame.entries] == [
        "input[0]",
        "input.mask",
        "input.cache[0]",
        "input.extra.bias",
        "output",
    ]
    assert _lines(frame)["input.cache[0]"] == f"{3:8.2e} {3:8.2e} input.cache[0]"
    assert _lines(frame)["input.extra.bias"] == f"{7:8.2e} {7:8.2e} input.extra.bias"


def test_the_drop_in_still_sees_positional_inputs_only() -> None:
    # transformers' tool prints what its forward hooks see: positional inputs. The drop-in prints the same.
    model = tiny_vit()
    buffer = io.StringIO()
    with DebugUnderflowOverflow(model, trace_batch_nums=[0]) as debug, contextlib.redirect_stdout(buffer):
        model(**_images(0))
    assert debug.batch_number == 1
    assert "input.pixel_values" not in buffer.getvalue()
    assert " ViTForImageClassification\n" in buffer.getvalue()
