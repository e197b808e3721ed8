"""A hand-written PyTorch loop in float16 on the CPU: too high a learning rate makes the activations overflow.

The model is a small residual MLP cast to float16 with `.half()` (as in pure-fp16 training), fitting targets in the
tens of thousands with a learning rate that is far too high. Its weights grow with every optimizer step until a
hidden activation passes 65504, the largest float16, and turns to inf. `nanwatch.watch(model, optimizer=opt)` finds
the first module whose output holds inf, shows the frames that led there, and stops the run before the optimizer
step that would apply that micro-batch. Gradient accumulation is 2: `batch_number` counts micro-batches.

    python examples/plain_loop.py [--config nanwatch.yaml] [--report-dir reports/] [--max-frames-to-save 21]
    torchrun --nproc_per_node 2 examples/plain_loop.py     # DistributedDataParallel, gloo, on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nanwatch
from nanwatch.cli.options import add_config_arguments, config_from_args

ACCUMULATION = 2  # micro-batches per optimizer step
MICRO_BATCH = 16


class Residual(nn.Module):
    """x + down(gelu(up(x))), with no normalization: nothing keeps the residual stream small."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=200, help="most micro-batches to train (default: 200)")
    parser.add_argument("--lr", type=float, default=0.2, help="learning rate (default: 0.2, far too high)")
    add_config_arguments(parser, defaults={"max_frames_to_save": 12})
    args = parser.parse_args(argv)
    config = config_from_args(args, parser)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:  # started by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 64), Residual(64), Residual(64), nn.Linear(64, 1)).half()
    ddp = DistributedDataParallel(model) if distributed else None
    trained = ddp if ddp is not None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    inputs = torch.randn(256, 16, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True) * 30_000  # unnormalized targets, far beyond what fp16 holds well

    try:
        with nanwatch.watch(trained, config, optimizer=optimizer) as handle:
            for micro in range(args.micro_batches):
                rows = slice(micro * MICRO_BATCH % 256, micro * MICRO_BATCH % 256 + MICRO_BATCH)
                last = (micro + 1) % ACCUMULATION == 0
                # Under DDP, gradients are all-reduced only on the last micro-batch of each optimizer step.
                with contextlib.nullcontext() if last or ddp is None else ddp.no_sync():
                    prediction = trained(inputs[rows].half())
                    # Computed outside the model: handed over, so nanwatch checks it as well.
                    loss = handle.watch_loss((prediction.float() - targets[rows]).abs().mean() / ACCUMULATION)
                    loss.backward()
                if last:
                    optimizer.step()  # nanwatch checks (and agrees across ranks) here, before the weights change
                    optimizer.zero_grad()
                    if rank == 0:  # optimizer steps are 0-indexed, like batch_number
                        print(f"optimizer step {handle.optimizer_step - 1:3d}  loss {loss.item() * ACCUMULATION:.4e}")
                handle.step()
    except nanwatch.NonFiniteError as error:
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        where = f"first in module {error.module_name!r}" if error.module_name else f"see rank {error.rank}'s report"
        sys.stdout.write(  # one write, the newline included: the ranks' lines never interleave in a shared log
            f"[rank {rank}] stopped: inf/nan in batch_number={error.batch_number} on rank {error.rank}, {where}; "
            f"optimizer step {error.optimizer_step} never ran; weights still finite: {finite}\n"
        )
        return 1
    finally:
        if distributed:
            dist.destroy_process_group()
    print("finished without inf/nan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
