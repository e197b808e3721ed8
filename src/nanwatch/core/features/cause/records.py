"""What a cause is, and what the tests behind it are given: plain typed records."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["CAUSE_KINDS", "Cause", "CauseKind", "CompileInfo", "CulpritCall", "KeptBuffer", "KeptCall"]

CauseKind = Literal["data", "precision", "compiler", "weights", "loss", "unknown"]
CAUSE_KINDS: tuple[CauseKind, ...] = ("data", "precision", "compiler", "weights", "loss", "unknown")


@dataclass(frozen=True)
class Cause:
    """Why a run went non-finite, as far as a test on the detection could tell, with its evidence.

    Attributes:
        kind: "data" (it arrived in the micro-batch's inputs), "precision" (the culprit recomputed in a wider dtype
            from the same finite inputs and weights is finite: the dtype overflowed), "compiler" (the culprit's
            micro-batch run eagerly in the same dtype is finite where the compiled run was not), "weights" (a
            parameter was already non-finite when the forward began), "loss" (born outside the model, in the loss
            code), or "unknown" (no test applied, or one could not run: `evidence` says which and why).
        evidence: one line: what was tested and what it showed.
        module_name: the module the cause is about (the culprit's), where there is one.
        born_in_step: for "weights": the optimizer step whose update made the weights non-finite, as reports count
            steps (the `optimizer_step` a report made during that step carries); None where it is not known.
        details: the evidence as numbers and names (for the JSON report): dtype, magnitudes, op, positions, ...
    """

    kind: CauseKind
    evidence: str
    module_name: str | None = None
    born_in_step: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.kind}: {self.evidence}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "evidence": self.evidence,
            "module": self.module_name,
            "born_in_step": self.born_in_step,
            "details": dict(self.details),
        }


@dataclass(frozen=True)
class CompileInfo:
    """How the watched model was compiled: torch.compile's backend (its name) and mode (None for the default)."""

    backend: str
    mode: str | None


@dataclass(frozen=True)
class KeptBuffer:
    """A buffer of the model, and a copy of it as a kept call began."""

    buffer: torch.Tensor
    saved: torch.Tensor


@dataclass
class KeptCall:
    """One outermost forward of the current micro-batch, kept by reference (no copy: nothing on the clean path
    but a few references), with what a replay of it needs: the random generators' and autocast's state at its
    start, each input tensor's version counter (a change since means a replay would run other values), and the
    buffers a forward changes, copied."""

    module: torch.nn.Module  # the module called (the user's entry: a DDP or compile wrapper, or the model)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: dict[str, Any]
    autocast: dict[str, str]
    versions: list[tuple[torch.Tensor, int]]
    buffers: list[KeptBuffer]  # the buffers a forward changes, as they were at the call
    name: str | None = None  # the called module's name in the model, where it is not the model itself

    def changed(self) -> bool:
        """Whether an input tensor was changed in place since the call (its version counter moved)."""
        return any(tensor._version != version for tensor, version in self.versions)


@dataclass(frozen=True)
class CulpritCall:
    """The culprit module's call, captured by running its micro-batch again eagerly: its inputs (copies), the dtype
    its output came out in, and whether that output was finite in the replay.

    Attributes:
        module: the culprit module itself (the live one: tests copy it before changing anything).
        args, kwargs: copies of its inputs at the call, detached.
        autocast: autocast's state at the call (`core/runstate.py`'s form).
        output_dtype: the floating-point dtype of its (first floating-point) output, or None.
        output_finite: whether every floating-point output of the replayed call was finite.
        output_abs_max: the largest finite magnitude of its floating-point outputs in the replay, or None.
        buffers: copies of its buffers as the call began (a copy of the module run later starts from them).
    """

    module: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    autocast: dict[str, str]
    output_dtype: torch.dtype | None
    output_finite: bool
    output_abs_max: float | None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # its buffers at the call (copies), by name
    rng: dict[str, Any] = field(default_factory=dict)  # the random generators' state at the call
