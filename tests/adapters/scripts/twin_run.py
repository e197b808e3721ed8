"""Twins under torchrun: the same healthy training run, unwatched and then watched, on DDP, FSDP1 and FSDP2, in
each of nanwatch's modes; each rank writes what each twin ended with.

Run by tests/twins/test_twins_distributed.py as
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc_per_node 2 twin_run.py --out DIR [--stacks ...] [--modes ...]
Each rank writes DIR/twins-rank{R}.json: for each `stack/mode`, the unwatched and the watched twin's digest (this
rank's weights, optimizer state and RNG states, bit for bit), how many optimizer steps ran, how many collectives the
run issued (the process groups' sequence numbers: a collective nanwatch issued of its own shows as one more), and the
error, if any. The test compares the twins.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import nanwatch

MICRO_BATCHES = 8
ACCUMULATION = 2  # an optimizer step every other micro-batch: FSDP2's reduce-scatter runs at each backward
SAVE_EVERY = 2  # optimizer steps between two checkpoints in the "checkpoints" mode

STACKS = ("ddp", "fsdp1", "fsdp2", "fsdp2-mixed")
MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "sentinel": {"mode": "sentinel"},
    "gradients": {"watch_gradients": True},
    "spikes-skip": {"spike_window": 3, "on_detect": "skip"},
    "checkpoints": {},
}


class GeluBlock(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width_in, width_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class UnlikeShapesNet(nn.Module):
    """Linears of unlike shapes: the guard reduces each gradient on its own, not stacked with others of its shape."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 40)
        self.blocks = nn.ModuleList([GeluBlock(40, 48), GeluBlock(48, 32)])
        self.out = nn.Linear(32, 2)  # every shard non-empty on 2 ranks, as most layers' are

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.out(hidden)


def build(stack: str) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in both twins
    net = UnlikeShapesNet()
    if stack == "ddp":
        return nn.parallel.DistributedDataParallel(net)
    if stack == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            net, auto_wrap_policy=ModuleWrapPolicy({GeluBlock}), device_id=torch.device("cpu")
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {}
    if stack == "fsdp2-mixed":
        # Parameters gathered in bfloat16, gradients reduced in float32, kept gathered between forward and backward.
        options = {
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "reshard_after_forward": False,
        }
    for module in (net.inp, *(block.fc for block in net.blocks), net.out):  # each Linear, then the root
        fully_shard(module, **options)
    fully_shard(net, **options)
    return net


def collectives() -> int:
    """Collectives issued so far on every process group of this process (each one's sequence number)."""
    groups = list(dist.distributed_c10d._world.pg_map)
    return sum(group._get_sequence_number_for_group() for group in groups)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """This rank's weights (its shards), optimizer state and RNG states, hashed bit for bit (no collective)."""

    def hashed(tensors: list[torch.Tensor]) -> str:
        sha = hashlib.sha256()
        for tensor in tensors:
            local = _local(tensor).detach().contiguous().cpu()
            sha.update(str((local.dtype, tuple(local.shape))).encode())
            sha.update(local.reshape(-1).view(torch.uint8).numpy().tobytes())
        return sha.hexdigest()

    state = [value for per_param in optimizer.state.values() for value in per_param.values()]
    return {
        "weights": hashed([param for param in model.parameters()]),
        "optimizer": hashed([value for value in state if isinstance(value, torch.Tensor)]),
        "torch_rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "python_rng": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
        "numpy_rng": hashlib.sha256(repr(np.random.get_state()).encode()).hexdigest(),
    }


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [
        (torch.randn(4, 4, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(MICRO_BATCHES)
    ]


def train(stack: str, mode: str, watched: bool, out: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    model = build(stack)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = [0]
    optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    data = batches(rank)
    before = collectives()
    folder = out / f"{stack}-{mode}-{'watched' if watched else 'unwatched'}"
    handle = (
        nanwatch.watch(model, optimizer=optimizer, report_dir=str(folder), rank_wait_s=20, **MODES[mode])
        if watched
        else None
    )
    error = None
    watching: dict[str, Any] = {}
    try:
        for index, (inputs, targets) in enumerate(data):
            # A draw from every generator the user has, as data augmentation and dropout do.
            noise = torch.rand(()) * 1e-3 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss = nn.functional.mse_loss(model(inputs + noise), targets) / ACCUMULATION
            loss.backward()
            if (index + 1) % ACCUMULATION == 0:
                optimizer.step()
                optimizer.zero_grad()
                if mode == "checkpoints" and steps[0] % SAVE_EVERY == 0:
                    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                    path = folder / f"step{steps[0]}-rank{rank}.pt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if handle is not None:
                        handle.save_checkpoint(state, path, step=steps[0])
                    else:
                        torch.save(state, path)
            if handle is not None:
                handle.step()
        if handle is not None and handle.watcher is not None:  # still watching at the end, and what it recorded
            watching = {
                "disabled_reason": handle.watcher.disabled_reason,
                "frames": len(handle.watcher.recent_frames()),
            }
    except Exception as caught:  # recorded for the test, which shows it
        error = "".join(traceback.format_exception(caught))[-3000:]
    finally:
        if handle is not None:
            handle.close()
    return {
        "digest": digest(model, optimizer),
        "steps": steps[0],
        "collectives": collectives() - before,
        "error": error,
        "watching": watching,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stacks", nargs="+", default=list(STACKS))
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    # As in the test suite: a warning of nanwatch's (it stopped watching, the agreement failed) fails the twin.
    warnings.simplefilter("error", nanwatch.NanwatchWarning)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for stack in args.stacks:
        for mode in args.modes:
            results[f"{stack}/{mode}"] = {
                "unwatched": train(stack, mode, False, args.out),
                "watched": train(stack, mode, True, args.out),
            }
            (args.out / f"twins-rank{rank}.json").write_text(json.dumps(results, indent=1))
            dist.barrier()  # both ranks at the same twin: a crash in one shows as that twin's, not the next's
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
