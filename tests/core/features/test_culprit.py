"""The first culprit: real runs in which the module that made the first inf/nan is known by construction."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.report_lines import cause_tail
from torch import nn

import nanwatch
from nanwatch import NonFiniteError
from nanwatch.core.features.culprit import Culprit


def _run_until_detection(model: nn.Module, batches: list[Any], **overrides: Any) -> NonFiniteError:
    with nanwatch.watch(model, **overrides) as handle:
        for batch in batches:
            model(*batch) if isinstance(batch, tuple) else model(batch)
            try:
                handle.step()
            except NonFiniteError as error:
                return error
    raise AssertionError("no inf/nan was detected")


def _abs_max_of_input(module: nn.Module) -> list[float]:
    """A plain forward hook of the test's own: the abs max of what `module` receives, call by call."""
    seen: list[float] = []

    def hook(_: nn.Module, args: tuple[Any, ...], __: Any) -> None:
        seen.append(float(args[0].detach().float().abs().max()))

    module.register_forward_hook(hook)
    return seen


class LinearTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = LinearTanh()
        self.second = LinearTanh()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


# ----------------------------------------------------------------------------------------- transformers models


def test_gpt2_fp16_names_the_linear_whose_output_overflowed_not_its_parents() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).half().train()
    c_fc = model.h[1].mlp.c_fc
    with torch.no_grad():
        c_fc.weight.mul_(3e5)  # still finite (about 6e3), but its products pass 65504
    inputs = _abs_max_of_input(c_fc)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    error = _run_until_detection(model, [(ids,)])
    # The run called c_fc once, and the test's own hook saw that call only: the cause's tests (a rerun of the
    # micro-batch, the culprit recomputed) must not call the user's hooks.
    assert len(inputs) == 1, inputs
    culprit = error.culprit
    assert culprit is not None
    assert (culprit.kind, culprit.module_name, culprit.class_name) == ("produced", "h.1.mlp.c_fc", "Conv1D")
    assert culprit.inputs_abs_max == pytest.approx(inputs[0], rel=1e-3)  # fp16 values: exact up to rounding
    weight_max = float(c_fc.weight.detach().float().abs().max())
    assert culprit.weights_abs_max == pytest.approx(weight_max, rel=1e-3)
    assert culprit.message == (
        f"first non-finite value produced by h.1.mlp.c_fc (Conv1D): inputs finite (abs max {inputs[0]:.2e}), "
        f"weights finite (abs max {weight_max:.2e}), output inf (float16)"
    )
    # Its parents (h.1.mlp, h.1, the model) return the same inf later: they only passed it on.
    assert error.module_name == "h.1.mlp.c_fc"
    assert str(culprit) in str(error)
    # After the frames and a blank line: the cause (no report_dir: no capsule), the culprit line, then the values the
    # same check saw near float16's max.
    assert error.cause is not None
    assert (error.cause.kind, error.cause.module_name) == ("precision", "h.1.mlp.c_fc")
    footer = error.report.rsplit("\n\n", 1)[1].split("\n")
    assert footer[:3] == [
        *cause_tail(error)[1:],
        "numbers near their dtype's limits in the frames checked with this detection (batch_number=0):",
    ]
    assert all(line.startswith("  ") for line in footer[3:])
    assert any(
        line.startswith(f"  h.1.mlp.c_fc (Conv1D) weight: float16 abs max {weight_max:.2e}, ") for line in footer
    )


def test_t5_dropout_that_scales_6e4_past_the_fp16_max_is_the_culprit() -> None:
    """The guide's mt5 case: the gated-GELU block outputs about 6e4, Dropout rescales its survivors by 1/(1-p): inf."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        d_model=16,
        d_ff=32,
        num_layers=3,
        num_heads=2,
        d_kv=8,
        vocab_size=64,
        dropout_rate=0.5,
        feed_forward_proj="gated-gelu",
    )
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(config).half().train()
    layer = model.encoder.block[2].layer[1]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    dropout_inputs = _abs_max_of_input(layer.dropout)
    torch.manual_seed(5)  # the dropout masks
    model(ids)
    with torch.no_grad():
        layer.DenseReluDense.wo.weight.mul_(6.27e4 / dropout_inputs[0])  # its output now peaks near 6.27e4
    layer_inputs = _abs_max_of_input(layer)
    layer_outputs: list[float] = []
    layer.register_forward_hook(lambda _, __, output: layer_outputs.append(float(output.detach().float().abs().max())))
    torch.manual_seed(5)  # the same masks again
    error = _run_until_detection(model, [(ids,)])
    culprit = error.culprit
    assert culprit is not None
    assert 3.3e4 < dropout_inputs[1] < 65504  # finite going in; doubled by the dropout it cannot be
    assert culprit.module_name == "encoder.block.2.layer.1.dropout"
    assert culprit.message == (
        "first non-finite value produced by encoder.block.2.layer.1.dropout (Dropout): inputs finite "
        f"(abs max {dropout_inputs[1]:.2e}), output inf (float16)"
    )
    assert culprit.inputs_abs_max == pytest.approx(dropout_inputs[1], rel=1e-3)
    assert culprit.weights_abs_max is None  # a Dropout has none
    # The layer around it also took finite inputs and returned inf, but only passed on what its child made.
    assert layer_inputs[-1] < 65504
    assert layer_outputs[-1] == float("inf")
    assert error.module_name == "encoder.block.2.layer.1.dropout"


# ------------------------------------------------------------------------------------------------ plain models


def test_inf_coming_in_through_the_models_input_is_said_so() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    x[1, 3] = float("inf")
    error = _run_until_detection(Net(), [(torch.randn(4, 8),), (x,)])
    culprit = error.culprit
    assert culprit is not None
    assert culprit.kind == "model_input"
    assert culprit.message == "inf entered through input[0] of the top-level model (Net)"
    assert (culprit.module_name, culprit.labels, culprit.batch_number) == ("", ("input[0]",), 1)
    assert culprit.seen_in == ("first.fc", "input[0]")  # the first frame holding it
    assert error.module_name == "first.fc"


def test_a_nan_weight_is_named_as_already_broken() -> None:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.second.fc.weight[0, 0] = float("nan")
    error = _run_until_detection(model, [(torch.randn(4, 8),)])
    culprit = error.culprit
    assert culprit is not None
    assert culprit.kind == "weight"
    assert (culprit.module_name, culprit.labels, culprit.values) == ("second.fc", ("weight",), "nan")
    assert culprit.message == (
        "weight of second.fc (Linear) was already non-finite when this forward ran: weight nan (float32)"
    )


class MakesInfItself(nn.Module):
    """Its own code (not a submodule) overflows, then hands the inf to a child."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x) * 1e38)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = MakesInfItself()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


def test_inf_made_in_a_modules_own_code_names_that_module() -> None:
    torch.manual_seed(0)
    model = Outer()
    with torch.no_grad():
        model.inner.fc.weight.fill_(10.0)  # fc's outputs are large enough that x 1e38 overflows float32
    pre_outputs = _abs_max_of_input(model.inner)
    error = _run_until_detection(model, [(torch.randn(4, 8) + 5,)])
    culprit = error.culprit
    assert culprit is not None
    # The first frame holding inf is inner.norm's (its input); nothing watched returned it before.
    assert error.module_name == "inner.norm"
    assert (culprit.kind, culprit.module_name, culprit.own_code) == ("produced", "inner", True)
    assert culprit.seen_in == ("inner.norm", "input[0]")
    assert culprit.message == (
        f"first non-finite value produced by inner (MakesInfItself) in its own code, outside its watched "
        f"submodules: inputs finite (abs max {pre_outputs[0]:.2e}); inf first seen in input[0] of inner.norm"
    )


class OverflowsAtTheEnd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e39  # every submodule returned finite values; the root's own product is inf


def test_the_top_level_models_own_code() -> None:
    torch.manual_seed(0)
    error = _run_until_detection(OverflowsAtTheEnd(), [(torch.ones(2, 8),)])
    culprit = error.culprit
    assert culprit is not None
    assert (culprit.kind, culprit.module_name, culprit.own_code) == ("produced", "", True)
    assert culprit.message.startswith(
        "first non-finite value produced by the top-level model (OverflowsAtTheEnd) in its own code (its "
        "submodules returned finite values): inputs finite (abs max 1.00e+00), output "
    )


def test_culprit_travels_in_the_error_the_json_and_the_text(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.second.fc.weight.fill_(1e38)  # finite weights; their products with tanh outputs overflow
    error = _run_until_detection(model, [(torch.randn(4, 8) * 10,)], report_dir=tmp_path)
    culprit = error.culprit
    assert isinstance(culprit, Culprit)
    assert culprit.module_name == "second.fc"
    assert f"first in module 'second.fc': {culprit.message}. " in str(error)
    document = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text())
    assert document["culprit"] == culprit.to_dict()
    assert document["culprit"]["kind"] == "produced"
    assert document["culprit"]["module"] == "second.fc"
    text = (tmp_path / "nanwatch-report-rank0-batch0.txt").read_text()
    # The cause: second.fc's products pass float32's max from finite inputs and weights; its repro capsule.
    assert error.cause is not None
    assert (error.cause.kind, error.cause.module_name) == ("precision", "second.fc")
    assert error.capsule == str(tmp_path / "nanwatch-capsule-rank0-batch0.pt")
    assert document["cause"] == {**error.cause.to_dict(), "capsule": error.capsule}
    assert text.splitlines()[-6:] == [
        *cause_tail(error, error.capsule),
        "numbers near their dtype's limits in the frames checked with this detection (batch_number=0):",
        "  second.fc (Linear) weight: float32 abs max 1.00e+38, headroom 3.4x (1.8 bits) below its max 3.40e+38",
    ]
    assert text.endswith("\n")
    # The JSON Lines twin carries it too, so `nanwatch show` prints the same text.
    records = [json.loads(line) for line in (tmp_path / "nanwatch-report-rank0-batch0.jsonl").read_text().splitlines()]
    assert {record["report_culprit"] for record in records} == {culprit.message}
    # And the error survives pickling (multiprocessing, Lightning's spawn) with it.
    again = pickle.loads(pickle.dumps(error))
    assert again.culprit == culprit
    assert (again.cause, again.capsule) == (error.cause, error.capsule)


def test_a_backward_nan_names_the_backward_that_made_it() -> None:
    class Sqrt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.abs().sqrt()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Sqrt())
    with torch.no_grad():
        model[0].weight[1].zero_()
        model[0].bias[1] = 0.0  # row 1 is exactly 0: sqrt's gradient there is inf
    with nanwatch.watch(model, watch_gradients=True) as handle:
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(NonFiniteError) as info:
            handle.step()
    culprit = info.value.culprit
    assert culprit is not None
    assert (culprit.kind, culprit.module_name, culprit.class_name) == ("produced", "1", "Sqrt")
    assert culprit.message.startswith(
        "first non-finite gradient produced by the backward of 1 (Sqrt): gradient in finite (abs max 1.00e+00), "
    )


def test_roles_come_from_what_was_recorded_not_from_label_text() -> None:
    # A parameter named like an output or a gradient is still a parameter: a label parser would misread both.
    class NamedLikeLabels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.output = nn.Parameter(torch.ones(2))
            self.grad_scale = nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.output * self.grad_scale

    model = nn.Sequential(NamedLikeLabels())
    with torch.no_grad():
        model[0].output[0] = float("inf")
    with nanwatch.watch(model) as handle:
        model(torch.ones(2))
        with pytest.raises(NonFiniteError) as info:
            handle.step()
    culprit = info.value.culprit
    assert culprit is not None
    assert (culprit.kind, culprit.module_name, culprit.labels) == ("weight", "0", ("output",))


def test_a_non_finite_loss_is_blamed_on_the_loss_code() -> None:
    model = nn.Sequential(nn.Linear(2, 1))
    with nanwatch.watch(model) as handle:
        out = model(torch.ones(1, 2))
        handle.watch_loss((out * float("inf")).sum())
        with pytest.raises(NonFiniteError) as info:
            handle.step()
    culprit = info.value.culprit
    assert culprit is not None
    assert culprit.kind == "loss"
    assert culprit.message.startswith("first non-finite value produced by the loss, computed outside the watched ")
