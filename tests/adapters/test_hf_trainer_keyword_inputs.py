"""Keyword inputs in an adapter: the transformers Trainer calls the model as `model(**inputs)`, and a nan that comes in
through `pixel_values` is blamed on that input. A real Trainer, a tiny random ViT, the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.models import tiny_vit
from tests.report_lines import cause_tail

from nanwatch import NonFiniteError

transformers = pytest.importorskip("transformers")

from nanwatch.adapters.hf_trainer import OverflowTrainerCallback  # noqa: E402


class Images(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random 8x8 images; those at or after `poisoned_from` hold a nan pixel."""

    def __init__(self, size: int, poisoned_from: int) -> None:
        self.size, self.poisoned_from = size, poisoned_from

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pixels = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(index))
        if index >= self.poisoned_from:
            pixels[0, 3, 3] = float("nan")
        return {"pixel_values": pixels, "labels": torch.tensor(index % 3)}


def test_the_trainer_reports_a_nan_in_pixel_values_as_bad_input_data(tmp_path: Path) -> None:
    model = tiny_vit()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=0.01,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    # Every image is poisoned: the first micro-batch holds the nan, whichever order the Trainer samples in.
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Images(16, poisoned_from=0), callbacks=[OverflowTrainerCallback()]
    )
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    error = caught.value
    assert error.batch_number == 0
    assert error.culprit is not None
    assert error.culprit.message == (
        "nan entered through input.pixel_values of the top-level model (ViTForImageClassification)"
    )
    assert error.module_name == "vit.embeddings.patch_embeddings.projection"  # the first frame that holds it
    # The cause: the nan is in the micro-batch's pixel_values (each of the 4 images holds one, at [0, 3, 3]); no
    # rerun, so no capsule (and no report_dir). Then the culprit line, the report's last.
    assert error.cause is not None
    assert (error.cause.kind, error.cause.module_name) == ("data", "")
    assert error.cause.details["inputs"] == [
        {"label": "input.pixel_values", "count": 4, "positions": [[i, 0, 3, 3] for i in range(4)]}
    ]
    assert error.capsule is None
    assert error.report.splitlines()[-3:] == cause_tail(error)
