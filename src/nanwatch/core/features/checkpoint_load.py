"""A checkpoint read back is certified before it is trained on: `nanwatch.verify_checkpoint(path)`, and the adapters'
resume paths (`verify_state`).

The check is the checkpoint guard's (core/stats/finite.py: one fused finiteness reduction over every floating-point
tensor, the failing ones named by their key path: `state_dict.net.0.weight`, `optimizer_states[0].state.3.exp_avg`);
only a checkpoint that fails it is looked at again, tensor by tensor, to count its non-finite values and to tell the
masks from the poison.

Masks. The guard on write knows which buffers held inf/nan when watching began (buffer_masks.py). On load there is
no watcher, so:

- given the model (`model=` here, the model itself in the adapters), as it is built before the checkpoint is loaded
  into it: its buffers that hold inf/nan now are masks, known exactly as the guard knows them (the same places, the
  same kind); everything else must be finite;
- without one, a square matrix (its last two dimensions equal) whose values are all 0 or -inf, both present, is
  taken for an additive attention mask (a GPT-style model's `register_buffer("mask", torch.full((T, T),
  -inf).triu(1))`), let through, and said: listed in `VerifiedCheckpoint.masks` and logged. Poison is seldom of
  that form: an overflow leaves inf/nan among finite weights that are not all zero, and a tensor all inf (a bias,
  its Adam moments) is no mask;
- either way, `allow=` names tensors that may hold inf/nan (a key path or its dotted tail: `attn.mask` lets through
  `state_dict.model.h.0.attn.mask`; glob patterns too: `*.attn.bias`).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from nanwatch.core.features.buffer_masks import BufferMasks
from nanwatch.core.formats.checkpoint_files import CheckpointFile, read_checkpoint, state_to_check
from nanwatch.core.log import get_logger
from nanwatch.core.stats.finite import MAX_NAMED, KnownKinds, floating_tensors, non_finite_kinds, non_finite_tensors
from nanwatch.errors import CheckpointReadError, NonFiniteCheckpoint

__all__ = ["ModelMasks", "VerifiedCheckpoint", "verify_checkpoint", "verify_path", "verify_state"]

_KINDS_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint found finite.

    Attributes:
        path: the file or folder verified.
        files: the files read (a folder's, relative to it; the path itself for a file).
        tensors: the floating-point tensors checked (integer tensors hold no inf/nan and are not counted).
        masks: the tensors let through as additive masks (no model given: square, every value 0 or -inf), by key
            path.
        allowed: the tensors that held inf/nan and were let through by `allow=`, by key path.
        skipped: the files of a folder that were not read, each with why (`training_args.bin (...)`).
    """

    path: str
    files: tuple[str, ...]
    tensors: int
    masks: tuple[str, ...] = ()
    allowed: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()


class ModelMasks:
    """The buffers of `models` that hold inf/nan as they are now, before a checkpoint is loaded into them: the masks
    the checkpoint guard would know. One host read per device, once."""

    def __init__(self, models: Iterable[torch.nn.Module]) -> None:
        self._learned: list[tuple[BufferMasks, torch.nn.Module]] = []
        for model in models:
            masks = BufferMasks()
            masks.learn(model)
            self._learned.append((masks, model))

    def known(self) -> KnownKinds | None:
        """For `non_finite_tensors`: the pattern a tensor of the checkpoint may hold, from whichever model has it."""
        found = [known for masks, model in self._learned if (known := masks.known(model)) is not None]
        if len(found) < 2:
            return found[0] if found else None

        def expected(where: str, tensor: torch.Tensor) -> torch.Tensor | None:
            for known in found:
                kinds = known(where, tensor)
                if kinds is not None:
                    return kinds
            return None

        return expected


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    allow: Iterable[str] = (),
    model: torch.nn.Module | None = None,
    weights_only: bool = True,
) -> VerifiedCheckpoint:
    """Check that every floating-point tensor a checkpoint holds is finite, before loading it into a model.

    Args:
        path: a checkpoint file (`torch.save`'s, a Lightning `.ckpt`, a `.safetensors`) or a folder of them
            (Accelerate's `save_state`, the HF Trainer's `checkpoint-N`): every checkpoint file in it is checked.
        allow: tensors that may hold inf/nan, by key path or its dotted tail (`attn.mask`), or a glob pattern.
        model: the model the checkpoint is for, as built, before the checkpoint is loaded into it: its buffers that
            hold inf/nan now (additive masks) may hold the same in the checkpoint, and nothing else may. Without it,
            a square matrix of 0 and -inf is taken for such a mask (and listed in `masks`).
        weights_only: read torch files with `torch.load(weights_only=True)`, which refuses a file that holds Python
            objects other than tensors and plain containers (unpickling runs their code). False only for a file you
            trust.

    Returns:
        A `VerifiedCheckpoint`: the files read, the tensors checked, the masks and allowed tensors let through.

    Raises:
        NonFiniteCheckpoint: a tensor holds inf/nan; the message names the first ones by key path (prefixed by the
            file's name in a folder: `optimizer.bin:state.0.exp_avg`) and counts tensors and values.
        FileNotFoundError: nothing is at `path`.
        CheckpointReadError: `path` is not a checkpoint (nor a folder holding one), or `weights_only=True` refuses it.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"nanwatch: verify_checkpoint(model=...) takes a torch.nn.Module, got {type(model).__name__}")
    target = os.fspath(path)
    return verify_path(
        target,
        described=f"the checkpoint {target!r}",
        outcome="do not load it: resume from an earlier checkpoint",
        masks=ModelMasks([model]) if model is not None else None,
        allow=allow,
        weights_only=weights_only,
    )


def verify_path(
    path: str,
    *,
    described: str,
    outcome: str,
    masks: ModelMasks | None,
    allow: Iterable[str] = (),
    weights_only: bool = True,
    skip_refused: bool = False,
) -> VerifiedCheckpoint:
    """`verify_checkpoint`, its message saying `described` holds inf/nan, then `outcome`. With `skip_refused` (a
    framework's resume, which unpickles what it trusts itself), a file of a folder that `weights_only=True` refuses is
    not checked, and a line says so."""
    names = _allowed_names(allow)
    in_folder = os.path.isdir(path)
    seen = _Seen()
    for item in read_checkpoint(path, weights_only=weights_only, skip_refused=skip_refused):
        if isinstance(item, CheckpointFile):
            seen.files.append(item.name)
            seen.add(item.state, f"{item.name}:" if in_folder else "", masks, names)
            continue
        seen.skipped.append(f"{item.name} ({item.why})")
        if not item.bookkeeping:
            get_logger().info(f"nanwatch: {described}: {item.name} not checked ({item.why})")
    if seen.findings:
        _refuse(path, described, seen, outcome)
    if seen.tensors == 0:
        raise CheckpointReadError(f"nanwatch: {described} holds no floating-point tensor: nothing to verify")
    return seen.verified(path, described)


def verify_state(
    state: Any,
    path: str,
    *,
    described: str,
    outcome: str,
    masks: ModelMasks | None,
    allow: Iterable[str] = (),
) -> VerifiedCheckpoint:
    """`verify_checkpoint` for a checkpoint already read (a Lightning checkpoint's dict) or already loaded into the
    model and optimizer (the HF Trainer's resume): raises `NonFiniteCheckpoint` whose message says `described`
    ("the checkpoint 'x.ckpt' that trainer.fit resumes from") holds inf/nan, then `outcome`."""
    seen = _Seen()
    seen.add(state, "", masks, _allowed_names(allow))
    if seen.findings:
        _refuse(path, described, seen, outcome)
    return seen.verified(path, described)


@dataclass(frozen=True)
class _Finding:
    """A tensor that holds inf/nan: where, which ("nan" if any value is nan, else "inf"), and how many of its
    values."""

    where: str
    word: str
    values: int
    size: int


@dataclass
class _Seen:
    """What the files of one checkpoint held, as they are checked one by one."""

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    findings: list[_Finding] = field(default_factory=list)
    masks: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def add(self, state: Any, prefix: str, masks: ModelMasks | None, allow: tuple[str, ...]) -> None:
        """Check `state` (one file's, its key paths shown after `prefix`)."""
        checked = state_to_check(state)
        known = masks.known() if masks is not None else None
        bad, count = non_finite_tensors(checked, known)
        self.tensors += count
        if not bad:
            return
        # The slow path, for a checkpoint that failed only: its failing tensors looked at one by one.
        tensors = dict(floating_tensors(checked))
        for where, word in bad:
            shown = f"{prefix}{where}"
            if _matches(where, shown, allow):
                self.allowed.append(shown)
                continue
            tensor = tensors[where]
            if masks is None and _additive_mask(tensor):  # no model to tell: its values say it is a mask
                self.masks.append(shown)
                continue
            expected = known(where, tensor) if known is not None else None
            kinds = non_finite_kinds(tensor)
            new = (kinds != 0) if expected is None else (kinds != 0) & (kinds != expected)
            self.findings.append(_Finding(shown, word, int(new.sum()), tensor.numel()))

    def verified(self, path: str, described: str) -> VerifiedCheckpoint:
        if self.masks:
            shown = ", ".join(self.masks[:MAX_NAMED]) + (
                f" and {len(self.masks) - MAX_NAMED} more" if len(self.masks) > MAX_NAMED else ""
            )
            get_logger().info(
                f"nanwatch: {described}: let through as additive masks (square, every value 0 or -inf): {shown}; "
                "allow= names them, model= knows them exactly"
            )
        return VerifiedCheckpoint(
            path, tuple(self.files), self.tensors, tuple(self.masks), tuple(self.allowed), tuple(self.skipped)
        )


def _refuse(path: str, described: str, seen: _Seen, outcome: str) -> NoReturn:
    findings = seen.findings
    shown = ", ".join(f"{f.where} {f.word} ({f.values} of {f.size} values)" for f in findings[:MAX_NAMED])
    more = f" and {len(findings) - MAX_NAMED} more" if len(findings) > MAX_NAMED else ""
    values = sum(finding.values for finding in findings)
    message = (
        f"nanwatch: {described} holds inf/nan: {shown}{more} ({len(findings)} of {seen.tensors} floating-point "
        f"tensors, {values} value{'' if values == 1 else 's'} in all); {outcome}."
    )
    raise NonFiniteCheckpoint(message, path=path, non_finite=[(f.where, f.word) for f in findings])


def _allowed_names(allow: Iterable[str]) -> tuple[str, ...]:
    names = (allow,) if isinstance(allow, str) else tuple(allow)  # one name given alone is one name, not letters
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"nanwatch: allow= takes key paths (str), got {type(name).__name__} {name!r}")
    return names


def _matches(where: str, shown: str, allow: tuple[str, ...]) -> bool:
    """`where` (its key path in its file; `shown` with the file's name) is named by `allow`."""
    return any(
        key == name or key.endswith(f".{name}") or fnmatch.fnmatchcase(key, name)
        for name in allow
        for key in (where, shown)
    )


def _additive_mask(tensor: torch.Tensor) -> bool:
    """A square matrix (in its last two dimensions) of 0 and -inf, both present: what an additive mask holds."""
    if tensor.dim() < 2 or tensor.shape[-1] != tensor.shape[-2]:
        return False
    values = tensor if tensor.dtype in _KINDS_DTYPES else tensor.float()  # float8: no comparison kernels on the CPU
    zero, minus_inf = values == 0, values == -torch.inf
    return bool((zero | minus_inf).all()) and bool(zero.any()) and bool(minus_inf.any())
