"""Headroom by dtype: limits from torch.finfo, warnings before inf, target_dtype, underflow counts. Real runs only."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from tests.engine_helpers import headroom
from torch import nn

import nanwatch
from nanwatch import ConfigError, NonFiniteError, WatchConfig
from nanwatch.core.stats.limits import TARGET_DTYPES, limits_of
from nanwatch.core.watcher import Watcher

WARNING_HEAD = "nanwatch: numbers near their dtype's limits during"


def _messages(log: pytest.LogCaptureFixture, start: str = WARNING_HEAD) -> list[str]:
    return [record.getMessage() for record in log.records if record.getMessage().startswith(start)]


def _passthrough(dtype: torch.dtype, modules: int = 1) -> nn.Sequential:
    """Linear(1, 1) layers of weight 1 and no bias: each returns a new tensor equal to its input."""
    model = nn.Sequential(*[nn.Linear(1, 1, bias=False) for _ in range(modules)]).to(dtype)
    with torch.no_grad():
        for layer in model:
            layer.weight.fill_(1.0)
    return model


def _column(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(-1, 1)


# ---------------------------------------------------------------------------------------------------- limits


def test_limits_come_from_finfo_and_match_how_torch_rounds() -> None:
    expected_max = {"float16": 65504.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
    for name in TARGET_DTYPES + ("float32",):
        dtype = getattr(torch, name)
        limits = limits_of(dtype)
        assert limits is not None
        info = torch.finfo(dtype)
        assert (limits.max, limits.smallest_normal) == (info.max, info.smallest_normal)
        if name in expected_max:
            assert limits.max == expected_max[name]
        # Half the smallest subnormal rounds to zero; the next float32 above it does not.
        flush = torch.tensor(limits.flush_at, dtype=torch.float64).float()
        above = torch.nextafter(flush, torch.tensor(1.0))
        assert float(flush.to(dtype).float()) == 0.0
        assert float(above.to(dtype).float()) == limits.smallest_subnormal
        if name not in ("float8_e4m3fn", "float32"):  # formats with inf: the overflow point is where inf starts
            at = torch.tensor(limits.overflow_at, dtype=torch.float64).float()
            below = torch.nextafter(at, torch.tensor(0.0))
            assert math.isinf(float(at.to(dtype).float()))
            assert float(below.to(dtype).float()) == limits.max
    assert limits_of(torch.int32) is None
    assert limits_of(torch.bool) is None
    bf16 = limits_of(torch.bfloat16)
    assert bf16 is not None
    assert bf16.max == pytest.approx(3.3895e38, rel=1e-4)


# ----------------------------------------------------------------------------------------- own dtype's max


def test_a_float16_tensor_within_an_eighth_of_65504_is_warned_about_once(
    nanwatch_log: pytest.LogCaptureFixture,
) -> None:
    model = _passthrough(torch.float16)
    threshold = 65504 / 8  # 8188: the default headroom_warn_fraction, 0.125
    just_below = float(torch.nextafter(torch.tensor(threshold, dtype=torch.float16), torch.tensor(0.0).half()))
    assert just_below == 8184.0
    with nanwatch.watch(model) as handle:
        model(_column([1.0, -just_below], torch.float16))
        handle.step()
        assert _messages(nanwatch_log) == []  # one float16 step short of the threshold: not a word
        for _ in range(3):
            model(_column([1.0, -threshold], torch.float16))
            handle.step()
    warnings = _messages(nanwatch_log)
    assert warnings == [
        "nanwatch: numbers near their dtype's limits during batch_number=1:\n"
        "  0 (Linear) input[0]: float16 abs max 8.19e+03, headroom 8x (3.0 bits) below its max 6.55e+04\n"
        "  0 (Linear) output: float16 abs max 8.19e+03, headroom 8x (3.0 bits) below its max 6.55e+04"
    ]  # batches 2 and 3 were no worse: no repeat
    summary = _messages(nanwatch_log, "nanwatch headroom summary")
    assert len(summary) == 1
    assert "within the warn fraction of their own dtype's max: 2 tensors; worst at batch_number=1" in summary[0]


def test_a_tensor_is_warned_about_again_each_time_its_headroom_halves(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = _passthrough(torch.float16)
    with nanwatch.watch(model) as handle:
        for value in (1e4, 1.2e4, 2e4, 3e4, 4.1e4):  # headroom 6.6x, 5.5x, 3.3x, 2.2x, 1.6x
            model(_column([value], torch.float16))
            handle.step()
    batches = [message.split("batch_number=")[1].split(":")[0] for message in _messages(nanwatch_log)]
    assert batches == ["0", "2", "4"]  # 6.6x; 3.3x (half of 6.6x); 1.6x (half of 3.3x)
    assert headroom(handle.watcher) is not None
    assert [f.batch_number for f in headroom(handle.watcher).warned if f.label == "output"] == [0, 2, 4]


def test_bfloat16_and_float8_are_judged_against_their_own_maxima(nanwatch_log: pytest.LogCaptureFixture) -> None:
    class ToFloat8(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.float8_e4m3fn)

    bf16 = _passthrough(torch.bfloat16)
    big = float(torch.tensor(1e38).bfloat16())  # 9.97e37 in bfloat16
    room = torch.finfo(torch.bfloat16).max / big
    with nanwatch.watch(bf16) as handle:
        bf16(_column([big], torch.bfloat16))
        handle.step()
    fp8 = nn.Sequential(ToFloat8())
    with nanwatch.watch(fp8) as handle:
        fp8(torch.full((4,), 100.0))  # 100 is far from float32's max; as float8_e4m3fn it is 96
        handle.step()
    lines = "\n".join(_messages(nanwatch_log))
    assert f"0 (Linear) output: bfloat16 abs max 9.97e+37, headroom {room:.3g}x (1.8 bits) below its max 3.39e+38" in (
        lines
    )
    assert f"{room:.3g}" == "3.4"
    assert "0 (ToFloat8) output: float8_e4m3fn abs max 9.60e+01, headroom 4.67x (2.2 bits) below its max 4.48e+02" in (
        lines
    )
    assert "ToFloat8) input[0]" not in lines  # the float32 input is nowhere near float32's max


def test_a_mask_filled_with_the_dtypes_min_is_no_warning(nanwatch_log: pytest.LogCaptureFixture) -> None:
    """transformers fills attention masks with finfo(dtype).min: exactly the max in magnitude, and not a value."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=32, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).half()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with nanwatch.watch(model) as handle:
        model(ids)
        masks = [
            entry.label
            for frame in handle.watcher.recent_frames()
            for entry in frame.entries
            if entry.measurement is not None
            and entry.measurement.abs_max is not None
            and float(entry.measurement.abs_max) == 65504.0
        ]
        handle.step()
    assert masks  # the causal mask reaches the blocks with -65504 in it
    assert _messages(nanwatch_log) == []


def test_a_batch_that_goes_inf_is_reported_not_warned_about(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].weight.fill_(2.0)
    with nanwatch.watch(model) as handle:
        model(_column([6e4], torch.float16))  # 6e4 is within 1.1x of the max; doubled it is inf
        with pytest.raises(NonFiniteError) as info:
            handle.step()
    assert _messages(nanwatch_log) == []
    # Not a warning of its own, but in the report: how the inf came about (the Linear's output, equal to its input in
    # every number, is named once, where it was first recorded).
    assert info.value.report.endswith(
        "\nnumbers near their dtype's limits in the frames checked with this detection (batch_number=0):\n"
        "  0 (Linear) input[0]: float16 abs max 6.00e+04, headroom 1.09x (0.1 bits) below its max 6.55e+04"
    )


def test_many_tensors_at_once_show_ten_lines_and_a_count(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = _passthrough(torch.float16, modules=12)
    with nanwatch.watch(model) as handle:
        model(_column([3e4], torch.float16))
        handle.step()
    (message,) = _messages(nanwatch_log)
    lines = message.splitlines()
    assert len(lines) == 1 + 10 + 1  # the header, ten tensors, the rest counted
    assert lines[-1] == "  ... and 3 more"  # 13 tensors: the input and twelve outputs


def test_eval_batches_and_ranks_are_named(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = _passthrough(torch.float16).eval()
    watcher = Watcher(model, WatchConfig(watch_eval=True, trace_ranks="all"), rank=1, world_size=2)
    watcher.attach()
    watcher.start_batch("eval")
    model(_column([2e4], torch.float16))
    watcher.end_batch()
    watcher.close(check=False)
    (message,) = _messages(nanwatch_log)
    assert message.startswith("nanwatch: numbers near their dtype's limits during eval_batch_number=0 on rank 1:\n")
    # Ranks that log no traces (trace_ranks) do not look either: detection only, at no extra cost.
    for rank, looks in ((1, False), (0, True)):
        other = Watcher(model, WatchConfig(), rank=rank, world_size=2)
        other.attach()
        assert (headroom(other) is not None) == looks
        other.close(check=False)


def test_headroom_can_be_switched_off(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = _passthrough(torch.float16)
    for off in (None, 0):
        with nanwatch.watch(model, headroom_warn_fraction=off) as handle:
            assert handle.config.headroom_warn_fraction is None
            assert headroom(handle.watcher) is None
            model(_column([6e4], torch.float16))
            handle.step()
    assert nanwatch_log.records == []


# ---------------------------------------------------------------------------------------------- target_dtype


def test_target_float16_on_float32_says_what_would_overflow_without_raising(
    nanwatch_log: pytest.LogCaptureFixture,
) -> None:
    # 65519 rounds to 65504 in float16, 65520 rounds to inf: the judgement follows torch's own rounding.
    assert float(torch.tensor(65519.0).half()) == 65504.0
    assert math.isinf(float(torch.tensor(65520.0).half()))
    model = _passthrough(torch.float32, modules=2)
    with torch.no_grad():
        model[1].weight.fill_(65520.0 / 65519.0)  # turns 65519 into 65520 (float32: exact enough, checked below)
    x = _column([65519.0], torch.float32)
    with torch.no_grad():
        assert float(model(x)[0, 0]) == 65520.0
    with nanwatch.watch(model, target_dtype="float16") as handle:
        model(x)
        handle.step()  # a warning, never an error
        model(_column([1.0], torch.float32))
        handle.step()
        monitor = headroom(handle.watcher)
        assert monitor is not None
    (message,) = _messages(nanwatch_log)
    assert message == (
        "nanwatch: numbers near their dtype's limits during batch_number=0:\n"
        "  0 (Linear) input[0]: float32 abs max 6.55e+04, just past float16's max 6.55e+04 (rounds to it)\n"
        "  0 (Linear) output: float32 abs max 6.55e+04, just past float16's max 6.55e+04 (rounds to it)\n"
        "  1 (Linear) output: float32 abs max 6.55e+04 would overflow float16 (1.0002x over its max 6.55e+04)"
    )
    assert [(f.kind, f.module_name, f.label, f.abs_max) for f in monitor.warned] == [
        ("target_headroom", "0", "input[0]", 65519.0),
        ("target_headroom", "0", "output", 65519.0),
        ("target_overflow", "1", "output", 65520.0),
    ]
    assert monitor.largest_abs_max() == 65520.0
    (summary,) = _messages(nanwatch_log, "nanwatch headroom summary")
    assert summary.splitlines()[0] == (
        "nanwatch headroom summary after 2 checks (headroom_warn_fraction=0.125, target_dtype=float16):"
    )
    assert "  would overflow float16: 1 tensor; worst at batch_number=0: 1 (Linear) output" in summary
    assert "  largest abs max of any tensor judged against float16: 6.55e+04 (1.0002x over its max 6.55e+04)" in (
        summary
    )
    assert "underflow not counted (set count_underflow=True" in summary


def test_target_dtype_answers_no_when_everything_fits(nanwatch_log: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4) * 100
    with torch.no_grad():  # computed unwatched: the largest of the input and the two Linear outputs
        expected = max(float(t.abs().max()) for t in (x, model[0](x), model[2](model[0](x).relu())))
    with nanwatch.watch(model, target_dtype="float8_e5m2") as handle:
        model(x)
        handle.step()
    assert _messages(nanwatch_log) == []
    (summary,) = _messages(nanwatch_log, "nanwatch headroom summary")
    assert "no watched tensor would overflow float8_e5m2" in summary
    assert f"largest abs max of any tensor judged against float8_e5m2: {expected:.2e}" in summary
    assert [r.levelno for r in nanwatch_log.records] == [logging.INFO]  # an answer, not a warning


# ------------------------------------------------------------------------------------------------- underflow


def _underflow_values() -> torch.Tensor:
    """float32 values across the range where float16 and float32 lose them, exact boundaries included."""
    generator = torch.Generator().manual_seed(0)
    spread = 10 ** (torch.rand(400, generator=generator, dtype=torch.float64) * 44 - 45)  # 1e-45 .. 1e-1
    signs = torch.where(torch.rand(400, generator=generator) < 0.5, -1.0, 1.0).double()
    fixed = [0.0, 0.0, 2.0**-14, 2.0**-25, float(torch.nextafter(torch.tensor(2.0**-25), torch.tensor(1.0))), 1e-40]
    return torch.cat([spread * signs, torch.tensor(fixed, dtype=torch.float64)]).float()


def test_underflow_counts_are_exact(tmp_path: Path) -> None:
    values = _underflow_values()
    model = nn.Sequential(nn.Identity())
    with nanwatch.watch(model, count_underflow=True, target_dtype="float16", report_dir=tmp_path) as handle:
        model(values)
        (measurement,) = {
            id(e.measurement): e.measurement for f in handle.watcher.recent_frames() for e in f.entries
        }.values()
        handle.step()
        broken = values.clone()
        broken[0] = float("inf")
        model(broken)
        with pytest.raises(NonFiniteError):
            handle.step()
    nonzero = values != 0
    subnormal = int((nonzero & (values.abs() < torch.finfo(torch.float32).smallest_normal)).sum())
    below = int((nonzero & (values.abs() < torch.finfo(torch.float16).smallest_normal)).sum())
    flushed = int((nonzero & (values.half() == 0)).sum())  # what a cast to float16 really does
    assert subnormal > 0
    assert 0 < flushed < below
    assert measurement is not None
    assert measurement.extra["underflow"] is not None
    assert measurement.extra["underflow"][:3].tolist() == [subnormal, below, flushed]
    # The report's JSON carries the counts of each line (the inf changed one value, which was not underflowing).
    document = json.loads((tmp_path / "nanwatch-report-rank0-batch1.json").read_text())
    entry = document["frames"][-1]["entries"][0]
    assert entry["label"] == "input[0]"
    assert abs(float(values[0])) >= 2.0**-14
    assert entry["underflow"] == {"subnormal": subnormal, "target_subnormal": below, "target_zero": flushed}


def test_float16_subnormals_are_counted_and_warned_about(nanwatch_log: pytest.LogCaptureFixture) -> None:
    values = torch.tensor([0.0, 1e-6, -3e-5, 6.2e-5, 1e-8, 0.5, -2.0, 1e-3], dtype=torch.float16)
    model = nn.Sequential(nn.Identity())
    with nanwatch.watch(model, count_underflow=True) as handle:
        model(values)
        (entry, *_) = handle.watcher.recent_frames()[0].entries
        handle.step()
    direct = int(((values != 0) & (values.abs() < torch.finfo(torch.float16).smallest_normal)).sum())
    assert direct == 2  # 1e-6 and -3e-5 (1e-8 is already 0 in float16; 6.2e-5 is normal)
    assert entry.measurement is not None
    assert entry.measurement.extra["underflow"] is not None
    assert entry.measurement.extra["underflow"].tolist()[:3] == [direct, -1, -1]  # no target: not applicable
    (message,) = _messages(nanwatch_log)
    assert "0 (Identity) input[0]: 25.0% of 8 float16 values are subnormal (nonzero, below 6.10e-05)" in message


def test_underflow_is_not_counted_unless_asked(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Identity())
    with nanwatch.watch(model, report_dir=tmp_path) as handle:
        model(torch.tensor([1e-40, float("nan")]))
        assert all(
            e.measurement is None or e.measurement.extra is None for e in handle.watcher.recent_frames()[0].entries
        )
        with pytest.raises(NonFiniteError):
            handle.step()
    document = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text())
    assert all("underflow" not in entry for frame in document["frames"] for entry in frame["entries"])


# ---------------------------------------------------------------------------------------------------- config


def test_config_fields_are_validated() -> None:
    assert WatchConfig().headroom_warn_fraction == 0.125
    assert WatchConfig(headroom_warn_fraction=0).headroom_warn_fraction is None
    assert WatchConfig(headroom_warn_fraction=1).headroom_warn_fraction == 1
    for bad in (1.5, -0.1, True):
        with pytest.raises(ConfigError, match="headroom_warn_fraction"):
            WatchConfig.from_dict({"headroom_warn_fraction": bad})
    for bad_fraction in (0, 2.0, False):
        with pytest.raises(ConfigError, match="underflow_warn_fraction"):
            WatchConfig.from_dict({"underflow_warn_fraction": bad_fraction})
    with pytest.raises(ConfigError, match="target_dtype.*float8_e4m3fn"):
        WatchConfig.from_dict({"target_dtype": "float64"})
    for name in TARGET_DTYPES:
        assert WatchConfig(target_dtype=name).target_dtype == name


# ------------------------------------------------------------------------------ in the report, whatever detects


class _Float16Regressor(nn.Module):
    """A float16 regressor whose output is large enough for float16 (8.4e3), but not squared (7e7)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.body.weight.fill_(0.25)
            self.body.bias.zero_()
            self.head.weight.fill_(2100.0)
            self.head.bias.zero_()
        self.half()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(features))


NEAR_HEAD = "numbers near their dtype's limits in the frames checked with this detection (batch_number=0):"
HEAD_LINE = "  head (Linear) output: float16 abs max 8.40e+03, headroom 7.8x (3.0 bits) below its max 6.55e+04"


@pytest.mark.parametrize("hand_over", [True, False], ids=["watch_loss", "no watch_loss"])
def test_the_value_near_the_limit_that_made_the_loss_overflow_is_in_the_report(hand_over: bool, tmp_path: Path) -> None:
    # The loss, computed outside the model in float16, squares an output of 8.4e3: inf. Handed over, the loss's own
    # frame is inf and the detection is a frame's; before, the headroom warning about the output was never given,
    # since a batch holding inf/nan skipped it, and the report said nothing of it either. Not handed over, the guard
    # stops the step on the gradients: the warning is logged, and now the report holds it too.
    model = _Float16Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    features, targets = torch.ones(3, 4, dtype=torch.float16), torch.zeros(3, 2, dtype=torch.float16)

    def train() -> None:
        with nanwatch.watch(model, optimizer=optimizer, report_dir=tmp_path) as handle:
            loss = nn.functional.mse_loss(model(features), targets)
            if hand_over:
                loss = handle.watch_loss(loss)
            loss.backward()
            optimizer.step()

    with pytest.raises(NonFiniteError) as info:
        train()
    error = info.value
    assert error.module_name == ("(loss)" if hand_over else "body")  # the loss, or the first non-finite gradient
    assert f"\n{NEAR_HEAD}\n{HEAD_LINE}" in error.report
    written = json.loads((tmp_path / "nanwatch-report-rank0-batch0.json").read_text(encoding="utf-8"))
    (finding,) = written["headroom"]
    assert (finding["kind"], finding["module_name"], finding["label"]) == ("headroom", "head", "output")
    assert finding["line"] == HEAD_LINE.strip()
