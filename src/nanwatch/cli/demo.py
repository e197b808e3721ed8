"""`nanwatch demo`: train a small fp16 model on the CPU until it overflows, and show nanwatch's report.

Exit status: 0 when nanwatch stopped the run at an inf/nan (what the demo is for), 1 when no inf/nan came within
--steps (or abort_after_batch_num stopped it first), 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from nanwatch.cli import COMMANDS
from nanwatch.cli.options import add_config_arguments, config_from_args
from nanwatch.cli.validators import NON_NEGATIVE_INT, POSITIVE_FLOAT
from nanwatch.core.config import WatchConfig
from nanwatch.errors import BatchLimitReached, NonFiniteError

if TYPE_CHECKING:
    import torch

__all__ = ["register", "run_demo", "build_demo_model"]


def build_demo_model(seed: int = 0) -> torch.nn.Module:
    """A small MLP kept in float16 (weights too, as in pure-fp16 training with no master copy)."""
    import torch  # here, not at the top: `nanwatch --help` must not import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 1),
    ).half()


def run_demo(config: WatchConfig, *, steps: int = 50, learning_rate: float = 0.01, seed: int = 0) -> int | None:
    """Train until inf/nan or `steps`; return the batch at which nanwatch stopped the run (None if it did not)."""
    import torch

    from nanwatch.adapters.plain import watch

    model = build_demo_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(512, 16, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True) * 300  # large targets: big gradients push fp16 weights up fast
    with watch(model, config, optimizer=optimizer) as handle:
        for step in range(steps):
            batch = slice((step * 32) % 512, (step * 32) % 512 + 32)
            try:
                output = model(inputs[batch].half())
                loss = (output.float() - targets[batch]).pow(2).mean()
                print(f"batch {step:3d}  loss {loss.item():.4e}")
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()  # nanwatch checks here: a step that would apply inf/nan never runs
                handle.step()
            except NonFiniteError as error:
                print(
                    f"\nnanwatch stopped the run at batch_number={error.batch_number}, before the optimizer step; "
                    f"inf/nan first appeared in module {error.module_name!r}.\n"
                    "Read the frames above from the top down: the numbers grow towards fp16's maximum (65504) "
                    "until one module's output is inf."
                )
                return error.batch_number
            except BatchLimitReached as stop:  # --abort-after-batch-num: the run ends early, as asked
                print(
                    f"\nstopped after batch_number={stop.batch_number}, as abort_after_batch_num asked; no inf/nan yet"
                )
                return None
    print(f"no inf/nan in {steps} batches")
    return None


def _run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    stopped_at = run_demo(config, steps=args.steps, learning_rate=args.lr)
    return 0 if stopped_at is not None else 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help=COMMANDS["demo"].summary,
        description=(
            "Train a small fp16 MLP with plain SGD until its activations overflow; nanwatch reports where. Exit "
            "status: 0 when nanwatch stopped the run at an inf/nan, 1 when none came within --steps, 2 on bad input."
        ),
    )
    parser.add_argument("--steps", type=NON_NEGATIVE_INT, default=50, help="most batches to train (default: 50)")
    parser.add_argument("--lr", type=POSITIVE_FLOAT, default=0.01, help="learning rate, > 0 (default: 0.01)")
    # --config FILE and one option per WatchConfig field; the demo shows a shorter report by default.
    add_config_arguments(parser, defaults={"max_frames_to_save": 8})
    parser.set_defaults(func=_run, parser=parser)
