"""What nanwatch reads of an optimizer about to step: the gradients it will apply, and whether it skips the step."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_

import torch

__all__ = ["gradients_to_apply", "skips_this_step"]

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
    return isinstance(found_inf, torch.Tensor) and bool(found_inf.sum() > 0)
