"""torch.compile and hooks: the wrapper's names left out, and compiled code that does not know about the hooks.

- `torch.compile(model)` returns an `OptimizedModule` that holds the model as `_orig_mod`: watched through it, every
  name would read `_orig_mod.encoder.0` and the wrapper would add a frame of its own. `without_compile_wrappers`
  leaves the wrapper out and `_orig_mod` out of the names.
- A hook that the compiled module's `_call_impl` calls (the root of a user's model, compiled at its `forward`)
  would be compiled by dynamo as a frame of its own, a graph more per hook: `run_outside_dynamo` has such frames run
  as plain Python (the same hooks still trace as part of the graph wherever dynamo inlines them).
- Dynamo traces the hooks a module carries when it compiles it, and by default does not guard on them
  (`torch._dynamo.config.skip_nnmodule_hook_guards`): compiled code made before nanwatch's hooks were added keeps
  running without them, and would record nothing. `stale_compiled_code` finds the compiled code of the watched
  modules' forwards that exists already, and `forget_compiled_code` drops it, so the next call compiles again, hooks
  included.

Nothing here imports torch._dynamo: where it was never imported, nothing was compiled.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "COMPILE_WRAPPER_ATTRIBUTE",
    "compiled_anything",
    "compiled_inner",
    "forget_compiled_code",
    "nested_code",
    "run_outside_dynamo",
    "stale_compiled_code",
    "strip_compile_wrapper",
    "with_compiled_code",
    "without_compile_wrappers",
]

# Where an OptimizedModule keeps the module it compiles.
COMPILE_WRAPPER_ATTRIBUTE = "_orig_mod"


def compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a `torch.compile` wrapper (`OptimizedModule`) compiles, or None when `module` is no such wrapper."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    kind = getattr(eval_frame, "OptimizedModule", None)
    if kind is None or not isinstance(module, kind):
        return None
    inner: torch.nn.Module = module._orig_mod
    return inner


def strip_compile_wrapper(name: str) -> str:
    """A qualified name without the wrappers' `_orig_mod` components: `block._orig_mod.fc` is `block.fc`."""
    if COMPILE_WRAPPER_ATTRIBUTE not in name:  # the common case, at the cost of one substring search
        return name
    return ".".join(part for part in name.split(".") if part != COMPILE_WRAPPER_ATTRIBUTE)


def without_compile_wrappers(
    named_modules: Iterable[tuple[str, torch.nn.Module]],
) -> Iterator[tuple[str, torch.nn.Module]]:
    """`(name, module)` pairs with the `torch.compile` wrappers left out (the module each wraps follows it, named as
    the wrapper was) and `_orig_mod` left out of every name."""
    for name, module in named_modules:
        if compiled_inner(module) is None:
            yield strip_compile_wrapper(name), module


def _code_objects(modules: Iterable[torch.nn.Module]) -> list[types.CodeType]:
    """The code objects dynamo may have compiled for calls of `modules`: each class's `forward` (a user's module is
    entered there: `torch.compile(model)`, `model.compile()`), and the frame that `torch.compile` of a torch.nn
    module (an `nn.Sequential`) enters through."""
    codes: dict[int, types.CodeType] = {}
    for module in modules:
        forward = getattr(type(module), "forward", None)
        code = getattr(forward, "__code__", None)
        if isinstance(code, types.CodeType):
            codes[id(code)] = code
    external = sys.modules.get("torch._dynamo.external_utils")
    wrap_inline = getattr(external, "wrap_inline", None)
    if wrap_inline is not None:
        inner = getattr(wrap_inline(len), "__code__", None)
        if isinstance(inner, types.CodeType):
            codes[id(inner)] = inner
    return list(codes.values())


def stale_compiled_code(modules: Iterable[torch.nn.Module]) -> list[types.CodeType]:
    """The code objects of `modules`' forwards for which dynamo holds compiled code already (made without the hooks
    added since). Empty when torch._dynamo was never imported, or this torch cannot say."""
    return with_compiled_code(_code_objects(modules))


def with_compiled_code(codes: Iterable[types.CodeType]) -> list[types.CodeType]:
    """Those of `codes` for which dynamo holds compiled code (empty when torch._dynamo was never imported)."""
    if "torch._dynamo" not in sys.modules:
        return []
    frames = sys.modules.get("torch._C._dynamo.eval_frame")
    entries = getattr(frames, "_debug_get_cache_entry_list", None)
    if entries is None:
        return []
    return [code for code in codes if entries(code)]


def compiled_anything() -> bool:
    """Whether dynamo compiled any frame in this process (since its last reset), by its own counters; False when
    torch._dynamo was never imported or this torch keeps no such counters."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    if counters is None:
        return False
    try:
        return bool(counters["frames"]["ok"] or counters["stats"]["unique_graphs"])
    except (KeyError, TypeError):
        return False


def nested_code(*functions: object) -> list[types.CodeType]:
    """The code objects of the functions defined inside `functions` (closures such as a hook a method makes)."""
    found = []
    for function in functions:
        code = getattr(function, "__code__", None)
        if isinstance(code, types.CodeType):
            found += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return found


def forget_compiled_code(codes: Iterable[types.CodeType]) -> bool:
    """Drop dynamo's compiled code for `codes` (every module whose forward shares one recompiles at its next call).
    False when this torch offers no way to do that."""
    frames = sys.modules.get("torch._C._dynamo.eval_frame")
    reset_code = getattr(frames, "reset_code", None)
    if reset_code is None:
        return False
    for code in codes:
        reset_code(code)
    return True


def run_outside_dynamo(codes: Iterable[types.CodeType]) -> None:
    """Have dynamo run frames of `codes`, and everything they call, as plain Python when it meets them as frames of
    their own; where it inlines them into a graph they are traced as before. Asks torch._C only (no torch._dynamo
    import); a torch without this control leaves them as they are."""
    frames = sys.modules.get("torch._C._dynamo.eval_frame")
    action = getattr(frames, "_FrameAction", None)
    strategy = getattr(frames, "_FrameExecStrategy", None)
    setter = getattr(frames, "set_code_exec_strategy", None)
    if action is None or strategy is None or setter is None:
        return
    skip = strategy(action.SKIP, action.SKIP)
    for code in codes:
        setter(code, skip)
