"""What scope and summary mode save or cost on a GPT-2-shaped training step.

The GPT-2 shape of benchmarks/overhead.py (4 layers, width 256, 4 heads, vocabulary 8192, batch 8 x 128), one copy
per variant with identical weights and its own AdamW:

    none           no watcher
    every_1        nanwatch.watch(model)                                   (every batch recorded)
    every_10       nanwatch.watch(model, watch_every_n_batches=10)
    every_10_sum   the same with summary_every_n_batches=10                (one read-back every 10 batches)
    one_block      nanwatch.watch(model, include_modules=["transformer.h.0", "transformer.h.0.*"])

With every 10th batch watched, one step in ten costs what `every_1` costs and nine cost almost nothing, so a median
of single steps would hide the watched one. Each round therefore times a block of 10 consecutive steps per variant
(batches 10k..10k+9: exactly one watched), in an order that rotates from round to round; the figures are the median
over rounds of the per-step mean of a block, and the median of the per-round ratios to `none`.

    python benchmarks/scope_overhead.py                         # about 2 minutes on 2 cores
    python benchmarks/scope_overhead.py --rounds 12 --device cuda --output /tmp/scope.json

A benchmark, not a test: it reports and asserts nothing. Needs `transformers` (the `transformers` extra).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import nanwatch

VARIANTS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "every_1": {},
    "every_10": {"watch_every_n_batches": 10},
    "every_10_sum": {"watch_every_n_batches": 10, "summary_every_n_batches": 10},
    "one_block": {"include_modules": ["transformer.h.0", "transformer.h.0.*"]},
}
BLOCK = 10  # steps per variant and round: one watch_every_n_batches=10 period


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help=f"timed rounds of {BLOCK} steps per variant (default 6)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def build_model(vocab: int, seq: int, seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


class Contender:
    """One model copy, its optimizer, and its watch handle (None for `none`)."""

    def __init__(self, variant: str, model: torch.nn.Module, config: dict[str, Any] | None) -> None:
        self.variant = variant
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.handle = None if config is None else nanwatch.watch(model, **config)

    def block(self, input_ids: torch.Tensor, device: torch.device) -> tuple[float, float]:
        """Wall seconds and this process's CPU seconds per step, averaged over BLOCK consecutive training steps."""
        self.model.train()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(BLOCK):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.model(input_ids, labels=input_ids).loss
            loss.backward()
            self.optimizer.step()
            if self.handle is not None:
                self.handle.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / BLOCK, (time.process_time() - cpu_start) / BLOCK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    base = build_model(args.vocab, args.seq, args.seed).to(device)
    contenders = [Contender(name, copy.deepcopy(base), config) for name, config in VARIANTS.items()]
    generator = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)

    for contender in contenders:  # warm-up: one untimed block each (allocator, kernels, caches)
        contender.block(input_ids, device)
    per_step: dict[str, list[float]] = {c.variant: [] for c in contenders}
    cpu_per_step: dict[str, list[float]] = {c.variant: [] for c in contenders}
    for round_index in range(args.rounds):
        shift = round_index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            wall, cpu = contender.block(input_ids, device)
            per_step[contender.variant].append(wall)
            cpu_per_step[contender.variant].append(cpu)

    for contender in contenders:
        if contender.handle is not None:
            watcher = contender.handle.watcher
            if watcher.disabled_reason is not None:
                print(f"warning: {contender.variant}: nanwatch stopped watching: {watcher.disabled_reason}")
            contender.handle.close()

    none = per_step["none"]
    results: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": args.threads,
        "rounds": args.rounds,
        "steps_per_round": BLOCK,
        "shape": {"batch": args.batch, "seq": args.seq, "vocab": args.vocab, "n_embd": 256, "n_layer": 4},
        "variants": {},
    }
    # CPU time of this process is less disturbed than wall time when other programs share the machine.
    header = f"{'variant':<14} {'ms/step':>9} {'x none':>8} {'added ms':>9} {'cpu x none':>11}   config"
    print(f"GPT-2 shape, batch {args.batch} x {args.seq}, {device}, {args.threads} threads, torch {torch.__version__}")
    print(f"median over {args.rounds} rounds of the mean of {BLOCK} consecutive training steps")
    print(header)
    none_median = statistics.median(none)
    for variant, times in per_step.items():
        median = statistics.median(times)
        ratio = statistics.median(t / n for t, n in zip(times, none, strict=True))
        cpu_ratio = statistics.median(t / n for t, n in zip(cpu_per_step[variant], cpu_per_step["none"], strict=True))
        results["variants"][variant] = {
            "config": VARIANTS[variant],
            "median_s_per_step": median,
            "paired_ratio_to_none": ratio,
            "added_ms_per_step": (median - none_median) * 1e3,
            "paired_cpu_ratio_to_none": cpu_ratio,
            "per_round_s": times,
            "per_round_cpu_s": cpu_per_step[variant],
        }
        config = "-" if VARIANTS[variant] is None else json.dumps(VARIANTS[variant])
        added = (median - none_median) * 1e3
        print(f"{variant:<14} {median * 1e3:9.1f} {ratio:8.3f} {added:9.1f} {cpu_ratio:11.3f}   {config}")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
