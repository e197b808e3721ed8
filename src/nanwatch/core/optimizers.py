"""What nanwatch reads of an optimizer about to step: the gradients it will apply, and whether it skips the step."""

from __future__ import annotations

import inspect
import weakref
from itertools import repeat
from operator import attrgetter, is_

import torch

__all__ = ["gradients_to_apply", "hand_flag", "handed_flag", "skips_this_step", "take_back_flag", "takes_device_flag"]

# The flag nanwatch handed each optimizer for the step under way (`hand_flag`), by optimizer, held weakly.
_HANDED: weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.Tensor] = weakref.WeakKeyDictionary()
# Whether each optimizer takes such a flag (`takes_device_flag`), by optimizer, held weakly.
_TAKES: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()

_grad_of = attrgetter("grad")


def gradients_to_apply(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters of the optimizer's groups that have a gradient, and their gradients, read now.

    Read at step time, so a parameter unfrozen after watching began, or a group added later, is covered too. Read at
    every step of a long run: the gradients are read and tested in C (one Python step per parameter, not four). The
    parameters may be the optimizer's own list: read it, never change it.
    """
    groups = optimizer.param_groups
    # One group (the common case): its own list, not a copy (the guard compares it with the one it planned for).
    params = groups[0]["params"] if len(groups) == 1 else [param for group in groups for param in group["params"]]
    grads = list(map(_grad_of, params))
    if any(map(is_, grads, repeat(None))):  # some have none (frozen, or unused this step): left out
        kept = [(param, grad) for param, grad in zip(params, grads, strict=True) if grad is not None]
        params, grads = [param for param, _ in kept], [grad for _, grad in kept]
    return params, grads


def skips_this_step(optimizer: torch.optim.Optimizer | None) -> bool:
    """True when a `GradScaler` told this optimizer its gradients hold inf/nan, so it applies nothing this step.

    Optimizers that unscale in their own step (fused Adam: `_step_supports_amp_scaling`) are called on every step
    with `found_inf` set; a plain optimizer is never called for a step the scaler skips. One scalar read, on AMP's
    fused path only.
    """
    found_inf = getattr(optimizer, "found_inf", None) if optimizer is not None else None
    if optimizer is not None and found_inf is not None and found_inf is _HANDED.get(optimizer):
        return False  # nanwatch's own flag, left by a step that raised: not the scaler's word
    return isinstance(found_inf, torch.Tensor) and bool(found_inf.sum() > 0)


def takes_device_flag(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this optimizer skips its own update when handed a device-side `found_inf` (1.0: skip), as
    `torch.amp.GradScaler` hands it: torch's fused optimizers, and any that declares `_step_supports_amp_scaling` and
    reads `found_inf` as an attribute (not through the older `grad_scaler` keyword of its step)."""
    known = _TAKES.get(optimizer)
    if known is None:
        known = _TAKES[optimizer] = _takes_device_flag(optimizer)  # asked at every micro-batch: once per optimizer
    return known


def _takes_device_flag(optimizer: torch.optim.Optimizer) -> bool:
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    try:
        return "grad_scaler" not in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False


def hand_flag(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> bool:
    """Hand `flag` (a 0-d float32 tensor: 1.0 to skip, 0.0 to apply) to the optimizer for its next step, as the
    GradScaler does; False (nothing handed) when a scaler already handed one this step. An attribute of this
    optimizer object, for this step only (`take_back_flag`); never one of its class."""
    if getattr(optimizer, "found_inf", None) is not None and not _ours(optimizer):
        return False
    optimizer.found_inf = flag  # type: ignore[attr-defined]
    _HANDED[optimizer] = flag
    return True


def handed_flag(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The flag nanwatch handed this optimizer for the step under way, or None."""
    return _HANDED.get(optimizer) if _ours(optimizer) else None


def take_back_flag(optimizer: torch.optim.Optimizer, flag: torch.Tensor | None = None) -> None:
    """The step ran (or watching ends): the optimizer is left as it was found. `flag`: only that one (another
    watcher's is left alone)."""
    if _ours(optimizer) and (flag is None or _HANDED.get(optimizer) is flag):
        del optimizer.found_inf  # type: ignore[attr-defined]
        _HANDED.pop(optimizer, None)
    elif not _ours(optimizer):
        _HANDED.pop(optimizer, None)


def _ours(optimizer: torch.optim.Optimizer) -> bool:
    flag = _HANDED.get(optimizer)
    return flag is not None and getattr(optimizer, "found_inf", None) is flag
