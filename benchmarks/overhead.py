"""How much watching slows a GPT-2-shaped model down: none vs `nanwatch.watch` (any config) vs transformers' tool.

One model (transformers' `GPT2LMHeadModel`: 4 layers, width 256, 4 heads, vocabulary 8192, batch 8 x sequence 128,
CPU, 2 threads) and one AdamW, shared by every variant:

    none     no hooks at all
    watch    `nanwatch.watch(model, <config>)`: the config of the command line (`--config FILE`, `--watch-gradients`,
             ... any `WatchConfig` field; the defaults otherwise)
    hf       transformers' `DebugUnderflowOverflow(model)`
    + with `--each-option`, one more `watch` per option of the table OPTIONS below (on top of the same config).

Every variant is set up once, on the same model, then its hooks are taken off the model (see `HookStash`) and put
back only around its own steps, so each watcher keeps its state (cached weight stats, counters, buffers) as in a
real run, and no variant pays for another's hooks. Sharing one model matters: separate copies of the same weights
differ in speed by up to 3 % through memory placement alone, as much as the effect measured. Each round times one
step of every variant, in an order that rotates from round to round. A training step is zero_grad, forward with
labels, backward, AdamW step, `handle.step()`; an inference step is an eval forward under `torch.no_grad()`, which
nanwatch checks as it returns (`watch_eval=True`).

A variant that watches only some batches (`watch_every_n_batches=10`) costs different amounts at different positions
of its period, so a variant's cost per step is the mean over the positions of the period of the median step time at
that position (for the others: the median). Ratios are costs over the cost of `none`.

    python benchmarks/overhead.py                                  # none / watch / hf, about 3 minutes on 2 cores
    python benchmarks/overhead.py --watch-gradients --modes train  # the same, with a config option
    python benchmarks/overhead.py --each-option                    # every option of OPTIONS, about 12 minutes
    python benchmarks/overhead.py --scaler --modes train           # through a GradScaler: AMP awareness
    python benchmarks/overhead.py --rounds 60 --output /tmp/overhead.json
    python benchmarks/overhead.py --dispatch --no-sentinel   # 1,000 tiny layers: the hooks' cost per call
    python benchmarks/overhead.py --compile --no-hf           # compiled + watched vs compiled alone
    python benchmarks/overhead.py --model dispatch-sgd --modes train --no-hf --no-sentinel  # batch 2, SGD: the hot path

Needs `transformers` (the `transformers` extra). A benchmark, not a test: it asserts nothing about speed, it
reports; the targets of the design are printed next to the figures. Run it on a quiet machine: other processes
taking a core from torch's threads slow some steps down by 2x (the table says how busy the machine was).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _shared import HookStash, module_calls, shares_its_model

import nanwatch

# Beyond the public API, what this benchmark needs and a user never does: the options of nanwatch's command-line tools
# (one per WatchConfig field: the watched variant's config), what sentinel mode keeps alive (the "kept MB" column),
# and the guard alone (a watcher with no module hook, the check before each optimizer step), which no config builds.
from nanwatch.adapters._hooks import guard_optimizers
from nanwatch.cli.options import add_config_arguments, config_from_args
from nanwatch.core.features.sentinel import SentinelFeature
from nanwatch.core.watcher import Watcher

# Targets of the design: watch/none per mode, and watch's added time over the tool's added time.
TARGETS = {"train": 1.05, "infer": 1.10, "added_vs_hf": 0.25}
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "overhead.json"
# One watched variant per option that changes the cost (the scope options among them), each on top of the command
# line's config; the modes it means something in (gradients, batch schedules and summaries are about training batches).
OPTIONS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "headroom off": ({"headroom_warn_fraction": None}, ("train", "infer")),
    "count_underflow": ({"count_underflow": True}, ("train", "infer")),
    "target_dtype=float16": ({"target_dtype": "float16"}, ("train", "infer")),
    "watch_gradients": ({"watch_gradients": True}, ("train",)),
    # report_dir: a fresh temporary folder, unless the command line gives one (the replay file would go there)
    "capture_on_detect": ({"capture_on_detect": True, "report_dir": None}, ("train", "infer")),
    "include 1 block": ({"include_modules": ["transformer.h.0", "transformer.h.0.*"]}, ("train", "infer")),
    "every 10th batch": ({"watch_every_n_batches": 10}, ("train",)),
    "every 10th + summary": ({"watch_every_n_batches": 10, "summary_every_n_batches": 10}, ("train",)),
    # Spike warnings: the loss (where the model hands it over) and the guard's gradient maximum judged
    # against windows of 50, on the device.
    "spike_window=50": ({"spike_window": 50}, ("train",)),
    # The same in sentinel mode, to set beside the `sentinel` variant: it keeps two more micro-batches for a replay.
    "sentinel, spike_window=50": (
        {"mode": "sentinel", "watch_gradients": False, "trace_batch_nums": [], "spike_window": 50},
        ("train",),
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default="train,infer", help="comma-separated subset of train,infer (default both)")
    parser.add_argument("--rounds", type=int, default=30, help="timed training rounds, a multiple of 10 (default 30)")
    parser.add_argument("--infer-rounds", type=int, default=None, help="timed inference rounds (default: 2 x --rounds)")
    parser.add_argument(
        "--warmup", type=int, default=10, help="untimed steps per variant and mode first, a multiple of 10 (default 10)"
    )
    parser.add_argument("--each-option", action="store_true", help="also time one variant per option of OPTIONS")
    parser.add_argument(
        "--option", action="append", default=[], choices=list(OPTIONS), help="also time this variant of OPTIONS"
    )
    parser.add_argument("--no-hf", action="store_true", help="leave transformers' DebugUnderflowOverflow out")
    parser.add_argument("--no-sentinel", action="store_true", help="leave the sentinel and guard-alone variants out")
    parser.add_argument(
        "--gc-pause-too",
        action="store_true",
        help="also time watch with pause_gc flipped (on by default): what pausing the garbage collector saves",
    )
    parser.add_argument(
        "--scaler",
        action="store_true",
        help="train through a torch.amp.GradScaler (every variant), and give it to nanwatch (scaler=): what AMP "
        "awareness costs",
    )
    parser.add_argument(
        "--model",
        choices=sorted(WORKLOADS),
        default="gpt2",
        help="gpt2: the GPT-2 above (default); convnet: a small conv net with BatchNorm and a functional loss; "
        "dispatch: see --dispatch; dispatch-sgd: the same pairs, batch 2, plain SGD (the hot path's workload)",
    )
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="the same as --model dispatch: 1,000 Linear(4,4)+Tanh pairs, where the hooks' cost per call dominates",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (inductor) and time none (compiled alone) against watch (watched, then compiled)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON results (default {DEFAULT_OUTPUT})")
    # The watched variant's config: one option per WatchConfig field; eval forwards are watched unless told not to.
    add_config_arguments(parser, defaults={"watch_eval": True})
    args = parser.parse_args(argv)
    if args.dispatch:
        args.model = "dispatch"
    if args.infer_rounds is None:
        args.infer_rounds = 2 * args.rounds
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not modes or set(modes) - {"train", "infer"}:
        parser.error(f"--modes can hold train and infer, got {args.modes!r}")
    args.modes = modes
    for name in ("rounds", "infer_rounds", "warmup"):
        value = getattr(args, name)
        if value < 0 or (name != "warmup" and value == 0) or value % PERIOD:
            parser.error(f"--{name.replace('_', '-')} must be a positive multiple of {PERIOD}, got {value}")
    args.watch_config = config_from_args(args)
    return args


PERIOD = 10  # the longest batch period of OPTIONS; rounds and warm-up are multiples of it


class Workload:
    """A model and its batch: what a training step and an inference step run."""

    def __init__(self, description: str, model: torch.nn.Module) -> None:
        self.description = description
        self.model = model

    def train_loss(self) -> torch.Tensor:
        raise NotImplementedError

    def infer(self) -> None:
        raise NotImplementedError

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    def module_calls(self) -> int:
        """How many module calls one forward makes (an inference forward, counted by hooks taken off after): what
        the added time per step is divided by to give the hooks' cost per module call."""
        self.model.eval()
        return module_calls(self.model, self.infer)


class GPT2Workload(Workload):
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        model = build_model(args.vocab, args.seq, args.seed).to(device)
        generator = torch.Generator().manual_seed(args.seed)
        self.input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
        parameters = sum(p.numel() for p in model.parameters())
        super().__init__(
            f"GPT-2 shape: 4 layers, width 256, 4 heads, vocab {args.vocab}, {parameters / 1e6:.1f}M parameters; "
            f"batch {args.batch} x sequence {args.seq}",
            model,
        )

    def train_loss(self) -> torch.Tensor:
        loss: torch.Tensor = self.model(self.input_ids, labels=self.input_ids).loss
        return loss

    def infer(self) -> None:
        self.model(self.input_ids)


class ConvNetWorkload(Workload):
    """Three conv + BatchNorm + ReLU blocks, average pooling, a linear head; `F.cross_entropy` outside the model."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        from torch import nn

        torch.manual_seed(args.seed)
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
        ).to(device)  # fmt: skip
        generator = torch.Generator().manual_seed(args.seed)
        self.images = torch.randn(32, 3, 64, 64, generator=generator).to(device)
        self.labels = torch.randint(0, 10, (32,), generator=generator).to(device)
        parameters = sum(p.numel() for p in model.parameters())
        super().__init__(
            f"conv net: 3 x (conv, BatchNorm, ReLU), pool, linear; {parameters / 1e3:.0f}k parameters; "
            "batch 32 x 3 x 64 x 64; F.cross_entropy outside the model",
            model,
        )

    def train_loss(self) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(self.images), self.labels)

    def infer(self) -> None:
        self.model(self.images)


class DispatchWorkload(Workload):
    """`--dispatch`: 1,000 `Linear(4, 4)` + `Tanh` pairs, batch 8. Compute is next to nothing, so a step costs what
    launching its kernels and running Python around them cost: the hooks' own cost per module call dominates, as on a
    GPU, where kernels run asynchronously and the CPU must stay ahead. AdamW with `foreach=True` (a GPU's default):
    one multi-tensor call per update, not a Python loop over 2,000 parameters that would hide the hooks' cost."""

    batch, optimizer_name = 8, "AdamW(foreach)"

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        from torch import nn

        torch.manual_seed(args.seed)
        layers: list[nn.Module] = []
        for _ in range(1000):
            layers += [nn.Linear(4, 4), nn.Tanh()]
        model = nn.Sequential(*layers).to(device)
        self.inputs = torch.randn(self.batch, 4, generator=torch.Generator().manual_seed(args.seed)).to(device)
        super().__init__(
            f"dispatch-bound: 1,000 x (Linear(4, 4), Tanh), 2,001 module calls per forward; batch {self.batch}; "
            + self.optimizer_name,
            model,
        )

    def train_loss(self) -> torch.Tensor:
        return self.model(self.inputs).square().mean()

    def infer(self) -> None:
        self.model(self.inputs)

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-5, foreach=True)


class DispatchSGDWorkload(DispatchWorkload):
    """`--model dispatch-sgd`: the same 1,000 pairs, batch 2, plain SGD (`foreach=True`). The lightest
    training step there is, so the hooks' cost per module call shows undiluted: what a GPU user would see."""

    batch, optimizer_name = 2, "SGD(foreach)"

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1e-5, foreach=True)


WORKLOADS: dict[str, Callable[[argparse.Namespace, torch.device], Workload]] = {
    "gpt2": GPT2Workload,
    "convnet": ConvNetWorkload,
    "dispatch": DispatchWorkload,
    "dispatch-sgd": DispatchSGDWorkload,
}
# Design targets: watch/none of a dispatch-bound training step, and of a compiled one over the same model compiled
# alone.
DISPATCH_TARGET, COMPILED_TARGET = 1.5, 1.2
# For `--model dispatch-sgd` training: watch/none, and the time watching adds per module call. Every hook runs through
# torch's own `Module.__call__` (nanwatch sets nothing on a class), whose general hook path alone costs a few us.
DISPATCH_SGD_TARGET, PER_CALL_TARGET_US = 1.5, 10.0


def build_model(vocab: int, seq: int, seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # its notes on the config's defaults are noise here
    config = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


class Variant:
    """One way of watching the shared model: its hooks, its handle, its step times by position in its period."""

    def __init__(
        self, name: str, config: nanwatch.WatchConfig | None, period: int = 1, *, give_scaler: bool = True
    ) -> None:
        self.name = name
        self.give_scaler = give_scaler  # with --scaler: passed to watch(scaler=), unless this is the variant without
        self.config = config
        self.period = period
        self.handle: nanwatch.WatchHandle | GuardOnly | None = None
        self.held_bytes = 0  # what nanwatch kept alive for a replay, at its largest (sentinel mode)
        self.peak_bytes: dict[str, int] = {}  # CUDA only: peak memory allocated during a step, by mode
        self.hf: Any = None
        self.stash: HookStash | None = None
        self.steps_taken = {"train": 0, "infer": 0}
        self.times: dict[str, list[tuple[int, float]]] = {"train": [], "infer": []}

    def set_up(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> None:
        if self.name == "none":
            return
        self.stash = HookStash(model, optimizer)
        if self.name == "hf":
            from transformers.debug_utils import DebugUnderflowOverflow

            self.hf = self.stash.capture(lambda: DebugUnderflowOverflow(model))  # type: ignore[no-untyped-call]
        elif self.name == GUARD:
            assert self.config is not None
            config = self.config
            self.handle = self.stash.capture(lambda: GuardOnly(model, config, optimizer))
        else:
            assert self.config is not None
            self.handle = self.stash.capture(
                lambda: nanwatch.watch(
                    model, self.config, optimizer=optimizer, scaler=scaler if self.give_scaler else None
                )
            )
        self.stash.take_off()
        if isinstance(self.handle, nanwatch.WatchHandle):
            # Several handles share this one model on purpose, each with its hooks on only around its own steps:
            # the next watch() must not close this one as a handle left behind.
            shares_its_model(self.handle)

    def close(self) -> None:
        # nanwatch removes its own hooks (put back first, so its handles find them); transformers' tool cannot
        # remove its hooks, so they stay off the model.
        if self.handle is not None and self.stash is not None:
            self.stash.put_back()
            self.handle.close()

    def nanwatch_held_bytes(self) -> int:
        if not isinstance(self.handle, nanwatch.WatchHandle):
            return 0
        sentinel = self.handle.watcher.feature(SentinelFeature)
        return 0 if sentinel is None else sentinel.held_bytes()

    def problems(self) -> list[str]:
        """A watcher that stopped watching would be timed doing nothing: such figures are worthless."""
        found = []
        if self.handle is not None:
            watcher = self.handle.watcher
            if watcher.disabled_reason is not None:
                found.append(f"{self.name}: nanwatch stopped watching: {watcher.disabled_reason}")
            if watcher.counters.batch_number == 0 and watcher.counters.eval_batch_number == 0:
                found.append(f"{self.name}: nanwatch counted no batch")
        if self.hf is not None and (self.hf.detected_overflow or self.hf.batch_number == 0):
            found.append(f"{self.name}: transformers' DebugUnderflowOverflow saw inf/nan or no batch")
        return found

    def cost(self, mode: str) -> float:
        """Seconds per step: the mean over the positions of the period of the median at each position."""
        by_position: dict[int, list[float]] = {}
        for index, seconds in self.times[mode]:
            by_position.setdefault(index % self.period, []).append(seconds)
        return statistics.fmean(statistics.median(values) for values in by_position.values())

    def paired_added(self, mode: str, none: Variant) -> float:
        """Seconds added per step: the mean over the positions of the period of the median per-round difference."""
        by_position: dict[int, list[float]] = {}
        for (index, seconds), (_, baseline) in zip(self.times[mode], none.times[mode], strict=True):
            by_position.setdefault(index % self.period, []).append(seconds - baseline)
        return statistics.fmean(statistics.median(values) for values in by_position.values())

    def paired_ratio(self, mode: str, none: Variant) -> float:
        """The same, of the ratios to `none`'s step in the same round: insensitive to the machine's slow drifts."""
        by_position: dict[int, list[float]] = {}
        for (index, seconds), (_, baseline) in zip(self.times[mode], none.times[mode], strict=True):
            by_position.setdefault(index % self.period, []).append(seconds / baseline)
        return statistics.fmean(statistics.median(values) for values in by_position.values())


class GuardOnly:
    """The guard alone: a watcher with no module hook, and the check before every optimizer step (the gradients
    about to be applied, in one fused reduction and one host read). What every mode pays at least."""

    def __init__(self, model: torch.nn.Module, config: nanwatch.WatchConfig, optimizer: torch.optim.Optimizer) -> None:
        self.watcher = Watcher(model, config)
        self.watcher.attach([])
        guard_optimizers(self.watcher, [optimizer])

    def start(self) -> None:
        self.watcher.start_batch("train")

    def step(self) -> None:
        self.watcher.end_batch()

    def close(self) -> None:
        self.watcher.close()


class Bench:
    """The shared model, optimizer and batch; times one step of a variant with only its hooks on the model."""

    def __init__(self, workload: Workload, device: torch.device, *, scaler: bool = False) -> None:
        self.workload = workload
        self.model = workload.model
        self.optimizer = workload.optimizer()
        # float32 weights and no autocast: the scaler's work (scale, unscale, inf check, update) is all there is.
        self.scaler = torch.amp.GradScaler(device.type) if scaler else None
        self.device = device
        self.losses: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, variant: Variant, mode: str) -> float:
        if variant.stash is not None:
            variant.stash.put_back()
        try:
            self._sync()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            start = time.perf_counter()
            if mode == "train":
                self._train_step(variant)
            else:
                self._infer_step()
            self._sync()
            seconds = time.perf_counter() - start
            if self.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(self.device)
                variant.peak_bytes[mode] = max(variant.peak_bytes.get(mode, 0), peak)
        finally:
            if variant.stash is not None:
                variant.stash.take_off()
        variant.steps_taken[mode] += 1
        return seconds

    def _train_step(self, variant: Variant) -> None:
        if not self.model.training:  # back from an inference step; not in every step: on the dispatch-bound model
            self.model.train()  # `train()` alone walks 2,001 modules, 5.9 ms, which would dilute every ratio
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(variant.handle, GuardOnly):
            variant.handle.start()
        loss = self.workload.train_loss()
        config = getattr(variant.handle, "config", None)
        if config is not None and config.spike_window is not None:  # the loss judged too, as a user would hand it over
            variant.handle.watch_loss(loss)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        # What nanwatch keeps alive for a replay, at its largest: after backward, before the step lets it go.
        variant.held_bytes = max(variant.held_bytes, variant.nanwatch_held_bytes())
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if variant.handle is not None:
            variant.handle.step()
        self.losses.append(loss.detach())

    def _infer_step(self) -> None:
        if self.model.training:
            self.model.eval()
        with torch.no_grad():
            self.workload.infer()


class ForeignLoad:
    """CPU time other processes used during a stretch of time, in cores (Linux /proc/stat; elsewhere: unknown)."""

    def __init__(self) -> None:
        self.available = Path("/proc/stat").exists()
        self._start = self._now()

    def _now(self) -> tuple[float, float, float]:
        own = os.times()
        busy = 0.0
        if self.available:
            with open("/proc/stat") as stat:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in stat.readline().split()[1:9])
            busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        return busy, own.user + own.system, time.perf_counter()

    def cores(self) -> float:
        busy, own, wall = self._now()
        foreign = (busy - self._start[0]) - (own - self._start[1])
        return max(0.0, foreign) / max(wall - self._start[2], 1e-9)


def run_mode(
    bench: Bench, variants: list[Variant], mode: str, rounds: int, warmup: int, module_calls: int
) -> dict[str, Any]:
    for variant in variants:
        for _ in range(warmup):
            bench.step(variant, mode)
    load = ForeignLoad()
    for round_index in range(rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            index = variant.steps_taken[mode]
            variant.times[mode].append((index, bench.step(variant, mode)))
    none = variants[0].cost(mode)
    hf = next((v.cost(mode) for v in variants if v.name == "hf"), math.nan)
    results: dict[str, Any] = {
        "rounds": rounds,
        "foreign_load_cores": load.cores(),
        "module_calls_per_forward": module_calls,
        "variants": {},
    }
    for variant in variants:
        cost = variant.cost(mode)
        entry: dict[str, Any] = {
            "cost_s": cost,
            "ratio_to_none": cost / none,
            "paired_ratio_to_none": variant.paired_ratio(mode, variants[0]),
            "added_ms": (cost - none) * 1e3,
            # the added time per module call of the forward, from the paired (per-round) differences
            "added_us_per_module_call": variant.paired_added(mode, variants[0]) / module_calls * 1e6,
        }
        if variant.name not in ("none", "hf") and hf > none:
            entry["added_over_added_hf"] = (cost - none) / (hf - none)
        entry["held_mb"] = variant.held_bytes / 2**20 if mode == "train" else 0.0
        if mode in variant.peak_bytes:
            entry["peak_mb"] = variant.peak_bytes[mode] / 2**20
        entry["config"] = None if variant.config is None else variant.config.model_dump(mode="json")
        entry["steps_s"] = [seconds for _index, seconds in variant.times[mode]]
        results["variants"][variant.name] = entry
    return results


def print_mode(mode: str, results: dict[str, Any], variants: list[Variant], shown_config: dict[str, Any]) -> None:
    rows = results["variants"]
    print(f"\n{mode}: {results['rounds']} rounds; ms per step; x none: cost / none's; paired: median per-round ratio")
    print(f"{'variant':<22}{'ms':>8}{'x none':>8}{'paired':>8}{'added ms':>10}{'added/hf':>10}{'kept MB':>9}  config")
    for variant in variants:
        row = rows[variant.name]
        added_hf = row.get("added_over_added_hf")
        config: Any = ""
        if variant.name in OPTIONS:
            config = {key: value for key, value in OPTIONS[variant.name][0].items() if key != "report_dir"}
        elif variant.name == "watch":
            config = shown_config
        elif variant.name == SENTINEL:
            config = {"mode": "sentinel"}
        peak = f" peak {row['peak_mb']:.0f} MB" if "peak_mb" in row else ""  # CUDA only
        print(
            f"{variant.name:<22}{row['cost_s'] * 1e3:>8.1f}{row['ratio_to_none']:>8.3f}"
            f"{row['paired_ratio_to_none']:>8.3f}{row['added_ms']:>10.1f}"
            f"{'' if added_hf is None else f'{added_hf:.3f}':>10}{row['held_mb']:>9.1f}{peak}"
            f"  {json.dumps(config) if config else ''}"
        )
    if "watch" in rows:
        ratio = rows["watch"]["ratio_to_none"]
        added = rows["watch"].get("added_over_added_hf")
        verdict = ratio <= TARGETS[mode] and (added is None or added <= TARGETS["added_vs_hf"])
        print(
            f"targets {mode}: watch/none <= {TARGETS[mode]:.2f}, "
            f"added(watch)/added(hf) <= {TARGETS['added_vs_hf']:.2f}: "
            f"{'met' if verdict else 'NOT met'}"
        )
    calls = results["module_calls_per_forward"]
    added = ", ".join(
        f"{variant.name} {rows[variant.name]['added_us_per_module_call']:.1f}"
        for variant in variants
        if variant.name != "none"
    )
    print(f"added per module call (paired, {calls} module calls per forward), us: {added}")
    busy = results["foreign_load_cores"]
    note = " (a busy machine: figures disturbed)" if busy > 0.2 else ""
    print(f"other processes used {busy:.2f} cores meanwhile{note}")


SENTINEL = "sentinel"
GUARD = "guard alone"
NO_SCALER = "watch, no scaler="


def make_variants(args: argparse.Namespace, mode: str) -> list[Variant]:
    config: nanwatch.WatchConfig = args.watch_config
    names: list[Variant] = [Variant("none", None), Variant("watch", config, _period(config))]
    if args.compile:  # compiled alone against compiled and watched; the other tools' hooks break graphs anyway
        return names
    if not args.no_sentinel:
        # Sentinel mode, and the guard alone (training only: without an optimizer step it does nothing).
        sentinel = config.with_overrides(mode="sentinel", watch_gradients=False, trace_batch_nums=[])
        names.append(Variant(SENTINEL, sentinel, _period(sentinel)))
        if mode == "train":
            names.append(Variant(GUARD, config, _period(config)))
    if not args.no_hf:
        names.append(Variant("hf", None))
    if args.gc_pause_too:
        flipped = config.with_overrides(pause_gc=not config.pause_gc)
        names.append(Variant(f"watch, pause_gc={flipped.pause_gc}", flipped, _period(flipped)))
    if args.scaler and mode == "train":
        names.append(Variant(NO_SCALER, config, _period(config), give_scaler=False))
    if args.each_option or args.option:
        for name, (overrides, modes) in OPTIONS.items():
            if mode in modes and (args.each_option or name in args.option):
                if "report_dir" in overrides:
                    overrides = overrides | {"report_dir": config.report_dir or tempfile.mkdtemp(prefix="nanwatch-")}
                option_config = config.with_overrides(**overrides)
                names.append(Variant(name, option_config, _period(option_config)))
    return names


def _period(config: nanwatch.WatchConfig) -> int:
    return math.lcm(config.watch_every_n_batches, config.summary_every_n_batches or 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        import transformers
    except ImportError as error:
        raise SystemExit('benchmarks/overhead.py needs transformers: pip install "nanwatch[transformers]"') from error
    device = torch.device(args.device)
    workload = WORKLOADS[args.model](args, device)
    if args.compile:
        # Every variant calls the compiled wrapper; watch() looks through it. Hooks taken off and put back between
        # variants are guarded by dynamo: each variant gets its own compiled code once, in the warm-up.
        workload.model = torch.compile(workload.model)
    module_calls = workload.module_calls()  # before compiling: a compiled forward runs the hooks of a graph
    model = workload.model
    bench = Bench(workload, device, scaler=args.scaler)
    n_params = sum(p.numel() for p in model.parameters())
    shown_config = {
        key: value
        for key, value in args.watch_config.model_dump(mode="json").items()
        if value != nanwatch.WatchConfig().model_dump(mode="json")[key]
    }
    print(
        f"{workload.description}; {device}, {args.threads} threads; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, nanwatch {nanwatch.__version__}; watch config {shown_config}"
        + ("; every training step through a GradScaler, given to nanwatch" if args.scaler else "")
    )
    # Summaries, headroom notes and the like go to the `nanwatch` logger: kept (their cost is part of the figures) but
    # collected here rather than printed between the tables. A logger with a handler of its own is left as it is.
    logs = io.StringIO()
    logger = logging.getLogger("nanwatch")
    saved_handlers, saved_level, saved_propagate = logger.handlers[:], logger.level, logger.propagate
    logger.handlers, logger.propagate = [logging.StreamHandler(logs)], False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)  # nanwatch's own level for its logger
    results: dict[str, Any] = {}
    problems: list[str] = []
    per_mode: dict[str, list[Variant]] = {}
    try:
        for mode in args.modes:
            variants = per_mode[mode] = make_variants(args, mode)
            for variant in variants:
                variant.set_up(model, bench.optimizer, bench.scaler)
            try:
                rounds = args.rounds if mode == "train" else args.infer_rounds
                results[mode] = run_mode(bench, variants, mode, rounds, args.warmup, module_calls)
                problems += [problem for variant in variants for problem in variant.problems()]
            finally:
                for variant in variants:
                    variant.close()
    finally:
        logger.handlers, logger.propagate = saved_handlers, saved_propagate
        logger.setLevel(saved_level)
    if problems:
        raise SystemExit("benchmark invalid: " + "; ".join(problems))
    for mode, mode_results in results.items():
        print_mode(mode, mode_results, per_mode[mode], shown_config)
        print_design_target(args, mode, mode_results)
    log_lines = logs.getvalue().splitlines()
    colon = ":" if log_lines else ""
    print(f"\nnanwatch logged {len(log_lines)} lines meanwhile (summaries, headroom notes){colon}")
    for line in log_lines[:3]:
        print(f"  {line[:150]}")
    payload = {
        "model": {"workload": args.model, "description": workload.description, "parameters": n_params},
        "batch": args.batch,
        "sequence": args.seq,
        "vocab": args.vocab,
        "threads": args.threads,
        "device": str(device),
        "grad_scaler": args.scaler,
        "compiled": args.compile,
        "warmup": args.warmup,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "nanwatch": nanwatch.__version__,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "targets": TARGETS,
        "final_loss": float(bench.losses[-1]) if bench.losses else None,
        "results": results,
    }
    write_results(payload, args.output)
    return 0


def print_design_target(args: argparse.Namespace, mode: str, results: dict[str, Any]) -> None:
    """The design targets of --dispatch (training), --compile and --model dispatch-sgd."""
    watch = results["variants"].get("watch")
    if watch is None:
        return
    if args.model == "dispatch-sgd" and mode == "train" and not args.compile:
        ratio, per_call = watch["paired_ratio_to_none"], watch["added_us_per_module_call"]
        met = "met" if ratio <= DISPATCH_SGD_TARGET and per_call <= PER_CALL_TARGET_US else "NOT met"
        print(
            f"target: dispatch-bound SGD training step, watch/none (paired) <= {DISPATCH_SGD_TARGET:.2f} and "
            f"<= {PER_CALL_TARGET_US:.0f} us added per module call: {met} ({ratio:.3f}, {per_call:.1f} us)"
        )
        return
    if args.compile:
        target, what = COMPILED_TARGET, "compiled and watched / compiled alone"
    elif args.model == "dispatch" and mode == "train":
        target, what = DISPATCH_TARGET, "dispatch-bound training step, watch/none"
    else:
        return
    met = "met" if watch["ratio_to_none"] <= target else "NOT met"
    print(f"target: {what} <= {target:.2f}: {met} ({watch['ratio_to_none']:.3f})")


def write_results(payload: dict[str, Any], output: Path) -> None:
    """Write a benchmark's figures as JSON, led by the command that produced them, and say where."""
    output.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    output.write_text(json.dumps({"command": command, **payload}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {output}")


if __name__ == "__main__":
    sys.exit(main())
