"""What nanwatch reads of an optimizer about to step: the gradients it will apply, and whether it skips the step."""

from __future__ import annotations

import torch

__all__ = ["gradients_to_apply", "skips_this_step"]


def gradients_to_apply(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(parameter, gradient)` for every parameter of the optimizer's groups that has a gradient, read now.

    Read at step time, so a parameter unfrozen after watching began, or a group added later, is covered too.
    """
    groups = optimizer.param_groups
    return [(param, grad) for group in groups for param in group["params"] if (grad := param.grad) is not None]


def skips_this_step(optimizer: torch.optim.Optimizer | None) -> bool:
    """True when a `GradScaler` told this optimizer its gradients hold inf/nan, so it applies nothing this step.

    Optimizers that unscale in their own step (fused Adam: `_step_supports_amp_scaling`) are called on every step
    with `found_inf` set; a plain optimizer is never called for a step the scaler skips. One scalar read, on AMP's
    fused path only.
    """
    found_inf = getattr(optimizer, "found_inf", None) if optimizer is not None else None
    return isinstance(found_inf, torch.Tensor) and bool(found_inf.sum() > 0)
