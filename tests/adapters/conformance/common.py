"""What every harness shares: the scenario, the outcome, the model with its fault module, the data, the bookkeeping.

A harness is a module with `NAME`, `FAULT_NAME` (the fault module's qualified name as that adapter names modules)
and `run(scenario, workdir) -> Outcome`. The fault module counts its own forwards, so which micro-batch goes bad never
depends on nanwatch's counters or on the data order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests.adapters.scripts.blowup_models import SumDataset
from tests.models import wrong_backend
from torch import nn

BATCH_SIZE = 2
MICRO_BATCHES_PER_EPOCH = 4  # on each rank
EVAL_BATCHES = 2  # one evaluation: this many eval forwards
LEARNING_RATE = 0.1

# Every kind of hook a module keeps: none of them may be left behind by nanwatch.
_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


@dataclass(frozen=True)
class Scenario:
    """One run, described the same way for every adapter. Micro-batches are 0-indexed and counted on each rank.

    Attributes:
        inf_at: the training micro-batch whose `Fault` output is inf (None: never).
        inf_rank: the only rank where that happens (None: every rank).
        eval_inf_at: the eval forward (counted over the whole run) whose `Fault` output is inf.
        raise_at: the training micro-batch in which `Fault` raises the user's `RuntimeError`.
        accumulation: micro-batches per optimizer step.
        epochs: how long the run goes if nothing stops it (MICRO_BATCHES_PER_EPOCH each).
        evaluate: run an evaluation (EVAL_BATCHES forwards in eval mode) after every optimizer step.
        watch_eval: nanwatch's `watch_eval`.
        resume_after: a first run trains this many micro-batches (whole epochs) and checkpoints the framework's own
            way; a fresh run (new model, new nanwatch object) resumes from that checkpoint.
        mode: nanwatch's `mode` ("full" or "sentinel").
        loss_inf_at: the training micro-batch whose loss, computed outside the model by a plain function (`F.mse_loss`
            of the logits, as most training code does), overflows to inf while the model's output stays finite. When
            set, every harness computes its loss that way (`FunctionalLoss`) instead of taking the model's.
        fault_once: the fault fires only the first time micro-batch `inf_at` runs (a fault a replay cannot see).
        cause: what goes wrong at micro-batch `inf_at` instead of an added inf (`CauseFault`, `train_dataset`):
            "data" (a sample of the data holds nan), "precision16" (a float16 child overflows float16's range),
            "precision_bf16" (a bfloat16 child's rounding divides by zero), "weights" (a finite gradient whose SGD
            update overflows a weight), "compiler" (the net is compiled by a backend that breaks every linear).
        fused: the optimizer is a fused one, which takes a device-side `found_inf` (`SGD(fused=True)`; the HF
            Trainer's `adamw_torch_fused`).
    """

    inf_at: int | None = None
    inf_rank: int | None = None
    eval_inf_at: int | None = None
    raise_at: int | None = None
    accumulation: int = 1
    epochs: int = 3
    evaluate: bool = False
    watch_eval: bool = False
    resume_after: int | None = None
    mode: str = "full"
    loss_inf_at: int | None = None
    fault_once: bool = False
    cause: str | None = None
    fused: bool = False

    def __post_init__(self) -> None:
        if self.resume_after is not None and (
            self.resume_after <= 0 or self.resume_after % MICRO_BATCHES_PER_EPOCH != 0
        ):
            raise ValueError(
                f"resume_after must be a positive multiple of {MICRO_BATCHES_PER_EPOCH} (whole epochs), "
                f"got {self.resume_after}"
            )
        if MICRO_BATCHES_PER_EPOCH % self.accumulation != 0:
            raise ValueError(f"accumulation must divide {MICRO_BATCHES_PER_EPOCH}, got {self.accumulation}")

    def config(self, workdir: Path) -> dict[str, Any]:
        """nanwatch's settings for this scenario: reports go to `workdir/reports`."""
        return {"report_dir": report_dir(workdir), "watch_eval": self.watch_eval, "mode": self.mode}

    @property
    def micro_batches(self) -> int:
        return self.epochs * MICRO_BATCHES_PER_EPOCH


def report_dir(workdir: Path) -> Path:
    return workdir / "reports"


def world_size() -> int:
    """2 under torchrun (ddp_rank.py), 1 in the test process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Fault(nn.Module):
    """Passes its input through, except: at training forward `inf_at` (on `inf_rank`) and eval forward `eval_inf_at`
    it adds inf; at training forward `raise_at` it raises the user's own `RuntimeError` (kept as `raised`).

    `count` is the index of the next training micro-batch; a resumed run sets it to the micro-batches already done.
    It lives in a buffer (not saved in checkpoints), as a model's state does: a replay of a micro-batch, which puts
    the buffers back as they were, sees the same count. With `once`, the fault fires the first time only.
    """

    def __init__(
        self,
        inf_at: int | None,
        inf_rank: int | None,
        eval_inf_at: int | None,
        raise_at: int | None,
        once: bool = False,
    ) -> None:
        super().__init__()
        self.inf_at = inf_at
        self.inf_rank = inf_rank
        self.eval_inf_at = eval_inf_at
        self.raise_at = raise_at
        self.once = once
        self.fired = 0  # training forwards really given inf
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)
        self.eval_count = 0
        self.eval_hits = 0  # eval forwards that really were given inf
        self.raised: RuntimeError | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            index = self.count
            with torch.no_grad():
                self.calls += 1
            if index == self.raise_at:
                self.raised = RuntimeError(f"user bug at batch {index}")
                raise self.raised
            hit = index == self.inf_at and (self.inf_rank is None or current_rank() == self.inf_rank)
            hit = hit and not (self.once and self.fired)
            self.fired += hit
        else:
            hit = self.eval_count == self.eval_inf_at
            self.eval_count += 1
            self.eval_hits += hit
        return x + float("inf") if hit else x

    @property
    def count(self) -> int:
        return int(self.calls)

    @count.setter
    def count(self, value: int) -> None:
        self.calls.fill_(value)


class FunctionalLoss:
    """`F.mse_loss(logits, labels)`, computed outside the model as most training code does; at training micro-batch
    `inf_at` (counted by its own training calls) the logits are scaled by 1e30 first, so the loss alone is inf."""

    def __init__(self, inf_at: int | None) -> None:
        self.inf_at = inf_at
        self.count = 0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, *, training: bool = True) -> torch.Tensor:
        scale = 1.0
        if training:
            scale = 1e30 if self.count == self.inf_at else 1.0
            self.count += 1
        return nn.functional.mse_loss(logits * scale, labels)


class ConformanceBlock(nn.Module):
    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fault(self.act(self.linear(x)))
        return out


class ConformanceNet(nn.Module):
    """block (linear -> act -> fault) -> head; returns {"loss", "logits"} as a transformers model does.

    The fault module's qualified name is `block.fault`.
    """

    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        inf_at = None if scenario.cause == "data" else scenario.inf_at  # the data is what goes wrong there
        fault = (
            Fault(inf_at, scenario.inf_rank, scenario.eval_inf_at, scenario.raise_at, scenario.fault_once)
            if scenario.cause in (None, "data", "compiler")
            else CauseFault(scenario.cause, scenario.inf_at)
        )
        self.block = ConformanceBlock(fault)
        self.head = nn.Linear(8, 1)

    @property
    def fault(self) -> Fault:
        fault: Fault = self.block.fault
        return fault

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(self.block(x))
        result = {"logits": logits}
        if labels is not None:
            result["loss"] = nn.functional.mse_loss(logits, labels)
        return result


def new_net(scenario: Scenario, *, micro_batches_done: int = 0) -> ConformanceNet:
    """The same initial weights on every rank and in every harness."""
    torch.manual_seed(0)
    net = ConformanceNet(scenario)
    net.fault.count = micro_batches_done
    if scenario.cause == "compiler":  # the compiled module is what the framework calls (its attributes are the net's)
        compiled: ConformanceNet = torch.compile(net, backend=wrong_backend)  # type: ignore[assignment]
        return compiled
    return net


def new_loss(scenario: Scenario, *, micro_batches_done: int = 0) -> FunctionalLoss | None:
    """The functional loss a harness computes outside the model (`scenario.loss_inf_at`), or None: the model's own."""
    if scenario.loss_inf_at is None:
        return None
    loss = FunctionalLoss(scenario.loss_inf_at)
    loss.count = micro_batches_done
    return loss


def train_dataset(scenario: Scenario | None = None) -> SumDataset:
    """MICRO_BATCHES_PER_EPOCH batches of BATCH_SIZE per rank and epoch, once the framework shards it across ranks.
    With `scenario.cause == "data"`, the first sample of micro-batch `inf_at` holds a nan (its label stays finite)."""
    data = SumDataset(BATCH_SIZE * MICRO_BATCHES_PER_EPOCH * world_size(), seed=0)
    if scenario is not None and scenario.cause == "data" and scenario.inf_at is not None:
        data.x[scenario.inf_at * BATCH_SIZE, 1] = float("nan")
    return data


def eval_dataset() -> SumDataset:
    return SumDataset(BATCH_SIZE * EVAL_BATCHES, seed=1)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


class StepRecorder:
    """The weights as the run begins, then after every optimizer step that really ran (a post-hook on the torch
    optimizer, below any framework wrapper: a step that nanwatch stopped, or that a wrapper skipped, adds nothing)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weights = [snapshot(model)]
        self._handles: list[Any] = []

    def restart(self) -> None:
        """The (resumed) run begins now: forget what came before."""
        self.weights = [snapshot(self.model)]

    def track(self, optimizer: Any) -> None:
        real = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer keeps it there
        assert isinstance(real, torch.optim.Optimizer), type(real)
        self._handles.append(real.register_step_post_hook(lambda *_: self.weights.append(snapshot(self.model))))

    def close(self) -> None:
        while self._handles:
            self._handles.pop().remove()


def hooks_on(model: nn.Module, optimizers: list[Any]) -> int:
    """Hooks of every kind on any module of `model`, and step hooks on the (torch) optimizers."""
    count = sum(len(getattr(module, name)) for module in model.modules() for name in _MODULE_HOOK_DICTS)
    for optimizer in optimizers:
        real = getattr(optimizer, "optimizer", optimizer)
        count += len(real._optimizer_step_pre_hooks) + len(real._optimizer_step_post_hooks)
    return count


@dataclass
class Outcome:
    """What a harness hands back once its run ended (by an exception or not).

    Attributes:
        error: what the call that ran training raised, or None.
        fault: the fault module of the (last) run: its counts and the user error it raised.
        counters: the adapter's `Watcher.state_dict()` as the run ended (empty if no watcher was made).
        weights: as the (last) run began, then after each optimizer step that ran in it.
        final: the weights when the run ended.
        reports: names of the files in `workdir/reports` (sorted; empty if none).
        hooks_left: hooks of any kind left on the model and its optimizer (the harness's own removed first).
    """

    error: BaseException | None
    fault: Fault = field(repr=False)
    counters: dict[str, Any]
    weights: list[dict[str, torch.Tensor]] = field(repr=False)
    final: dict[str, torch.Tensor] = field(repr=False)
    reports: list[str]
    hooks_left: int

    @property
    def steps_done(self) -> int:
        return len(self.weights) - 1

    def final_weights_are_after_step(self, step: int) -> bool:
        return same_weights(self.final, self.weights[step])

    def record(self) -> dict[str, Any]:
        """The outcome as JSON-able data (what ddp_rank.py writes for each rank)."""
        error = self.error
        described = None
        if error is not None:
            described = {
                "type": type(error).__name__,
                "message": str(error),
                **{
                    name: getattr(error, name, None)
                    for name in ("batch_number", "rank", "module_name", "phase", "optimizer_step")
                },
            }
        return {
            "rank": int(os.environ.get("RANK", "0")),  # the framework may have left the process group already
            "world_size": world_size(),
            "error": described,
            "counters": self.counters,
            "steps_done": self.steps_done,
            "final_weights_are_after_last_step": self.final_weights_are_after_step(self.steps_done),
            "steps_changed_the_weights": not same_weights(self.weights[-1], self.weights[0]),
            "finite": all(bool(torch.isfinite(value).all()) for value in self.final.values()),
            "reports": self.reports,
            "hooks_left": self.hooks_left,
        }


def outcome(
    error: BaseException | None,
    *,
    net: ConformanceNet,
    watcher: Any,
    recorder: StepRecorder,
    model: nn.Module,
    optimizers: list[Any],
    workdir: Path,
) -> Outcome:
    """Collect the outcome; `model` is the module the adapter watched (the LightningModule, or the net itself)."""
    recorder.close()
    reports = report_dir(workdir)
    return Outcome(
        error=error,
        fault=net.fault,
        counters={} if watcher is None else dict(watcher.state_dict()),
        weights=recorder.weights,
        final=snapshot(net),
        reports=sorted(path.name for path in reports.iterdir()) if reports.is_dir() else [],
        hooks_left=hooks_on(model, optimizers),
    )


# ----------------------------------------------------------------------------------------------- the causes


class Amplify16(nn.Module):
    """Multiplies by 64 in float16 (a buffer, so it stays float16 whatever the net's dtype): past float16's range for
    an input above 1024, which float32 holds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.full((), 64.0, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class RoundingBf16(nn.Module):
    """Divides by (1 - (1 + 1e-3)) in bfloat16, whose rounding loses the 1e-3: a division by zero float32 avoids."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("one", torch.ones((), dtype=torch.bfloat16))
        self.register_buffer("delta", torch.full((), 1e-3, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (self.one - (self.one + self.delta))


class _HugeGradient(torch.autograd.Function):
    """Passes x through; its weight's gradient is -3.4e38: finite, but an SGD step of lr 0.1 takes 3.3e38 past
    float32's max."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.full_like(torch.empty(1), -3.4e38)


class CauseFault(Fault):
    """A `Fault` that, at training micro-batch `inf_at`, makes one kind of cause happen (see `Scenario.cause`)
    instead of adding inf. Its children are where "precision" begins; its `boost` weight is what "weights" breaks."""

    def __init__(self, cause: str, inf_at: int | None) -> None:
        super().__init__(inf_at, None, None, None)
        self.cause = cause
        self.amplify = Amplify16()
        self.rounding = RoundingBf16()
        self.boost = nn.Parameter(torch.full((1,), 3.3e38))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hit = False
        if self.training:
            hit = self.count == self.inf_at
            with torch.no_grad():
                self.calls += 1
            self.fired += hit
        # The boost weight joins every forward with a zero gradient, so the optimizer steps it like any weight.
        out = x + 0 * self.boost.clamp(max=0)
        if not hit:
            return out
        if self.cause == "precision16":
            return self.amplify(x.to(torch.float16) * 4096).to(x.dtype)
        if self.cause == "precision_bf16":
            return self.rounding(x.to(torch.bfloat16)).to(x.dtype)
        broken: torch.Tensor = _HugeGradient.apply(x, self.boost)  # "weights"
        return broken
