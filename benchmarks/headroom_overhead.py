"""What the headroom checks add to a GPT-2-shaped step: headroom off vs on (the default) vs counting underflow.

The same GPT-2 shape as benchmarks/overhead.py (4 layers, width 256, 4 heads, vocabulary 8192, batch 8 x 128), one
copy per variant with identical weights and its own AdamW:

- none: unwatched;
- off: `nanwatch.watch(model, headroom_warn_fraction=None)`, the inf/nan check alone;
- headroom: `nanwatch.watch(model)`, the default (headroom_warn_fraction=0.125);
- underflow: `count_underflow=True` on top of the default;
- target: `target_dtype="float16", count_underflow=True`.

After warm-up, each repetition times one step of each copy (training: forward, backward, optimizer step,
`handle.step()`; inference: an eval forward under no_grad, checked as it returns) in an order that rotates from one
repetition to the next. The figures are medians. The model is float32 with small random weights, so nothing comes
near a limit and no warning is logged: this is the cost of looking, paid at every batch.

    python benchmarks/headroom_overhead.py                      # a few minutes on 2 cores
    python benchmarks/headroom_overhead.py --repeats 40 --output /tmp/headroom.json

A benchmark, not a test: it reports and asserts nothing. Needs `transformers` (the `transformers` extra).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nanwatch

VARIANTS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "off": {"headroom_warn_fraction": None},
    "headroom": {},
    "underflow": {"count_underflow": True},
    "target": {"target_dtype": "float16", "count_underflow": True},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per variant and mode (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant and mode first (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="train,infer", help="comma-separated subset of train,infer")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not args.modes or set(args.modes) - {"train", "infer"}:
        parser.error(f"--modes can hold train and infer, got {args.modes!r}")
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
    def __init__(self, name: str, model: torch.nn.Module) -> None:
        self.name = name
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        overrides = VARIANTS[name]
        self.handle = None if overrides is None else nanwatch.watch(model, watch_eval=True, **overrides)

    def train_step(self, input_ids: torch.Tensor) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.model(input_ids, labels=input_ids).loss.backward()
        self.optimizer.step()
        if self.handle is not None:
            self.handle.step()

    def infer_step(self, input_ids: torch.Tensor) -> None:
        self.model.eval()
        with torch.no_grad():
            self.model(input_ids)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def time_interleaved(
    contenders: list[Contender], step: Callable[[Contender], None], repeats: int, warmup: int
) -> dict[str, float]:
    for contender in contenders:
        for _ in range(warmup):
            step(contender)
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for repeat in range(repeats):
        shift = repeat % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            start = time.perf_counter()
            step(contender)
            times[contender.name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    base = build_model(args.vocab, args.seq, args.seed)
    contenders = [Contender(name, copy.deepcopy(base)) for name in VARIANTS]
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed))
    print(
        f"GPT-2 shape: 4 layers, width 256, vocab {args.vocab}; batch {args.batch} x {args.seq}; CPU, {args.threads} "
        f"threads; torch {torch.__version__}, nanwatch {nanwatch.__version__}"
    )
    results: dict[str, dict[str, float]] = {}
    try:
        if "train" in args.modes:
            results["train"] = time_interleaved(
                contenders, lambda c: c.train_step(input_ids), args.repeats, args.warmup
            )
        if "infer" in args.modes:
            results["infer"] = time_interleaved(
                contenders, lambda c: c.infer_step(input_ids), args.repeats, args.warmup
            )
    finally:
        for contender in contenders:
            contender.close()
    print(f"{'step':<8}" + "".join(f"{name + ' ms':>14}" for name in VARIANTS))
    for mode, medians in results.items():
        print(f"{mode:<8}" + "".join(f"{medians[name] * 1e3:>14.1f}" for name in VARIANTS))
    for mode, medians in results.items():
        off = medians["off"]
        added = ", ".join(f"{name} {medians[name] / off:.3f}x" for name in ("headroom", "underflow", "target"))
        print(
            f"{mode}: relative to the inf/nan check alone: {added}; the check alone: {off / medians['none']:.3f}x none"
        )
    if args.output is not None:
        payload = {
            "variants": {name: overrides for name, overrides in VARIANTS.items()},
            "batch": args.batch,
            "sequence": args.seq,
            "threads": args.threads,
            "repeats": args.repeats,
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "median_s": results,
        }
        args.output.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
