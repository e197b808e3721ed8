"""The GPU path, checked on one CUDA device: what the CPU suite cannot show.

Seven checks, each printing its figures (and all of them into --output as JSON):

1. oracle: a tiny random GPT-2 on the GPU, in fp16 and in bf16, overflows in `h.1.mlp.c_fc`; transformers'
   `DebugUnderflowOverflow` (the oracle) and `nanwatch.watch` see the same batches. The frames nanwatch reports must
   be transformers' frames line for line (its keyword-input lines aside), and the batch and culprit the same.
2. syncs: the host synchronisations CUDA's sync debug mode counts during forward and backward, unwatched, watched
   (full mode) and in sentinel mode, in fp16 autocast and in bf16: watching must add none inside the step (the one
   host read a step needs is in `handle.step()`, counted apart).
3. sentinel: on the GPU, a deterministic fp16 overflow is reproduced by the replay, and a nan injected once (as a
   flipped bit would be) is called a transient fault. floor: a GradScaler's scale falling below `min_loss_scale`
   stops the run (the scale copied in the hook, read with the check).
4. compiled: a compiled (inductor, Triton) model watched in fp16 reports the culprit with no graph break.
5. step: what a whole training step costs the GPU per mode (none, full, sentinel; AdamW with `foreach` and with
   `fused`): host synchronisations per step (CUDA's sync debug mode, optimizer step included: sentinel mode with a
   fused AdamW must make none), kernel launches per step and per module call (the profiler), and the step time
   against the unwatched one, on the GPT-2 benchmark's shape (4 layers x 256) and a bigger one (12 layers x 768).
6. graphs: sentinel mode on a model compiled with `mode="reduce-overhead"` (CUDA graphs): whether it runs, its
   syncs per step and its step time against the same compiled model unwatched.
7. ranges: the multi-tensor measurement CUDA takes (core/stats/pooled.py) against `abs().aminmax()` of each tensor,
   in every float dtype: shapes from 0-d to several 64K-element chunks, nan, inf, tensors of infs only, -0.0,
   subnormals; every number must be the same.

The overhead of the plain benchmark on the GPU is also `benchmarks/overhead.py --device cuda`.

    python benchmarks/gpu_check.py --output gpu-check.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _shared import module_calls
from torch import nn

import nanwatch
from nanwatch import NonFiniteError

MODULE_LINE = re.compile(r"^ {17} (\S*) (\S+)$")
KEYWORD_LINE = re.compile(r"^.{17} input\.[A-Za-z_]\w*$")
BATCH_MARK = re.compile(r"^ {17} \*\*\* Starting batch number=(\d+) \*\*\*$")
TABLE_HEADER = "abs min  abs max  metadata"


def tiny_gpt2(dtype: torch.dtype, device: torch.device, scale: float) -> nn.Module:
    """A random two-layer GPT-2 whose `h.1.mlp.c_fc` weight grows by `scale` each time `grow` is called."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2Model(config).to(device=device, dtype=dtype).train()
    model.grow_by = scale  # type: ignore[assignment]
    return model


def grow(model: nn.Module) -> None:
    with torch.no_grad():
        model.h[1].mlp.c_fc.weight.mul_(model.grow_by)  # type: ignore[index,union-attr,operator]


def ids_for(batch: int, device: torch.device) -> torch.Tensor:
    return torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(batch)).to(device)


# ----------------------------------------------------------------------------------------------- 1. the oracle


def oracle_frames(stdout: str) -> tuple[str, list[str]]:
    _, dump = stdout.split("\nDetected inf/nan", 1)
    lines = ("Detected inf/nan" + dump).splitlines()
    body = [line for line in lines[3:] if line.strip() and line != TABLE_HEADER and not BATCH_MARK.match(line)]
    return lines[0], body


def nanwatch_frames(report: str) -> tuple[str, list[str]]:
    lines = report.splitlines()
    body = lines[3:]
    end = body.index("") if "" in body else len(body)
    return lines[0], [line for line in body[:end] if not KEYWORD_LINE.match(line)]


def check_oracle(dtype: torch.dtype, device: torch.device, scale: float, batches: int) -> dict[str, Any]:
    from transformers.debug_utils import DebugUnderflowOverflow

    oracle_model = tiny_gpt2(dtype, device, scale)
    watched_model = copy.deepcopy(oracle_model)
    DebugUnderflowOverflow(oracle_model, max_frames_to_save=40)
    printed = io.StringIO()
    oracle_batch = None
    with contextlib.redirect_stdout(printed):
        for batch in range(batches):
            try:
                oracle_model(ids_for(batch, device), use_cache=False, return_dict=False)
            except ValueError:
                oracle_batch = batch
                break
            grow(oracle_model)
    error: NonFiniteError | None = None
    with nanwatch.watch(watched_model, max_frames_to_save=40, report_dir=None) as handle:
        for batch in range(batches):
            watched_model(ids_for(batch, device), use_cache=False, return_dict=False)
            try:
                handle.step()
            except NonFiniteError as caught:
                error = caught
                break
            grow(watched_model)
    if oracle_batch is None or error is None:
        return {"dtype": str(dtype), "ok": False, "why": f"oracle batch {oracle_batch}, nanwatch error {error!r}"}
    oracle_header, oracle_lines = oracle_frames(printed.getvalue())
    header, lines = nanwatch_frames(error.report)
    differing = [(a, b) for a, b in zip(oracle_lines, lines, strict=False) if a != b]
    ok = header == oracle_header and len(lines) == len(oracle_lines) and not differing
    return {
        "dtype": str(dtype),
        "ok": ok,
        "batch": error.batch_number,
        "oracle_batch": oracle_batch,
        "culprit": error.module_name,
        "lines_compared": len(oracle_lines),
        "nanwatch_lines": len(lines),
        "first_differences": differing[:5],
        "header": header,
        "oracle_header": oracle_header,
    }


# ----------------------------------------------------------------------------------------------- 2. host syncs


@contextlib.contextmanager
def counted_syncs(counts: list[int]) -> Iterator[None]:
    """Count the synchronising CUDA calls made inside the block (CUDA's sync debug mode, as warnings)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts.append(sum("synchronizing" in str(w.message).lower() for w in seen))


def check_syncs(precision: str, variant: str, device: torch.device, steps: int) -> dict[str, Any]:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = tiny_gpt2(dtype, device, 1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16-autocast" else None
    handle = None
    if variant != "none":
        mode = "sentinel" if variant == "sentinel" else "full"
        handle = nanwatch.watch(model, mode=mode, optimizer=optimizer, scaler=scaler, report_dir=None)
    in_step: list[int] = []
    in_check: list[int] = []
    for batch in range(steps):
        ids = ids_for(batch, device)
        torch.cuda.synchronize()
        with counted_syncs(in_step):
            with torch.autocast("cuda", dtype=torch.float16, enabled=precision == "fp16-autocast"):
                loss = model(ids, use_cache=False).last_hidden_state.float().pow(2).mean()
            (scaler.scale(loss) if scaler else loss).backward()
        if handle is not None:
            with counted_syncs(in_check):
                handle.step()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if handle is not None:
        handle.close()
    return {
        "precision": precision,
        "variant": variant,
        "steps": steps,
        "syncs_in_forward_backward": in_step,
        "syncs_in_handle_step": in_check,
    }


# ----------------------------------------------------------------------------------------------- 3. the sentinel

_FAULTS: list[bool] = []


class FaultsOnce(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if _FAULTS and _FAULTS.pop():
            y = y * float("nan")
        return y


def sentinel_verdict(
    build: Callable[[], nn.Module], inputs: Callable[[int], torch.Tensor], arm_at: int
) -> dict[str, Any]:
    model = build()
    with nanwatch.watch(model, mode="sentinel", report_dir=None) as handle:
        for batch in range(arm_at + 3):
            if batch == arm_at:
                _FAULTS.append(True)
            model(inputs(batch)).float().pow(2).mean().backward()
            try:
                handle.step()
            except NonFiniteError as error:
                return {"batch": error.batch_number, "module": error.module_name, "replay": error.replay,
                        "report_tail": error.report.splitlines()[-6:]}  # fmt: skip
    return {"batch": None, "replay": None}


def check_sentinel(device: torch.device) -> dict[str, Any]:
    def overflowing() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(device).half()
        with torch.no_grad():
            model[2].weight.mul_(1000)
        return model

    def faulting() -> nn.Module:
        torch.manual_seed(0)
        return FaultsOnce().to(device)

    return {
        "fp16_overflow": sentinel_verdict(
            overflowing, lambda b: torch.randn(4, 64, device=device).half() * 2.0**b, arm_at=10**6
        ),
        "nan_once": sentinel_verdict(faulting, lambda b: torch.randn(4, 64, device=device), arm_at=3),
    }


# ------------------------------------------------------------------------------------- 3b. the loss scale's floor


class InfInBackward(nn.Module):
    """The identity forward; its backward gives inf (a gradient overflow every step, whatever the scale)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGrad.apply(x)


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


def check_floor(device: torch.device) -> dict[str, Any]:
    """A GradScaler whose scale halves every step falls below min_loss_scale=1 after four skipped steps: on a GPU
    the scale is copied in the forward pre-hook and read with the check, so the run stops a micro-batch later."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), InfInBackward(), nn.Linear(4, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=8.0)
    completed = []
    model.register_forward_hook(lambda module, args, output: completed.append(1))
    with nanwatch.watch(model, optimizer=optimizer, scaler=scaler, watch_gradients=True, report_dir=None) as handle:
        try:
            for _ in range(10):
                scaler.scale(model(torch.randn(2, 4, device=device)).sum()).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                handle.step()
        except nanwatch.LossScaleBelowFloor as error:
            return {"batch": error.batch_number, "loss_scale": error.loss_scale, "forwards_completed": len(completed),
                    "history": [scale for _, _, scale in error.scale_history]}  # fmt: skip
    return {"batch": None}


# ----------------------------------------------------------------------------------------------- 4. compiled


def check_compiled(device: torch.device) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(device).half()
    with torch.no_grad():
        model[2].weight.mul_(1000)
    twin = copy.deepcopy(model)
    with nanwatch.watch(twin, report_dir=None):  # graph breaks, counted on a watched twin
        explained = torch._dynamo.explain(twin)(torch.randn(4, 64, device=device).half())
    torch._dynamo.reset()
    handle = nanwatch.watch(model, report_dir=None)
    compiled = torch.compile(model)
    started = time.perf_counter()
    result: dict[str, Any] = {"batch": None}
    try:
        for batch in range(16):
            compiled(torch.randn(4, 64, device=device).half() * 2.0**batch)
            try:
                handle.step()
            except NonFiniteError as error:
                result = {"batch": error.batch_number, "module": error.module_name}
                break
    finally:
        handle.close()
    result["graph_breaks"] = explained.graph_break_count
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


# ------------------------------------------------------------------------------------ 5. a whole step, per mode

STEP_VARIANTS = ("none", "full", "sentinel", "none+fused", "full+fused", "sentinel+fused")


def gpt2_lm(layers: int, width: int, vocab: int, seq: int, device: torch.device) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=max(4, width // 64),
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(device)


def check_step(layers: int, width: int, device: torch.device, steps: int) -> dict[str, Any]:
    """Per variant: syncs per steady step, launches per steady step (and added per module call), ms per step."""
    vocab, batch, seq = 8192, 8, 128
    base = gpt2_lm(layers, width, vocab, seq, device)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    calls = module_calls(base, lambda: base(ids))
    found: dict[str, Any] = {"shape": f"{layers} layers x {width}", "module_calls": calls}
    for variant in STEP_VARIANTS:
        model = copy.deepcopy(base)
        fused = variant.endswith("+fused")
        mode = variant.split("+")[0]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if fused else {"foreach": True}))
        handle = None if mode == "none" else nanwatch.watch(model, mode=mode, optimizer=optimizer, report_dir=None)

        def one_step(
            model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer, handle: Any = handle
        ) -> None:
            optimizer.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            if handle is not None:
                handle.step()

        for _ in range(3):  # plans made, caches warm, the first verdict read
            one_step()
        syncs: list[int] = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            for _ in range(3):
                with counted_syncs(syncs):
                    one_step()
        launches = count_launches(one_step, device)
        timed = time_steps(one_step, device, steps)
        if handle is not None:
            handle.close()
        found[variant] = {"syncs_per_step": syncs, "launches_per_step": launches, "ms_per_step": timed}
    for variant in STEP_VARIANTS:
        baseline = found["none+fused" if variant.endswith("+fused") else "none"]
        figure = found[variant]
        figure["x_none"] = round(figure["ms_per_step"] / baseline["ms_per_step"], 3)
        added = figure["launches_per_step"] - baseline["launches_per_step"]
        figure["launches_added_per_module_call"] = round(added / calls, 2)
    return found


def count_launches(step: Callable[[], None], device: torch.device) -> int:
    """Kernel launches in one step (the profiler: CUDA kernels on a GPU, ATen ops on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiled:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = profiled.events()
    if device.type == "cuda":
        return sum(1 for event in events if event.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for event in events if event.name.startswith("aten::") and event.cpu_parent is None)


def time_steps(step: Callable[[], None], device: torch.device, steps: int) -> float:
    """Milliseconds per step, over `steps` steps queued back to back (one sync at the end)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - started) / steps * 1e3, 3)


# ------------------------------------------------------------------------------- 6. CUDA graphs (reduce-overhead)


def check_graphs(device: torch.device, steps: int) -> dict[str, Any]:
    """Sentinel mode on a model compiled with mode="reduce-overhead": runs, syncs per step, time against unwatched."""
    import torch._dynamo

    found: dict[str, Any] = {}
    for variant in ("none", "sentinel+fused"):
        torch._dynamo.reset()
        model = gpt2_lm(4, 256, 8192, 128, device)
        ids = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        compiled = torch.compile(model, mode="reduce-overhead")
        handle = None
        if variant != "none":
            handle = nanwatch.watch(compiled, mode="sentinel", optimizer=optimizer, report_dir=None)

        def one_step(
            compiled: Any = compiled,
            optimizer: torch.optim.Optimizer = optimizer,
            handle: Any = handle,
            ids: torch.Tensor = ids,
        ) -> None:
            optimizer.zero_grad(set_to_none=True)
            compiled(ids, labels=ids).loss.backward()
            optimizer.step()
            if handle is not None:
                handle.step()

        try:
            for _ in range(4):
                one_step()
            syncs: list[int] = []
            if device.type == "cuda":
                for _ in range(3):
                    with counted_syncs(syncs):
                        one_step()
            found[variant] = {"ran": True, "syncs_per_step": syncs, "ms_per_step": time_steps(one_step, device, steps)}
        except Exception as error:  # said, with the other figures kept
            found[variant] = {"ran": False, "error": f"{type(error).__name__}: {error}"[:500]}
        finally:
            if handle is not None:
                handle.close()
    if found.get("none", {}).get("ran") and found.get("sentinel+fused", {}).get("ran"):
        found["x_none"] = round(found["sentinel+fused"]["ms_per_step"] / found["none"]["ms_per_step"], 3)
    return found


def check_ranges(device: torch.device) -> dict[str, Any]:
    """`multi_tensor_range` (CUDA's multi-tensor kernels) against each tensor's own `abs().aminmax()`, read as a report
    reads them (a nan max makes the min nan). Raises AssertionError on any difference."""
    from nanwatch.core.stats.abs_range import AbsRange
    from nanwatch.core.stats.pooled import multi_tensor_range

    found: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        generator = torch.Generator(device=device).manual_seed(0)
        tensors = [
            torch.randn(shape, generator=generator, device=device).to(dtype)
            for shape in [(), (1,), (3, 5), (64, 1024), (300_000,), (7, 70_000)]
        ]
        tensors += [
            # infs only: CUDA's `_foreach_max` starts at the lowest finite float
            torch.full((), float("inf"), device=device, dtype=dtype),
            torch.tensor([float("-inf"), float("inf")], device=device, dtype=dtype),
            torch.tensor([-0.0, 0.0], device=device, dtype=dtype),
            torch.tensor([torch.finfo(dtype).tiny / 4, 1.0], device=device, dtype=dtype),  # a subnormal
            torch.tensor([torch.finfo(dtype).max, float("inf")], device=device, dtype=dtype),
        ]
        with_nan = torch.randn(200_000, generator=generator, device=device).to(dtype)
        with_nan[123_456] = float("nan")
        tensors.append(with_nan)
        lows, highs = multi_tensor_range(tensors)
        wrong = []
        for index, tensor in enumerate(tensors):
            low, high = torch.aminmax(tensor.abs())
            ours = AbsRange().read((lows[index].item(), highs[index].item()))
            theirs = AbsRange().read((low.item(), high.item()))
            if str(ours) != str(theirs):  # nan == nan as text; -0.0 and 0.0 differ as text, as they would in a report
                wrong.append(f"tensor {index} {tuple(tensor.shape)}: {ours} != {theirs}")
        assert not wrong, f"{dtype}: {wrong}"
        found[str(dtype)] = f"{len(tensors)} tensors, every number the same"
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--only",
        default="ranges,oracle,syncs,sentinel,floor,compiled,step,graphs",
        help="comma-separated checks to run",
    )
    parser.add_argument(
        "--shapes",
        type=lambda text: [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")],
        default=[(4, 256), (12, 768)],
        help="GPT-2 shapes of the step check, layers x width, comma-separated (default 4x256,12x768)",
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant in step and graphs (default 30)")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only tries the script out")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check is for a GPU machine", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}; nanwatch {nanwatch.__version__}")
    results: dict[str, Any] = {"torch": torch.__version__, "device": name}
    wanted = set(args.only.split(","))
    if device.type != "cuda":
        wanted.discard("syncs")  # CUDA's sync debug mode only
        wanted.discard("graphs")  # CUDA graphs only
    checks: dict[str, Callable[[], Any]] = {
        "ranges": lambda: check_ranges(device),
        "oracle": lambda: [
            check_oracle(torch.float16, device, 1e3, 8),
            check_oracle(torch.bfloat16, device, 1e12, 8),
        ],
        "syncs": lambda: [
            check_syncs(precision, variant, device, steps=6)
            for precision in ("fp16-autocast", "bf16")
            for variant in ("none", "full", "sentinel")
        ],
        "sentinel": lambda: check_sentinel(device),
        "floor": lambda: check_floor(device),
        "compiled": lambda: check_compiled(device),
        "step": lambda: [check_step(*shape, device, args.steps) for shape in args.shapes],
        "graphs": lambda: check_graphs(device, args.steps),
    }
    failed = False
    for name, run in checks.items():
        if name not in wanted:
            continue
        started = time.perf_counter()
        try:
            results[name] = run()
        except Exception as error:  # one check's failure must not hide the others' figures
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            failed = True
        print(f"== {name} ({time.perf_counter() - started:.1f} s)")
        print(json.dumps(results[name], indent=1, default=str))
        sys.stdout.flush()
        if args.output:
            with open(args.output, "w", encoding="utf-8") as file:
                json.dump(results, file, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
