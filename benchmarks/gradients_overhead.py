"""What `watch_gradients=True` adds to a GPT-2-shaped training step: none vs forward-only vs forward and backward.

The same GPT-2 shape as benchmarks/overhead.py (4 layers, width 256, 4 heads, vocabulary 8192, batch 8 x 128), three
copies with identical weights and their own AdamW: unwatched, `nanwatch.watch(model)`, and
`nanwatch.watch(model, watch_gradients=True)`. After warm-up, each repetition times one training step (forward,
backward, optimizer step, `handle.step()`) of each copy in an order that rotates from one repetition to the next.
The figures are medians.

    python benchmarks/gradients_overhead.py                 # about a minute on 2 cores
    python benchmarks/gradients_overhead.py --repeats 40 --output /tmp/gradients.json

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

VARIANTS = ("none", "watch", "watch_gradients")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed training steps per variant (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: this process's CPU time (time.process_time), steadier on a busy machine",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def build_model(vocab: int, seq: int, seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=256,
        n_layer=4,
        n_head=4,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


class Contender:
    def __init__(self, variant: str, model: torch.nn.Module) -> None:
        self.variant = variant
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.handle: nanwatch.WatchHandle | None = None
        if variant != "none":
            self.handle = nanwatch.watch(model, optimizer=self.optimizer, watch_gradients=variant == "watch_gradients")

    def step(self, input_ids: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(input_ids, labels=input_ids).loss.backward()
        self.optimizer.step()
        if self.handle is not None:
            self.handle.step()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    base = build_model(args.vocab, args.seq, args.seed)
    contenders = [Contender(variant, copy.deepcopy(base)) for variant in VARIANTS]
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    for contender in contenders:
        for _ in range(args.warmup):
            contender.step(input_ids)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for repeat in range(args.repeats):
        shift = repeat % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            start = clock()
            contender.step(input_ids)
            times[contender.variant].append(clock() - start)
    frames = len(contenders[2].handle.watcher.recent_frames()) if contenders[2].handle is not None else 0
    for contender in contenders:
        if contender.handle is not None:
            contender.handle.close()

    median = {variant: statistics.median(values) for variant, values in times.items()}
    results: dict[str, Any] = {
        "median_s": median,
        "ratio_watch_none": median["watch"] / median["none"],
        "ratio_watch_gradients_none": median["watch_gradients"] / median["none"],
        "ratio_watch_gradients_watch": median["watch_gradients"] / median["watch"],
        "repeats": args.repeats,
        "threads": args.threads,
        "clock": args.clock,
        "torch": torch.__version__,
        "nanwatch": nanwatch.__version__,
        "machine": platform.machine(),
    }
    print(
        f"GPT-2 shape, batch {args.batch} x {args.seq}, CPU {args.threads} threads, {args.repeats} repeats, "
        f"{args.clock} clock (median ms per training step; ring holds {frames} frames)"
    )
    print(f"{'none':>10}{'watch':>10}{'+grads':>10}{'watch/none':>12}{'+grads/none':>13}{'+grads/watch':>14}")
    print(
        f"{median['none'] * 1e3:>10.1f}{median['watch'] * 1e3:>10.1f}{median['watch_gradients'] * 1e3:>10.1f}"
        f"{results['ratio_watch_none']:>12.3f}{results['ratio_watch_gradients_none']:>13.3f}"
        f"{results['ratio_watch_gradients_watch']:>14.3f}"
    )
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
