"""Buffers that hold inf/nan by design: what the checkpoint guard lets through, and nothing more.

A GPT-style model keeps its additive causal mask as a buffer (`register_buffer("mask", torch.full((T, T),
-inf).triu(1))`): -inf above the diagonal from `__init__` on, saved in every checkpoint. That is a mask, not poison.
So each buffer of the watched model is looked at once, when watching begins (or at the first checkpoint after it was
registered): one that holds inf/nan then keeps its `non_finite_kinds` as the pattern it may hold. At every checkpoint
it must hold inf/nan nowhere else and of no other kind (nan where -inf was, -inf where 0 was: refused). A buffer that
was finite then is checked like a weight: finite or refused. A model without such a buffer costs one set lookup per
buffer name per checkpoint.

A framework hands the guard the model's tensors under names of its own: `state_dict.model.attn.mask` (Lightning's
checkpoint, its LightningModule's `model`), `models[0].module.attn.mask` (Accelerate's prepared model under DDP), or
copies of them (a state dict moved to the CPU). A tensor of the checkpoint is that buffer when it is the buffer's own
storage, or when its place ends with the buffer's name (the longest of the model's buffer names that it ends with:
`state_dict.sub.mask` is `sub.mask`, not `mask`); its shape must be the buffer's too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanwatch.core.stats.finite import KnownKinds, non_finite_kinds
from nanwatch.core.stats.sharded import local_shard
from nanwatch.core.torch_glue.hooks import clean_name

__all__ = ["BufferMasks"]


@dataclass
class _Mask:
    """A buffer that held inf/nan when first seen: its name in the model, and where it held which kind."""

    name: str  # as `named_buffers()` says it (wrappers' components included): `get_buffer` finds it
    kinds: torch.Tensor  # `non_finite_kinds`, on the device the buffer was last checked on


class BufferMasks:
    """The watched model's buffers as first seen: their names, and the pattern of each that held inf/nan."""

    def __init__(self) -> None:
        self._names: set[str] = set()  # every buffer seen, by clean name (no wrappers' components)
        self._masks: dict[str, _Mask] = {}  # by clean name
        self._shapes: set[torch.Size] = set()  # the masks' shapes: a tensor of another is no mask, at no more cost

    def learn(self, model: torch.nn.Module) -> None:
        """Look at each buffer not seen before, once: one host read for all of them, and a pattern kept for each that
        holds inf/nan (one per storage: a mask every layer shares is kept once, under each of its names)."""
        # Every name of a buffer that several modules share (one mask for every layer): a state dict has each.
        new: list[tuple[str, str, torch.Tensor]] = []
        for name, buffer in model.named_buffers(remove_duplicate=False):
            clean = clean_name(name)
            if clean in self._names:
                continue
            tensor = local_shard(buffer).detach()
            if tensor.is_meta or tensor.numel() == 0:  # not filled in yet: looked at when it is
                continue
            self._names.add(clean)
            if tensor.is_floating_point():
                new.append((name, clean, tensor))
        if not new:
            return
        with torch.no_grad():
            flags = _all_finite([tensor for _, _, tensor in new])
        kept: dict[tuple[int, torch.Size, torch.device], torch.Tensor] = {}
        for (name, clean, tensor), all_finite in zip(new, flags, strict=True):
            if all_finite:
                continue
            key = (tensor.data_ptr(), tensor.shape, tensor.device)
            kinds = kept.get(key)
            if kinds is None:
                kinds = kept[key] = non_finite_kinds(tensor)
            self._masks[clean] = _Mask(name, kinds)
            self._shapes.add(tensor.shape)

    def known(self, model: torch.nn.Module) -> KnownKinds | None:
        """For `non_finite_tensors`: the pattern each tensor of a checkpoint of `model` may hold (None: no mask)."""
        if not self._masks:  # the common case: every buffer was finite, nothing to tell apart
            return None
        by_storage = self._by_storage(model)

        def expected(where: str, tensor: torch.Tensor) -> torch.Tensor | None:
            if tensor.shape not in self._shapes:
                return None
            key = by_storage.get((tensor.data_ptr(), tensor.shape)) or self._by_name(where)
            mask = self._masks.get(key) if key is not None else None
            if mask is None or mask.kinds.shape != tensor.shape:
                return None  # a weight, a finite buffer, or a mask resized since: finite or refused
            if mask.kinds.device != tensor.device:  # moved since (`model.to(device)`): moved once, kept there
                mask.kinds = mask.kinds.to(tensor.device)
            return mask.kinds

        return expected

    def _by_storage(self, model: torch.nn.Module) -> dict[tuple[int, torch.Size], str]:
        """Each mask buffer's storage now (a module's `state_dict()` shares it), by its clean name."""
        found = {}
        for clean, mask in self._masks.items():
            try:
                buffer = local_shard(model.get_buffer(mask.name))
            except AttributeError:  # removed since: its name may still match a copy
                continue
            if buffer.device.type != "meta":
                found[(buffer.data_ptr(), buffer.shape)] = clean
        return found

    def _by_name(self, where: str) -> str | None:
        """The longest buffer name `where` ends with, on a dot: `state_dict.model.0.mask` -> `model.0.mask`."""
        parts = where.split(".")
        for start in range(len(parts)):
            candidate = ".".join(parts[start:])
            if candidate in self._names:
                return candidate
        return None


def _all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each of `tensors` holds only finite values: one host read per device."""
    flags = [(non_finite_kinds(tensor) == 0).all() for tensor in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for index, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(index)
    found = [True] * len(tensors)
    for indices in by_device.values():
        for index, value in zip(indices, torch.stack([flags[i] for i in indices]).tolist(), strict=True):
            found[index] = bool(value)
    return found
