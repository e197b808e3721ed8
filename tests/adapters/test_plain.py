"""adapters/plain.py: `nanwatch.watch()` in a hand-written loop, driven end to end with real modules and optimizers.

Bad input (empty, bool, int, complex, float8 and meta tensors, None and non-tensors, deep and wide outputs, a
module called twice, a forward that raises, a failure inside nanwatch) must never crash the watcher or hide the
user's own exception. pyproject turns NanwatchWarning into an error, so a test that does not expect one fails if
nanwatch gives up watching.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.models import Cast, Scale, small_mlp
from tests.report_lines import cause_tail
from torch import nn

import nanwatch
import nanwatch.core.stats.cache
import nanwatch.core.stats.grouped
import nanwatch.core.stats.measure
from nanwatch import BatchLimitReached, NanwatchWarning, NonFiniteError, WatchHandle, watch
from nanwatch.core.frames import ResolvedFrame, resolve
from nanwatch.core.walk import MAX_DEPTH, MAX_LEAVES

FRAMES_PER_FORWARD = 5  # 4 children and the root


_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _hook_count(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    count = sum(len(getattr(module, name)) for module in model.modules() for name in _MODULE_HOOK_DICTS)
    if optimizer is not None:
        count += len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
    return count


def _frames(handle: WatchHandle) -> list[ResolvedFrame]:
    return resolve(handle.watcher.recent_frames())


def _lines(handle: WatchHandle, module_name: str) -> dict[str, str]:
    """label -> the report line for it, for the last frame of `module_name`."""
    from nanwatch.core.report import format_entry

    frame = [f for f in _frames(handle) if f.module_name == module_name][-1]
    return {entry.label: format_entry(entry) for entry in frame.entries}


# ----------------------------------------------------------------------------------------------- hook removal


def test_with_block_removes_every_hook_at_its_end() -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        # one per module (and its with_kwargs mark: keyword inputs are recorded), root pre/post, optimizer, and the
        # cause feature's 2 on the root, which keep the micro-batch's forward call: a pre-hook with kwargs (2 entries)
        # and an always-called forward hook with kwargs (3 entries)
        assert _hook_count(model, optimizer) == 2 * FRAMES_PER_FORWARD + 2 + 2 + 5
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        handle.step()
    assert _hook_count(model, optimizer) == 0


def test_close_removes_every_hook_and_can_be_called_twice() -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer=optimizer)
    assert _hook_count(model, optimizer) > 0
    model(torch.randn(2, 4))
    handle.step()
    handle.close()
    assert _hook_count(model, optimizer) == 0
    handle.close()
    with pytest.raises(RuntimeError, match="closed"):
        handle.step()
    model(torch.randn(2, 4))  # the model works as before


class UserError(Exception):
    pass


def test_an_optimizer_that_is_not_one_is_a_type_error_and_leaves_no_hook() -> None:
    # Before: the model's hooks were attached first, then the optimizer refused, and the hooks stayed behind.
    model = small_mlp()
    for wrong in (model.parameters(), list(model.parameters())):
        with pytest.raises(TypeError, match="optimizer= a torch.optim.Optimizer") as info:
            watch(model, optimizer=wrong)  # type: ignore[arg-type]
        assert "\n" not in str(info.value)
        assert _hook_count(model) == 0
    with pytest.raises(TypeError, match=r"the optimizer itself, not model.parameters\(\)"):
        watch(model, optimizer=model.parameters())  # type: ignore[arg-type]
    with watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as handle:  # the model is watchable
        model(torch.randn(2, 4))
        handle.step()
    assert _hook_count(model) == 0


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_what_cannot_be_watched_is_a_one_line_type_error_saying_what_to_do() -> None:
    # Before: AttributeError ('str' object has no attribute 'named_modules') and RuntimeError from torch.jit.
    with pytest.raises(TypeError, match=r"^watch\(\) needs a torch.nn.Module, got str$"):
        watch("not a model")  # type: ignore[arg-type]
    scripted = torch.jit.script(small_mlp())
    with pytest.raises(TypeError, match="cannot watch a torch.jit.ScriptModule") as info:
        watch(scripted)
    assert "Watch the module before scripting it" in str(info.value)
    assert "\n" not in str(info.value)
    assert _hook_count(scripted) == 0


def test_a_forward_that_raises_propagates_the_same_exception_and_hooks_are_removed() -> None:
    class RaisesTheUsersError(nn.Module):
        def __init__(self, error: Exception) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self.error = error

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.linear(x)
            raise self.error

    error = UserError("the user's own bug")
    model = RaisesTheUsersError(error)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserError) as info, watch(model, optimizer=optimizer):
        model(torch.ones(1, 2))
    assert info.value is error
    assert info.value.__context__ is None  # nanwatch raised nothing on the way out
    assert _hook_count(model, optimizer) == 0


def test_the_users_exception_wins_over_a_pending_detection(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = small_mlp()
    model[2].factor = math.inf
    error = UserError("data loader broke")

    def loop() -> None:
        with watch(model):
            model(torch.randn(2, 4))
            raise error

    with pytest.raises(UserError) as info:
        loop()
    assert info.value is error
    assert _hook_count(model) == 0
    # What was seen is still logged, so the inf is not lost.
    assert any("Detected inf/nan during batch_number=0" in r.getMessage() for r in nanwatch_log.records)


def test_hooks_are_removed_when_detection_raises_inside_the_block() -> None:
    model = small_mlp()
    model[2].factor = math.inf
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        model(torch.randn(2, 4))
        with pytest.raises(NonFiniteError):
            handle.step()
        assert _hook_count(model, optimizer) == 0  # removed before the error left nanwatch, as the other adapters do
    assert _hook_count(model, optimizer) == 0

    def loop() -> None:
        with watch(model, optimizer=optimizer) as handle:
            model(torch.randn(2, 4))
            handle.step()

    with pytest.raises(NonFiniteError):  # and when the error leaves the block
        loop()
    assert _hook_count(model, optimizer) == 0


def test_detection_at_the_end_of_the_block_raises_and_removes_hooks() -> None:
    model = small_mlp()
    model[2].factor = math.inf
    with pytest.raises(NonFiniteError) as info, watch(model):
        model(torch.randn(2, 4))  # no step(): the block's end checks what is pending
    assert info.value.module_name == "2"
    assert _hook_count(model) == 0


def test_hooks_are_removed_when_the_batch_limit_stops_the_run() -> None:
    model = small_mlp()

    def loop() -> None:
        with watch(model, abort_after_batch_num=0) as handle:
            model(torch.randn(2, 4))
            handle.step()

    with pytest.raises(BatchLimitReached):
        loop()
    assert _hook_count(model) == 0


# ---------------------------------------------------------------------------------------------------- counting


def test_batch_number_advances_only_with_step() -> None:
    model = small_mlp()
    with watch(model, watch_eval=True) as handle:
        assert handle.batch_number == 0
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
        assert handle.batch_number == 0
        handle.step()
        assert handle.batch_number == 1
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))
        assert handle.batch_number == 1
        assert handle.watcher.counters.eval_batch_number == 1
        model.train()
        model(torch.randn(2, 4))
        handle.step()
        assert handle.batch_number == 2
        assert {f.batch_number for f in handle.watcher.recent_frames() if f.phase == "train"} == {0, 1}


def test_detection_error_carries_the_batch_module_and_report(tmp_path: Path) -> None:
    model = small_mlp()
    x = torch.randn(2, 4)

    def loop() -> None:
        with watch(model, report_dir=tmp_path) as handle:
            for batch in range(3):
                if batch == 2:
                    model[2].factor = math.inf
                model(x)
                handle.step()

    with pytest.raises(NonFiniteError) as info:
        loop()
    error = info.value
    assert isinstance(error, ValueError)  # code written for transformers' ValueError still catches it
    assert (error.batch_number, error.rank, error.module_name, error.phase) == (2, 0, "2", "train")
    assert "batch_number=2" in str(error)
    # 13 frames: the two clean batches (5 frames each), then batch 2 up to the Scale that made the inf.
    assert error.report.startswith("Detected inf/nan during batch_number=2\nLast 13 forward frames:\n")
    # The frames end at the Scale, then a blank line, the cause, the repro capsule and the culprit: the Scale made
    # the nan from finite inputs, and its factor (inf) makes it in float64 too: no dtype's range is to blame.
    assert error.report.endswith(
        "                  2 Scale\n0.00e+00 9.95e-02 input[0]\n     nan      nan output\n\n"
        "cause: unknown: recomputed in float64 from the same inputs and weights the culprit is non-finite too: not a "
        "matter of float32's range\n"
        f"repro capsule: {tmp_path / 'nanwatch-capsule-rank0-batch2.pt'} (`nanwatch repro` runs the culprit alone; "
        "see docs/why-nan.md)\n"
        "first non-finite value produced by 2 (Scale): inputs finite (abs max 9.95e-02), output nan (float32)"
    )
    assert error.capsule == str(tmp_path / "nanwatch-capsule-rank0-batch2.pt")


def test_report_dir_holds_text_and_json_before_the_error_propagates(tmp_path: Path) -> None:
    report_dir = tmp_path / "reports" / "nested"  # created on demand
    model = small_mlp()
    with watch(model, report_dir=report_dir) as handle:
        model(torch.randn(2, 4))
        handle.step()
        model[2].factor = math.nan
        model(torch.randn(2, 4))
        found: dict[str, Any] = {}

        def step_and_look() -> None:
            try:
                handle.step()
            except NonFiniteError:
                # Still unwinding from the raise: the files must already be there.
                found["text"] = (report_dir / "nanwatch-report-rank0-batch1.txt").read_text()
                found["json"] = json.loads((report_dir / "nanwatch-report-rank0-batch1.json").read_text())
                raise

        with pytest.raises(NonFiniteError) as info:
            step_and_look()
    assert found["text"] == info.value.report + "\n"
    data = found["json"]
    assert data["batch_number"] == 1
    assert data["module_name"] == "2"
    assert data["frames"][-1]["module"] == "2"
    assert data["frames"][-1]["entries"][-1]["abs_max"] == "nan"


def test_trace_logs_every_frame_of_the_chosen_batches(nanwatch_log: pytest.LogCaptureFixture) -> None:
    # No report_dir: the frames go to the log (with one, to the trace files: tests/core/features/test_trace.py).
    model = small_mlp()
    with watch(model, trace_batch_nums=[1, 3]) as handle:
        for _ in range(5):
            model(torch.randn(2, 4))
            handle.step()
    # Trace records are frames: each starts with the module line's indent (the detection report would not).
    trace = [r.getMessage() for r in nanwatch_log.records if r.getMessage().startswith(" " * 18)]
    assert len(trace) == 2 * FRAMES_PER_FORWARD  # one record per frame
    assert trace[0].startswith("                  *** Starting batch number=1 ***\nabs min  abs max  metadata\n")
    assert trace[FRAMES_PER_FORWARD].startswith("                  *** Starting batch number=3 ***\n")
    assert "Starting" not in trace[1]
    assert trace[1].startswith("                  1 ReLU\n")
    assert trace[FRAMES_PER_FORWARD - 1].startswith("                   Sequential\n")
    assert "weight" in trace[0]


def test_the_ring_stays_bounded_after_traced_batches() -> None:
    model = small_mlp()
    sizes: list[int] = []

    def loop() -> None:
        with watch(model, max_frames_to_save=4, trace_batch_nums=[0, 1, 2]) as handle:
            for batch in range(8):
                if batch == 6:
                    model[2].factor = math.inf
                model(torch.randn(2, 4))
                sizes.append(len(handle.watcher.recent_frames()))
                handle.step()
                sizes.append(len(handle.watcher.recent_frames()))

    with pytest.raises(NonFiniteError) as info:
        loop()
    assert len(sizes) == 13
    assert max(sizes[1::2]) == 4  # after each step: the ring alone, never more than asked
    assert max(sizes[0::2]) == 4 + FRAMES_PER_FORWARD
    assert info.value.report.count("\n                  ") == 4  # 4 frames, as asked, long after the trace
    assert "Last 4 forward frames:" in info.value.report


def test_abort_after_batch_num_stops_after_that_batch() -> None:
    model = small_mlp()
    ran = []

    def loop() -> None:
        with watch(model, abort_after_batch_num=2) as handle:
            for batch in range(10):
                model(torch.randn(2, 4))
                ran.append(batch)
                handle.step()

    with pytest.raises(BatchLimitReached) as info:
        loop()
    assert ran == [0, 1, 2]
    assert info.value.batch_number == 2
    assert isinstance(info.value, ValueError)


def test_config_from_a_dict_a_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "watch.json"
    path.write_text(json.dumps({"max_frames_to_save": 3, "watch_eval": True}))
    for config in (path, str(path), {"max_frames_to_save": 3, "watch_eval": True}):
        with watch(small_mlp(), config, trace_batch_nums=[7]) as handle:
            assert handle.config.max_frames_to_save == 3
            assert handle.config.watch_eval
            assert handle.config.trace_batch_nums == [7]


def test_data_parallel_is_looked_through() -> None:
    model = small_mlp()
    wrapped = nn.DataParallel(model)  # with no GPU it simply calls the module
    with watch(wrapped) as handle:
        assert handle.model is model
        wrapped(torch.randn(2, 4))
        assert [f.module_name for f in handle.watcher.recent_frames()] == ["0", "1", "2", "3", ""]


def test_fp16_overflow_in_a_real_layer_is_caught() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
        model[2].weight.fill_(300.0)
    x = torch.full((2, 8), 30.0, dtype=torch.float16)  # Linear 0 gives 240, Linear 2 gives 8 * 240 * 300 > 65504
    with watch(model) as handle:
        model(x)
        with pytest.raises(NonFiniteError) as info:
            handle.step()
    assert info.value.module_name == "2"
    frame_text, footer = info.value.report.split("                  2 Linear\n")[1].split("\n\n")
    frame_lines = frame_text.splitlines()
    assert frame_lines[0] == "3.00e+02 3.00e+02 weight"
    assert frame_lines[-1].split()[1] == "inf"
    # The cause (no report_dir: no capsule), then the culprit line.
    assert footer.splitlines() == cause_tail(info.value)[1:]
    assert info.value.cause is not None
    assert (info.value.cause.kind, info.value.cause.module_name) == ("precision", "2")
    # 8 * 240 * 300 = 576000 (and the bias): finite in float32
    assert info.value.cause.details["needed_abs_max"] == pytest.approx(8 * 240 * 300, rel=1e-5)
    assert footer.splitlines()[-1].startswith(
        "first non-finite value produced by 2 (Linear): inputs finite (abs max 2.40e+02)"
    )


# -------------------------------------------------------------------------------------------------------- eval


def test_eval_forwards_are_not_recorded_by_default() -> None:
    model = small_mlp()
    model[2].factor = math.inf
    model.eval()
    with watch(model) as handle, torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4))  # inf, but eval is not watched
        assert handle.watcher.recent_frames() == []
        assert handle.watcher.counters.eval_batch_number == 0
        assert handle.batch_number == 0


def test_eval_forwards_are_checked_and_counted_apart_with_watch_eval(tmp_path: Path) -> None:
    model = small_mlp()
    with watch(model, watch_eval=True, report_dir=tmp_path) as handle:
        model(torch.randn(2, 4))
        handle.step()
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))
            assert handle.watcher.counters.eval_batch_number == 1
            model[2].factor = math.inf
            with pytest.raises(NonFiniteError) as info:
                model(torch.randn(2, 4))  # raised as the eval forward returns: nobody calls step() in eval
        assert info.value.phase == "eval"
        assert info.value.batch_number == 1
        assert info.value.report.startswith("Detected inf/nan during eval_batch_number=1\n")
        assert (tmp_path / "nanwatch-report-eval-rank0-batch1.txt").is_file()
        model[2].factor = 1.0
        model.train()
        model(torch.randn(2, 4))
        with pytest.warns(NanwatchWarning, match="the batches since nanwatch raised .* are not watched"):
            handle.step()  # the hooks went with the error: counted, not recorded, and said once
        assert handle.batch_number == 2
    assert _hook_count(model) == 0


# -------------------------------------------------------------------------------------------- optimizer guard


def test_optimizer_guard_stops_the_step_before_inf_reaches_the_weights() -> None:
    model = small_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 4)
    before: dict[str, torch.Tensor] = {}

    def loop() -> None:
        with watch(model, optimizer=optimizer) as handle:
            for batch in range(4):
                if batch == 2:
                    model[2].factor = math.inf
                model(x).sum().backward()
                before.update({name: p.detach().clone() for name, p in model.named_parameters()})
                optimizer.step()
                optimizer.zero_grad()
                handle.step()

    with pytest.raises(NonFiniteError) as info:
        loop()
    assert info.value.batch_number == 2
    assert info.value.optimizer_step == 2  # two steps completed before the guard stopped the third
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed although its step carried inf"
        assert torch.isfinite(param).all()


def test_optimizer_guard_with_gradient_accumulation() -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer=optimizer)
    try:
        model(torch.randn(2, 4)).sum().backward()
        handle.step()  # micro-batch 0, clean, no optimizer step yet
        model[2].factor = math.inf
        model(torch.randn(2, 4)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(NonFiniteError) as info:
            optimizer.step()
        assert info.value.batch_number == 1
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert handle.optimizer_step == 0
    finally:
        handle.close()
    assert _hook_count(model, optimizer) == 0


# ---------------------------------------------------------------------------------------------------- bad input


def test_empty_parameters_get_a_line_not_a_crash() -> None:
    class Sharded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(0))  # what a sharded or placeholder parameter looks like
            self.bias = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.bias

    model = nn.Sequential(Sharded())
    with watch(model) as handle:
        model(torch.ones(2, 3))
        lines = _lines(handle, "0")
        handle.step()
    assert lines["weight"] == "            empty weight"
    assert lines["bias"] == "1.00e+00 1.00e+00 bias"


def test_bool_int_complex_and_float8_tensors_get_lines() -> None:
    class OddDtypes(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return x > 0, (x * 10).long(), torch.complex(x, x), x.to(torch.float8_e4m3fn), x.to(torch.float8_e5m2)

    model = nn.Sequential(OddDtypes())
    x = torch.tensor([[-2.0, 0.5], [4.0, -1.0]])
    with watch(model) as handle:
        model(x)
        lines = _lines(handle, "0")
        handle.step()
    assert lines["output[0]"] == "0.00e+00 1.00e+00 output[0]"
    assert lines["output[1]"] == "5.00e+00 4.00e+01 output[1]"
    assert lines["output[2]"] == f"{0.5 * math.sqrt(2):8.2e} {4 * math.sqrt(2):8.2e} output[2]"
    assert lines["output[3]"] == "5.00e-01 4.00e+00 output[3]"
    assert lines["output[4]"] == "5.00e-01 4.00e+00 output[4]"


@pytest.mark.parametrize(
    ("dtype", "line"),
    [
        (torch.uint16, "3.00e+00 6.55e+04 output"),
        (torch.uint32, "3.00e+00 4.29e+09 output"),
        (torch.uint64, "uint64 not measured output"),
    ],
    ids=["uint16", "uint32", "uint64"],
)
def test_wide_unsigned_outputs_keep_watching_on(dtype: torch.dtype, line: str) -> None:
    # Before: measuring them raised NotImplementedError, and watching stopped (a NanwatchWarning, an error here).
    top = 2**32 - 1 if dtype is torch.uint32 else 2**16 - 1  # uint64's own maximum is no int64
    scale = Scale()
    model = nn.Sequential(Cast(dtype), Cast(torch.float32), scale)
    x = torch.tensor([3, top])
    with watch(model) as handle:
        for _ in range(3):
            model(x)
            lines = _lines(handle, "0")
            handle.step()
        assert lines["output"] == line
        cast = [frame for frame in _frames(handle) if frame.module_name == "0"][-1]
        output = next(entry for entry in cast.entries if entry.label == "output")
        if dtype is torch.uint64:
            assert (output.abs_min, output.abs_max, output.note) == (None, None, "uint64 not measured")
        else:
            assert (output.abs_min, output.abs_max) == (3, top)  # exact, not a float's rounding of them
        scale.factor = math.inf  # a later float module goes inf: still found
        model(x)
        with pytest.raises(NonFiniteError) as info:
            handle.step()
        assert handle.watcher.disabled_reason is None
    assert info.value.module_name == "2"
    assert info.value.batch_number == 3
    assert f"\n{line}\n" in info.value.report


def test_inf_in_a_float8_output_is_detected() -> None:
    model = nn.Sequential(nn.Identity(), Cast(torch.float8_e5m2))
    with watch(model) as handle:
        model(torch.tensor([1.0, 1e6]))  # beyond e5m2's range: inf
        with pytest.raises(NonFiniteError) as info:
            handle.step()
    assert info.value.module_name == "1"


def test_meta_device_modules_are_skipped_with_a_reason() -> None:
    with torch.device("meta"):
        model = small_mlp()
    with watch(model) as handle:
        output = model(torch.empty(2, 4, device="meta"))
        assert output.device.type == "meta"
        lines = _lines(handle, "0")
        handle.step()
    assert lines["weight"] == "meta: not measured weight"
    assert lines["output"] == "meta: not measured output"


def test_none_and_non_tensor_inputs_and_outputs() -> None:
    class MixedArguments(nn.Module):
        def forward(self, x: torch.Tensor, mask: Any, scale: float, name: str) -> Any:
            return {"hidden": x * scale, "mask": mask, "name": name, "extra": (None, 3)}

    model = nn.Sequential()
    model.add_module("mixed", MixedArguments())
    with watch(model) as handle:
        model.mixed(torch.ones(2), None, 2.0, "layer")
        lines = _lines(handle, "mixed")
        handle.step()
    assert lines == {
        "input[0]": "1.00e+00 1.00e+00 input[0]",
        "input[1]": "             None input[1]",
        "input[2]": "     not a tensor input[2]",
        "input[3]": "     not a tensor input[3]",
        "output.hidden": "2.00e+00 2.00e+00 output.hidden",
        "output.mask": "             None output.mask",
        "output.name": "     not a tensor output.name",
        "output.extra[0]": "             None output.extra[0]",
        "output.extra[1]": "     not a tensor output.extra[1]",
    }


def test_a_module_returning_none() -> None:
    class Side(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            return None

    model = nn.Sequential(Side())
    with watch(model) as handle:
        model(torch.ones(1))
        assert _lines(handle, "0")["output"] == "             None output"
        handle.step()


def test_deeply_nested_and_very_wide_outputs() -> None:
    class Deep(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            value: Any = x
            for _ in range(MAX_DEPTH + 20):
                value = (value,)
            return value

    class Wide(nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [x * i for i in range(MAX_LEAVES + 500)]

    deep, wide = Deep(), Wide()
    holder = nn.ModuleDict({"deep": deep, "wide": wide})
    with watch(holder) as handle:
        deep(torch.ones(1))
        wide(torch.ones(1))
        deep_lines = _lines(handle, "deep")
        wide_lines = _lines(handle, "wide")
        handle.step()
    assert list(deep_lines.values()) == ["1.00e+00 1.00e+00 input[0]", "  nested too deep output" + "[0]" * MAX_DEPTH]
    assert len(wide_lines) == 1 + MAX_LEAVES + 1
    assert wide_lines["output[1]"] == "1.00e+00 1.00e+00 output[1]"
    assert wide_lines["output (not shown: 500 more)"] == "        not shown output (not shown: 500 more)"


def test_a_module_called_twice_in_one_forward_gets_two_frames_and_detection_names_it() -> None:
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Scale(2.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(self.block(x))

    model = Reuse()
    with watch(model) as handle:
        model(torch.ones(2))
        frames = _frames(handle)
        handle.step()
        assert [f.module_name for f in frames] == ["block", "block", ""]
        assert [e.abs_max for e in frames[1].entries] == [2.0, 4.0]
        model.block.factor = 1e38
        model(torch.full((2,), 1e2))  # the first call stays finite, the second overflows fp32
        with pytest.raises(NonFiniteError) as info:
            handle.step()
    assert info.value.module_name == "block"
    assert info.value.report.count("                  block Scale") >= 2


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensors_in_an_eval_transformer_encoder() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 5, 8)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:] = True
    with watch(encoder, watch_eval=True) as handle, torch.no_grad():
        encoder(x, src_key_padding_mask=mask)
        linear = [f for f in _frames(handle) if f.module_name == "layers.0.linear1"][0]
        assert all(e.abs_max is not None and math.isfinite(e.abs_max) for e in linear.entries)
        nested = [e for e in linear.entries if e.label in ("input[0]", "output")]
        assert [e.shape for e in nested] == [None, None]  # nested tensors: measured, with no single shape
        assert handle.watcher.counters.eval_batch_number == 1


def test_a_model_built_and_run_under_inference_mode() -> None:
    with torch.inference_mode():
        model = small_mlp().eval()
        with watch(model, watch_eval=True) as handle:
            model(torch.randn(2, 4))
            assert _lines(handle, "0")["weight"].endswith(" weight")
            model[2].factor = math.inf
            with pytest.raises(NonFiniteError):
                model(torch.randn(2, 4))


@pytest.mark.cpu_path  # measure() as each call returns: the CPU's way
def test_an_internal_failure_disables_watching_and_training_continues(monkeypatch: pytest.MonkeyPatch) -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 4)

    def broken(tensor: torch.Tensor, kernels: object = ()) -> nanwatch.core.stats.measure.Measurement:
        raise RuntimeError("simulated bookkeeping bug")

    with watch(model, optimizer=optimizer) as handle:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.step()
        # Every module that calls measure(): the cache (activations, losses, untracked parameters) and the stacks
        # (the tracked parameters measured one by one).
        for module in (nanwatch.core.stats.cache, nanwatch.core.stats.grouped):
            monkeypatch.setattr(module, "measure", broken)
        with pytest.warns(NanwatchWarning, match="stopped watching.*simulated bookkeeping bug"):
            model(x).sum().backward()
        for _ in range(3):  # the run goes on: steps, optimizer steps, counters
            optimizer.step()
            optimizer.zero_grad()
            handle.step()
            model(x).sum().backward()
        assert handle.batch_number == 4
        assert handle.optimizer_step == 4
        assert handle.watcher.disabled_reason is not None
    assert _hook_count(model, optimizer) == 0


class Fussy(torch.Tensor):
    """A tensor subclass that refuses abs(): nanwatch's measuring fails on it, the user's model does not."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.abs, torch.abs, torch.Tensor.abs_, torch.aminmax):
            raise RuntimeError("Fussy tensors have no abs")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_that_breaks_measuring_disables_watching_only() -> None:
    class MakeFussy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.as_subclass(Fussy)

    model = nn.Sequential(nn.Linear(2, 2), MakeFussy(), nn.Linear(2, 2))
    x = torch.randn(3, 2)
    with watch(model) as handle:
        with pytest.warns(NanwatchWarning, match="Fussy tensors have no abs"):
            output = model(x)
        assert isinstance(output, Fussy)
        handle.step()
        model(x)
        handle.step()
        assert handle.batch_number == 2
    assert _hook_count(model) == 0


def test_step_before_optimizer_step_still_checks_every_micro_batch() -> None:
    """A loop that calls handle.step() before optimizer.step(): each micro-batch is checked at its own step()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    inputs = torch.randn(2, 4)
    seen_at = None
    with nanwatch.watch(model, optimizer=optimizer) as handle:
        try:
            for micro_batch in range(6):
                batch = inputs.clone()
                if micro_batch == 3:
                    batch[0, 0] = float("inf")
                model(batch).sum().backward()
                handle.step()
                optimizer.step()
                optimizer.zero_grad()
        except nanwatch.NonFiniteError as error:
            seen_at = (error.batch_number, micro_batch)
    assert seen_at == (3, 3)


def _line_of(text: str, function: Any) -> int:
    """The line number of the first line of `function` that holds `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(index for index, line in enumerate(lines) if text in line)


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, handle: WatchHandle, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        handle.step()


def test_an_unguarded_optimizer_stepping_the_model_is_warned_about_once() -> None:
    # watch(model) without optimizer=: a step that applies inf/nan runs (the weights go nan) before step() checks.
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = nn.Linear(2, 2)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with nanwatch.watch(model) as handle:
        for _ in range(2):  # backward alone, and another model's optimizer: no step of this model's weights
            model(torch.randn(2, 4)).sum().backward()
            other(torch.randn(1, 2)).sum().backward()
            other_optimizer.step()
            handle.step()
        with pytest.warns(NanwatchWarning) as record:
            _train_steps(model, optimizer, handle, 3)
    messages = [str(warning.message) for warning in record]
    assert len(messages) == 1, messages
    assert "this SGD steps the watched model's weights unguarded" in messages[0]
    assert "nanwatch.watch(model, optimizer=optimizer)" in messages[0]
    assert record[0].filename == __file__  # the user's optimizer.step() line, not torch's


def test_a_guarded_optimizer_and_a_model_that_is_only_run_forward_hear_nothing_of_it() -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model) as handle:
        handle.guard(optimizer)  # guarded after watch(): as good as optimizer=
        _train_steps(model, optimizer, handle, 2)
    with nanwatch.watch(model, optimizer=optimizer) as handle:
        _train_steps(model, optimizer, handle, 2)
    with nanwatch.watch(model) as handle, torch.no_grad():
        model(torch.randn(2, 4))
        handle.step()
    assert _hook_count(model, optimizer) == 0


def test_going_on_after_catching_a_detection_blames_nothing_that_is_not_there() -> None:
    # A notebook, or a loop that catches the error and goes on: the hooks went with the error. Before, the next
    # steps warned that the model "runs inside code compiled by torch.compile", which nobody used.
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = nanwatch.watch(model, optimizer=optimizer)
    caught: list[int] = []

    def loop() -> None:
        for micro_batch in range(5):
            x = torch.randn(2, 4)
            if micro_batch == 1:
                x[0, 0] = float("inf")
            try:
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                handle.step()
            except NonFiniteError as error:
                caught.append(error.batch_number)

    with pytest.warns(NanwatchWarning) as record:
        loop()
    handle.close()
    messages = [str(warning.message) for warning in record]
    assert caught == [1]
    assert not any("torch.compile" in message for message in messages), messages
    assert len(messages) == 1, messages
    assert "the batches since nanwatch raised (or was closed) are not watched" in messages[0]
    assert record[0].lineno == _line_of("handle.step()", loop)  # said at a step(), the line of the user's loop


def test_a_batch_with_only_eval_forwards_is_said_to_have_none_in_training_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing was compiled (whatever other tests in this process compiled): torch.compile is not named.
    monkeypatch.setattr(nanwatch.core.watcher, "compiled_anything", lambda: False)
    model = small_mlp()
    with nanwatch.watch(model) as handle:
        model.eval()
        model(torch.randn(2, 4))
        with pytest.warns(NanwatchWarning) as record:
            handle.step()
    message = str(record[0].message)
    assert "torch.compile" not in message
    assert "no forward of the watched model ran in training mode" in message


@pytest.mark.slow
def test_each_warning_is_printed_once(tmp_path: Path) -> None:
    # Before, every NanwatchWarning was printed twice on stderr: by the nanwatch logger and by Python's warnings.
    # A handler the user adds to the nanwatch logger still gets it (the second run: one writing to stdout).
    script = tmp_path / "twice.py"
    script.write_text(
        "import logging, sys, torch, nanwatch\n"
        "model = torch.nn.Linear(2, 2)\n"
        "handle = nanwatch.watch(model)\n"
        "handle.step()  # no forward ran: nothing was recorded, which is warned about\n"
        "handle.close()\n"
        "logging.getLogger('nanwatch').addHandler(logging.StreamHandler(sys.stdout))\n"
        "handle = nanwatch.watch(model)\n"
        "handle.step()  # the same warning, from a new handle\n"
        "handle.close()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, check=True)
    said = "no watched module recorded anything during batch_number=0"
    assert done.stderr.count(said) == 2, done.stderr  # once per run
    assert done.stderr.count("NanwatchWarning") == 2, done.stderr
    assert done.stdout.count(said) == 1, done.stdout


def test_an_optimizer_passed_where_the_config_goes_is_told_to_use_its_keyword() -> None:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanwatch.ConfigError, match=r"got SGD, an optimizer: pass it by keyword, .*optimizer=optimizer"):
        nanwatch.watch(model, optimizer)  # type: ignore[arg-type]
    with pytest.raises(nanwatch.ConfigError, match=r"got GradScaler, a scaler: pass it by keyword, .*scaler=scaler"):
        nanwatch.watch(model, torch.amp.GradScaler("cpu", enabled=False))  # type: ignore[arg-type]
    assert _hook_count(model) == 0


def test_a_subclassed_optimizer_whose_step_calls_super_is_checked_and_counted_once_a_step() -> None:
    # torch wraps each optimizer class's step() with the hooks once an instance of it exists: SGD's and the
    # subclass's both run them when the subclass calls super().step().
    class Logged(torch.optim.SGD):
        calls = 0

        def step(self, closure: Any = None) -> Any:
            Logged.calls += 1
            return super().step(closure)

    model = small_mlp()
    torch.optim.SGD(model.parameters(), lr=0.1)  # an SGD instance: SGD.step is wrapped from now on
    optimizer = Logged(model.parameters(), lr=0.1)
    with watch(model, optimizer=optimizer) as handle:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            handle.step()
        assert Logged.calls == 3
        assert handle.watcher.counters.optimizer_step == 3
