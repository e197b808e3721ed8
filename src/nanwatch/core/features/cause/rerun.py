"""Running a kept micro-batch again, eagerly, with nanwatch's hooks out of the way, to capture the culprit's call.

Only on a detection. The run leaves no trace: the random generators and every buffer of the model (a BatchNorm's
running statistics) are put back as they were before it, no gradient is recorded, and it runs the model inside any
DDP or torch.compile wrapper, with compiled code run eagerly, so it issues no collective and compiles nothing. A
model whose weights are sharded (FSDP) is not run again: gathering them would take collectives of nanwatch's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from nanwatch.core.features.cause.compiled import running_eagerly
from nanwatch.core.features.cause.hooks import no_forward_hooks
from nanwatch.core.features.cause.keeping import same_values
from nanwatch.core.features.cause.records import CulpritCall, KeptCall
from nanwatch.core.model_state import generators as own_generators
from nanwatch.core.model_state.attributes import keep_attributes
from nanwatch.core.runstate import autocast_as, autocast_state, capture_rng_states, restore_rng_states
from nanwatch.core.torch_glue.compiler import compiled_inner
from nanwatch.core.torch_glue.hooks import HookSet, wrapped_module

__all__ = ["NotRerun", "eager_module", "rerun_culprit", "sharded"]


class NotRerun(Exception):
    """The micro-batch could not be run again; the message says why (it ends up in the cause's evidence)."""


def eager_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module a call of `module` runs, without DDP/DataParallel, FSDP1 or torch.compile wrappers around it."""
    while True:
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
            continue
        inner = compiled_inner(module) or wrapped_module(module)
        if inner is None:
            return module
        module = inner


def sharded(model: torch.nn.Module) -> bool:
    """Whether the model's weights are sharded across ranks (FSDP1 flat parameters, FSDP2/DTensor parameters)."""
    for param in model.parameters():
        kind = type(param).__name__
        if kind in ("FlatParameter", "DTensor") or hasattr(param, "_local_tensor"):
            return True
    return any(type(module).__name__ == "FullyShardedDataParallel" for module in model.modules())


def rerun_culprit(
    calls: list[KeptCall], culprit: torch.nn.Module, hooks: HookSet, *, weights_changed: bool
) -> CulpritCall:
    """Run the kept calls again in order, eagerly, until the culprit's output comes out non-finite (else the last
    call in which it ran): its captured call.

    Raises:
        NotRerun: no call was kept, an input changed since, the weights are sharded, the culprit did not run, or the
            rerun failed.
    """
    if not calls:
        raise NotRerun("no forward of this micro-batch was kept (it did not go through the watched model's call)")
    if any(call.changed() for call in calls):
        raise NotRerun("an input of the forward was changed in place after the call")
    if weights_changed:
        raise NotRerun(
            "the weights changed after the forward (an optimizer step ran before this check: pass the optimizer to "
            "nanwatch so the check comes first)"
        )
    root = eager_module(calls[0].module)
    if sharded(root):
        raise NotRerun("the model's weights are sharded (FSDP): running it again would need collectives")
    found: CulpritCall | None = None
    for call in calls:
        captured = _run_once(call, culprit, hooks)
        if captured is not None:
            found = captured
            if not captured.output_finite:
                break
    if found is None:
        raise NotRerun("the culprit module did not run when its micro-batch was run again")
    return found


def _run_once(call: KeptCall, culprit: torch.nn.Module, hooks: HookSet) -> CulpritCall | None:
    captured: list[CulpritCall] = []
    pending: list[CulpritCall] = []

    def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not captured:
            buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
            pending.append(
                CulpritCall(
                    culprit,
                    _copied(args),
                    _copied(kwargs),
                    autocast_state(),
                    None,
                    True,
                    None,
                    buffers,
                    capture_rng_states(),
                )
            )

    def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if captured or not pending:
            return
        began = pending[-1]
        floats = [leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
        finite = all(bool(torch.isfinite(leaf).all()) for leaf in floats)
        magnitudes = [float(leaf.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) for leaf in floats if leaf.numel()]
        captured.append(
            dataclasses.replace(
                began,
                output_dtype=floats[0].dtype if floats else None,
                output_finite=finite,
                output_abs_max=max(magnitudes) if magnitudes else None,
            )
        )

    root = eager_module(call.module)
    with (
        _leaves_no_trace(root),
        hooks.suspended(),
        no_forward_hooks(root),
        running_eagerly(),
        autocast_as(call.autocast),
        torch.no_grad(),
    ):
        restore_rng_states(call.rng)
        for kept in call.buffers:  # the state the forward began in (put back after the run with everything else)
            kept.buffer.copy_(kept.saved)
        handles = [
            culprit.register_forward_pre_hook(before, with_kwargs=True),
            culprit.register_forward_hook(after, with_kwargs=True),
        ]
        try:
            root(*call.args, **call.kwargs)
        except Exception as error:
            if not captured:
                raise NotRerun(f"running the micro-batch again failed: {error!r}") from error
        finally:
            for handle in handles:
                handle.remove()
    return captured[0] if captured else None


def _copied(value: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone(), value)


@contextlib.contextmanager
def _leaves_no_trace(model: torch.nn.Module) -> Iterator[None]:
    """Every buffer of `model`, the modules' plain attributes, the generators they hold and the global ones as they
    were before the block, whatever it does (the rerun runs the live model)."""
    rng = capture_rng_states(numpy=True)
    generators = own_generators.held_by(model)
    own = own_generators.capture(generators)
    restore_attributes = keep_attributes(model)
    # Each buffer and a copy: one the run changed is written back (compared by value: a BatchNorm kernel writes its
    # running statistics without moving their version counter).
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                if not same_values(buffer, saved):
                    buffer.copy_(saved)
        restore_attributes()
        own_generators.restore(generators, own)
        restore_rng_states(rng)
