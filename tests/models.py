"""The small models more than one test file builds, defined once here; import them as `tests.models`.

A model used by a single test file stays in that file. Three other modules hold models on purpose and stay apart:
- `tests/replay_models.py`: the factories `nanwatch replay --model tests.replay_models:factory` imports in a
  subprocess; the tests check that module's path and the names it defines in replay's messages.
- `tests/trace_models.py`: `AmpNet` and the runs whose JSON Lines traces the CLI tests read; the reports and the
  docs name its classes and module (`amp Amplify`, `from tests.trace_models import ...`).
- `tests/adapters/scripts/blowup_models.py`: models of the multi-process scripts, which run with only their own folder
  on the import path (`blowup_models`, not `tests.`); an in-process test that shares one of them (`ArmedBlowup`,
  `Boosted`, `SumDataset`) imports it from there as `tests.adapters.scripts.blowup_models`.

Class names are part of what the tests check (reports print `2 Scale`, transformers prints `body.0 Linear`): a model
moved here keeps its name. Models that are not the same keep names of their own, not one more `Net` or `Block`,
except where a test asserts the name a report prints. Every factory seeds torch's generator as the copies it replaced
did, so the weights are the same as before.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# ------------------------------------------------------------------------------------- a chosen module goes inf


class Scale(nn.Module):
    """Multiplies by `factor`: set it to inf (or a number past float16's max) to make inf appear in a chosen module.

    Used by the engine, plain-loop and one-watcher tests, in `small_mlp` and on its own.
    """

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def small_mlp(out_features: int = 1, *, scale: bool = True, inplace: bool = False) -> nn.Sequential:
    """Linear(4, 8) -> ReLU -> Scale -> Linear(8, out_features), built after `torch.manual_seed(0)`.

    `model[2].factor = math.inf` makes the third module's output inf. With `scale=False` there is no Scale (three
    modules: Linear, ReLU, Linear, the same weights as with it, since Scale has none); `inplace` makes the ReLU
    in-place. The engine tests take `out_features=2` (the guard's loss tests with `scale=False`); the adapter,
    summary and gradient tests the default 1.
    """
    torch.manual_seed(0)
    middle = [nn.ReLU(inplace=inplace), *([Scale()] if scale else [])]
    return nn.Sequential(nn.Linear(4, 8), *middle, nn.Linear(8, out_features))


# ------------------------------------------------------------------------------------- a module that changes dtype


class Cast(nn.Module):
    """Returns its input as `dtype`: an output of a chosen dtype (unsigned, float8, bfloat16, float16) in a chosen
    place, without parameters.

    Used by the plain-loop tests (wide unsigned and float8 outputs), the deferred-recording tests (one stack per dtype)
    and the plot tests (a float16 middle between float32 layers).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


# ------------------------------------------------------------------------ the differential tests' own models


class MLP(nn.Module):
    """Linear layers with in-place ReLUs: a ReLU overwrites the output its Linear just produced.

    Shared by the two differential tests against transformers' `DebugUnderflowOverflow` (test_dropin_differential,
    test_watch_differential).
    """

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


MLP_FRAMES_PER_BATCH = 7  # body.0, body.1, body.2, body.3, body, head, the root


def loud_mlp() -> MLP:
    """An MLP whose second Linear amplifies by about 1000x: a large finite input goes inf there, midway (the third
    frame). Not seeded here: the differential tests seed before building each copy."""
    model = MLP()
    with torch.no_grad():
        model.body[2].weight.mul_(1000)
    return model


class Twice(nn.Module):
    """The same Linear (and the same Tanh) called twice in one forward (the differential tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.act = nn.Tanh()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.block(x))
        x = self.act(self.block(x) * 3)
        return self.head(x)


class OverflowsInItsOwnForward(nn.Module):
    """Every submodule stays finite; the root's own arithmetic overflows, so only the root's frame holds inf (the
    differential tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e38


# ------------------------------------------------------------------------------- faults only in backward


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class InfInBackward(nn.Module):
    """The identity forward; an inf gradient backward, whatever the loss scale.

    Shared by the gradient tests and the AMP tests of every adapter (core, plain, Lightning, Accelerate, HF Trainer).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _ScaleGradient.apply(x, math.inf)
        return out


class NanInBackward(nn.Module):
    """The identity forward; a nan gradient backward (the gradient, sentinel, guard and compile tests)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _ScaleGradient.apply(x, math.nan)
        return out


# ------------------------------------------------------------------ transformers models with random weights


def tiny_gpt2_config() -> Any:
    """A two-layer GPT-2 config (32 wide, 64 tokens, eager attention): the differential tests' GPT-2, no download."""
    import transformers

    return transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        n_positions=16,
        vocab_size=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )


def tiny_vit() -> Any:
    """A one-layer ViT classifier for 3x8x8 images and 3 labels, seeded: the same weights at every call (the keyword
    input tests, core and HF Trainer)."""
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


# ------------------------------------------------------------------ an optimizer step that overflows the weights


class OverflowingSGD(torch.optim.SGD):
    """SGD (lr 0.01) whose step number `at` (1-indexed) applies an infinite learning rate: finite gradients, weights
    inf/nan after that update, as an fp16/bf16 run's weights go when one update overflows.

    Used by the checkpoint guard's tests in every adapter: the checkpoint saved after step `at` is the poisoned one.
    """

    def __init__(self, params: Any, at: int) -> None:
        super().__init__(params, lr=0.01)
        self.at = at
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        if self.steps == self.at:
            for group in self.param_groups:
                group["lr"] = math.inf
        return super().step(closure)


# ------------------------------------------------------------------------------------ wrong only when compiled


def wrong_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """A torch.compile backend that runs the graph with every linear's result multiplied by inf: a model compiled
    with it is wrong only when compiled (the cause tests' "compiler": tests/core/features/test_cause.py and the
    conformance harnesses)."""
    for node in list(graph.graph.nodes):
        if node.op == "call_function" and node.target is torch._C._nn.linear:
            with graph.graph.inserting_after(node):
                broken = graph.graph.call_function(torch.mul, (node, float("inf")))
            node.replace_all_uses_with(broken, delete_user_cb=lambda user, broken=broken: user is not broken)
    graph.recompile()
    return graph.forward
