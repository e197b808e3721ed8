"""Whether, and how, the watched model runs compiled by torch.compile: its backend's name and mode."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nanwatch.core.features.cause.records import CompileInfo
from nanwatch.core.torch_glue.compiler import compiled_inner

__all__ = ["compile_info", "running_eagerly"]


def compile_info(entry: torch.nn.Module, model: torch.nn.Module) -> CompileInfo | None:
    """How `entry` (the module the user calls) or a module inside `model` was compiled, or None when neither was:
    a `torch.compile(module)` wrapper, or `module.compile()` in place."""
    for module in (entry, *model.modules()):
        if compiled_inner(module) is not None:
            return _of_wrapper(module)
        compiled = getattr(module, "_compiled_call_impl", None)
        if compiled is not None:  # `module.compile()`: the context is in the compiled function's closure
            context = next((cell.cell_contents for cell in compiled.__closure__ or () if _is_context(cell)), None)
            return CompileInfo(backend=_backend_name(getattr(context, "callback", None)), mode=_mode(context))
    return None


def _is_context(cell: Any) -> bool:
    try:
        return type(cell.cell_contents).__name__ == "OptimizeContext"
    except ValueError:  # an empty cell
        return False


def running_eagerly() -> Any:
    """A context in which code torch.compile compiled runs eagerly instead (`set_stance("force_eager")`)."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _of_wrapper(wrapper: torch.nn.Module) -> CompileInfo:
    context = getattr(wrapper, "dynamo_ctx", None)
    return CompileInfo(backend=_backend_name(getattr(context, "callback", None)), mode=_mode(context))


def _backend_name(callback: Any) -> str:
    """The backend behind dynamo's frame callback: "inductor", "aot_eager", a function's name; "unknown" when
    torch keeps it somewhere this version does not say."""
    found = callback
    for _ in range(4):  # dynamo wraps the backend a few times: CatchErrorsWrapper -> ConvertFrame -> the backend
        name = getattr(found, "compiler_name", None)
        if isinstance(name, str):
            return name
        inner = getattr(found, "_torchdynamo_orig_backend", None) or getattr(found, "compiler_fn", None)
        if inner is None:
            break
        found = inner
    name = getattr(found, "__name__", None)
    return name if isinstance(name, str) and name != "forward" else "unknown"


def _mode(context: Any) -> str | None:
    """torch.compile's `mode`, told from the options inductor keeps (it keeps the options a mode sets, not the mode's
    name); None for the default mode, or a backend that keeps no options."""
    callback = getattr(context, "callback", None)
    for _ in range(4):
        inner = getattr(callback, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        callback = inner
    options = getattr(callback, "config", None)
    if not isinstance(options, dict) or not options:
        return None
    if options.get("max_autotune"):
        return "max-autotune" if options.get("triton.cudagraphs") else "max-autotune-no-cudagraphs"
    if options.get("triton.cudagraphs"):
        return "reduce-overhead"
    return None
