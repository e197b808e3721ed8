"""Differential tests: `nanwatch.DebugUnderflowOverflow` against transformers' own class, the oracle.

Each scenario builds the same model twice from the same seed, feeds both copies the same batches, and runs one copy
under transformers' `DebugUnderflowOverflow` and the other under nanwatch's. stdout must be equal byte for byte, and
both must raise a `ValueError` with the same message at the same module call of the same batch (nanwatch's being a
`NonFiniteError` or `BatchLimitReached`).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tests.models import MLP, MLP_FRAMES_PER_BATCH, OverflowsInItsOwnForward, Twice, loud_mlp, tiny_gpt2_config
from torch import nn

import nanwatch
from nanwatch import BatchLimitReached, NonFiniteError

debug_utils = pytest.importorskip("transformers.debug_utils")
transformers = pytest.importorskip("transformers")

SEED = 1234
INF = float("inf")
NAN = float("nan")

Feed = Callable[[nn.Module, int], None]


# ------------------------------------------------------------------------------------------------- models
# (MLP, loud_mlp, Twice and OverflowsInItsOwnForward, which both differential tests use: tests/models.py)


class Fan(nn.Module):
    """Takes None and a float; returns None, a float, a tuple of tuples, a list and a dict alongside tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: None, scale: float) -> tuple[Any, ...]:
        h = self.proj(x) * scale
        return h, None, scale, (h.relu(), (h, h)), [h], {"h": h}


class FanTupleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fan = Fan()
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        h, _, _, (r, _), _, _ = self.fan(x, None, 2.0)
        return self.head(h + r), None, (r, None)


class SharedUnderTwoParents(nn.Module):
    """One Linear under two parents: `model.apply` visits it twice, so transformers hooks it twice."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(8, 8)
        self.enc = nn.Sequential(shared, nn.GELU())
        self.dec = nn.Sequential(shared, nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def tiny_gpt2(dtype: torch.dtype) -> nn.Module:
    return transformers.GPT2LMHeadModel(tiny_gpt2_config()).to(dtype).train()


def tiny_t5_fp16() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config).half().train()
    with torch.no_grad():
        # Big feed-forward weights, as after a long fp16 run: the first FF output goes past 65504 for real.
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(3e4)
    return model


# ------------------------------------------------------------------------------------------------- inputs


def batch_of_floats(index: int, poison: dict[int, float]) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(index))
    if index in poison:
        x[1, 3] = poison[index]
    return x


def float_feed(poison: dict[int, float] | None = None, *, train: bool = False) -> Feed:
    """Feed batch `index` of random floats (with `poison[index]` written into one element); optionally train on it."""
    poison = poison or {}

    def feed(model: nn.Module, index: int) -> None:
        out = model(batch_of_floats(index, poison))
        if train:
            # A real SGD step between batches: the weights the next frames show have changed in place.
            first = out if isinstance(out, torch.Tensor) else out[0]
            first.float().square().mean().backward()
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param -= 0.1 * param.grad
                        param.grad = None

    return feed


def token_ids(index: int) -> torch.Tensor:
    return torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(index))


def gpt2_feed(growth: float = 1.0, **call_kwargs: Any) -> Feed:
    """Feed token ids; after each batch multiply one MLP's weight by `growth` (weights blowing up in training)."""

    def feed(model: nn.Module, index: int) -> None:
        model(token_ids(index), **call_kwargs)
        if growth != 1.0:
            with torch.no_grad():
                model.transformer.h[1].mlp.c_fc.weight.mul_(growth)

    return feed


def t5_feed(model: nn.Module, index: int) -> None:
    ids = token_ids(index)
    model(input_ids=ids, labels=ids)


def scaled_gpt2_fp16(scale: float) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = tiny_gpt2(torch.float16)
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight.mul_(scale)
        return model

    return build


# ------------------------------------------------------------------------------------------------- running


@dataclass
class Outcome:
    stdout: str
    error: ValueError | None = None
    batch: int | None = None  # the batch whose forward raised
    calls: list[str] = field(default_factory=list)  # every module call so far, by name


def run(
    debugger: Callable[..., Any], build: Callable[[], nn.Module], feed: Feed, batches: int, **kwargs: Any
) -> Outcome:
    torch.manual_seed(SEED)
    model = build()
    torch.manual_seed(SEED + 1)  # dropout masks: the same in both runs
    outcome = Outcome(stdout="")
    names = dict(model.named_modules())
    for name, module in names.items():
        # Registered before the debugger's hooks, so it runs first: the last name is the call whose hook raised.
        module.register_forward_hook(lambda m, i, o, name=name: outcome.calls.append(name))
    buffer = io.StringIO()
    watcher = debugger(model, **kwargs)
    with contextlib.redirect_stdout(buffer):
        for index in range(batches):
            try:
                feed(model, index)
            except ValueError as error:
                outcome.error = error
                outcome.batch = index
                break
    close = getattr(watcher, "close", None)
    if close is not None:
        close()
    outcome.stdout = buffer.getvalue()
    return outcome


def run_both(build: Callable[[], nn.Module], feed: Feed, batches: int, **kwargs: Any) -> tuple[Outcome, Outcome]:
    oracle = run(debug_utils.DebugUnderflowOverflow, build, feed, batches, **kwargs)
    ours = run(nanwatch.DebugUnderflowOverflow, build, feed, batches, **kwargs)
    return oracle, ours


def last_reported_module(stdout: str) -> str:
    """The qualified name in the last module line of a detection dump (the frame where inf/nan was seen)."""
    module_lines = [line for line in stdout.splitlines() if re.match(r"^ {17} \S* \S+$", line)]
    return module_lines[-1][18:].rsplit(" ", 1)[0]


def assert_same(oracle: Outcome, ours: Outcome) -> None:
    assert ours.stdout == oracle.stdout
    assert (ours.error is None) == (oracle.error is None)
    if oracle.error is None:
        return
    assert type(oracle.error) is ValueError
    assert isinstance(ours.error, ValueError)
    assert str(ours.error) == str(oracle.error)
    assert ours.batch == oracle.batch
    assert ours.calls == oracle.calls  # same module call, same position in the run


# ------------------------------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    build: Callable[[], nn.Module]
    feed: Feed
    batches: int
    kwargs: dict[str, Any]
    expect: str | None  # "detect", "abort", or None: the run completes
    expect_batch: int | None = None  # the batch whose forward raises


SCENARIOS = {
    # (a) in-place ReLU
    "mlp-inf-batch0": Scenario(MLP, float_feed({0: INF}), 3, {}, "detect", 0),
    "mlp-nan-batch2-training": Scenario(MLP, float_feed({2: NAN}, train=True), 4, {}, "detect", 2),
    "mlp-overflow-midway-batch3": Scenario(loud_mlp, float_feed({3: 3e37}), 5, {}, "detect", 3),
    "mlp-inf-batch2-3-frames": Scenario(MLP, float_feed({2: INF}), 4, {"max_frames_to_save": 3}, "detect", 2),
    "mlp-inf-batch2-1-frame": Scenario(MLP, float_feed({2: INF}), 4, {"max_frames_to_save": 1}, "detect", 2),
    "mlp-trace": Scenario(MLP, float_feed(train=True), 5, {"trace_batch_nums": [1, 3]}, None),
    "mlp-abort": Scenario(MLP, float_feed(), 5, {"abort_after_batch_num": 2}, "abort", 2),
    "mlp-trace-abort": Scenario(
        MLP, float_feed(), 6, {"trace_batch_nums": [1, 3], "abort_after_batch_num": 3}, "abort", 3
    ),
    "mlp-abort-before-inf": Scenario(MLP, float_feed({3: INF}), 5, {"abort_after_batch_num": 1}, "abort", 1),
    "mlp-inf-before-abort": Scenario(MLP, float_feed({1: INF}), 5, {"abort_after_batch_num": 2}, "detect", 1),
    # Detection after a trace, while the frames since the trace still fit in the ring (21).
    "mlp-trace-then-inf": Scenario(MLP, float_feed({2: INF}), 4, {"trace_batch_nums": [1]}, "detect", 2),
    # inf inside a traced batch is not raised there; transformers keeps the flag and raises at the next batch's
    # first frame, whose values are finite.
    "mlp-inf-in-traced-batch": Scenario(MLP, float_feed({1: INF}), 4, {"trace_batch_nums": [1]}, "detect", 2),
    # (b) tuples with None, non-tensors, tuples of tuples, lists and dicts
    "tuples-inf-batch0": Scenario(FanTupleModel, float_feed({0: INF}), 2, {}, "detect", 0),
    "tuples-nan-batch2": Scenario(FanTupleModel, float_feed({2: NAN}), 4, {"max_frames_to_save": 4}, "detect", 2),
    "tuples-trace-abort": Scenario(
        FanTupleModel, float_feed(), 4, {"trace_batch_nums": [0, 2], "abort_after_batch_num": 2}, "abort", 2
    ),
    # (c) a module called twice in one forward; a module reachable from two parents
    "twice-inf-batch1": Scenario(Twice, float_feed({1: INF}), 3, {"max_frames_to_save": 6}, "detect", 1),
    "twice-trace": Scenario(Twice, float_feed(), 3, {"trace_batch_nums": [1]}, None),
    "shared-inf-batch1": Scenario(SharedUnderTwoParents, float_feed({1: INF}), 3, {}, "detect", 1),
    "shared-trace-abort": Scenario(
        SharedUnderTwoParents, float_feed(), 3, {"trace_batch_nums": [0], "abort_after_batch_num": 0}, "abort", 0
    ),
    # Only the root's own frame overflows: transformers has already counted the batch when it reports.
    "root-overflows-batch1": Scenario(OverflowsInItsOwnForward, float_feed({1: 1e3}), 3, {}, "detect", 1),
    # (d) a real transformers model in fp16 that overflows for real
    "gpt2-fp16-overflow-batch0": Scenario(scaled_gpt2_fp16(3e5), gpt2_feed(), 2, {}, "detect", 0),
    "gpt2-fp16-overflow-batch2": Scenario(
        scaled_gpt2_fp16(1e3), gpt2_feed(growth=20.0, return_dict=False), 4, {"max_frames_to_save": 30}, "detect", 2
    ),
    "t5-fp16-overflow-batch0": Scenario(tiny_t5_fp16, t5_feed, 2, {"max_frames_to_save": 8}, "detect", 0),
    # (e) the same transformers model in fp32, traced, then stopped
    "gpt2-fp32-trace": Scenario(lambda: tiny_gpt2(torch.float32), gpt2_feed(), 4, {"trace_batch_nums": [1, 3]}, None),
    "gpt2-fp32-trace-abort": Scenario(
        lambda: tiny_gpt2(torch.float32),
        gpt2_feed(),
        4,
        {"trace_batch_nums": [1], "abort_after_batch_num": 1},
        "abort",
        1,
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_stdout_and_same_error(name: str) -> None:
    scenario = SCENARIOS[name]
    oracle, ours = run_both(scenario.build, scenario.feed, scenario.batches, **scenario.kwargs)

    # The scenario does what it says, judged on the oracle alone.
    assert oracle.batch == scenario.expect_batch
    if scenario.expect == "detect":
        assert "Detected inf/nan" in str(oracle.stdout)
        assert "inf/nan detected" in str(oracle.error)
        assert "weight has" not in oracle.stdout  # activations went inf/nan, not the weights we scaled
    elif scenario.expect == "abort":
        assert "aborting after" in str(oracle.error)
    batches_run = scenario.batches if oracle.batch is None else oracle.batch + 1
    for traced in scenario.kwargs.get("trace_batch_nums", []):
        if traced < batches_run:
            assert f"*** Starting batch number={traced} ***" in oracle.stdout

    assert_same(oracle, ours)

    # nanwatch's exceptions carry what the oracle's message only implies.
    if scenario.expect == "detect":
        assert isinstance(ours.error, NonFiniteError)
        assert ours.error.module_name == last_reported_module(oracle.stdout)
        assert ours.error.batch_number == scenario.expect_batch
    elif scenario.expect == "abort":
        assert isinstance(ours.error, BatchLimitReached)
        assert ours.error.batch_number == scenario.kwargs["abort_after_batch_num"]


def test_overflow_midway_is_not_in_the_first_frame() -> None:
    # The finite 3e37 input goes inf inside the network, not at the input: the report has frames before the culprit.
    oracle = run(debug_utils.DebugUnderflowOverflow, loud_mlp, float_feed({3: 3e37}), 5)
    assert last_reported_module(oracle.stdout) == "body.2"
    assert "input[0] has infs" not in oracle.stdout


def test_detection_long_after_a_trace_keeps_the_ring_bounded() -> None:
    """The one documented difference: after a traced batch transformers' ring becomes an unbounded list.

    Detecting more than `max_frames_to_save` frames after a trace, transformers prints every frame since the trace;
    nanwatch prints the last `max_frames_to_save` of them. Everything else is the same.
    """
    size = 4
    oracle, ours = run_both(MLP, float_feed({3: INF}), 5, trace_batch_nums=[1], max_frames_to_save=size)
    assert str(ours.error) == str(oracle.error)
    assert ours.calls == oracle.calls

    def split(stdout: str) -> tuple[str, str, list[str]]:
        before, dump = stdout.split("\nDetected inf/nan", 1)
        header, count, table, *rest = dump.splitlines()
        frames = "\n".join(rest).split("\n" + " " * 17 + " ")
        return before, f"{header}\n{table}", frames

    oracle_before, oracle_header, oracle_frames = split(oracle.stdout)
    ours_before, ours_header, ours_frames = split(ours.stdout)
    assert ours_before == oracle_before
    assert ours_header == oracle_header
    # Batch 2 (7 frames) and batch 3 up to its first frame: 8 frames since the trace.
    assert f"Last {MLP_FRAMES_PER_BATCH + 1} forward frames:" in oracle.stdout
    assert f"Last {size} forward frames:" in ours.stdout
    assert ours_frames[-size:] == oracle_frames[-size:]
    assert len(ours_frames) == size + 1  # the text after the last frame ("\n\n\n\n") is the last piece


# ------------------------------------------------------------------------------------------------- detect_overflow


def _tensor(kind: str, dtype: torch.dtype) -> torch.Tensor:
    values = {"neither": [1.0, -2.0, 0.5], "nan": [1.0, NAN, 2.0], "inf": [-INF, 1.0, 3.0], "both": [NAN, INF, -1.0]}
    return torch.tensor(values[kind]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["neither", "nan", "inf", "both"])
def test_detect_overflow(kind: str, dtype: torch.dtype) -> None:
    results = []
    for detect in (debug_utils.detect_overflow, nanwatch.detect_overflow):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            found = detect(_tensor(kind, dtype), "layer.out")
        results.append((found, buffer.getvalue()))
    assert results[1] == results[0]
    assert results[0][0] is (kind != "neither")


def test_detect_overflow_on_integers() -> None:
    results = []
    for detect in (debug_utils.detect_overflow, nanwatch.detect_overflow):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            found = detect(torch.arange(5), "ids")
        results.append((found, buffer.getvalue()))
    assert results[1] == results[0] == (False, "")
