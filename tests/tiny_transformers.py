"""Small transformers models with random weights, shared by the tests that need the same one (no download)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_vit() -> Any:
    """A one-layer ViT classifier for 3x8x8 images and 3 labels, seeded: the same weights at every call."""
    import transformers

    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(config)
