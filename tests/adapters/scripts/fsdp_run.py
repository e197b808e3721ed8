"""`nanwatch.watch()` on a model sharded by FSDP2 (`fully_shard`) or FSDP1 (`FullyShardedDataParallel`), its blocks
under `checkpoint_wrapper`, in a hand-written loop with gradient accumulation 2: a clean run, then a run whose
micro-batch 3 goes inf on rank 1.

Run by tests/adapters/test_fsdp.py as
    torchrun --nproc_per_node 2 fsdp_run.py --out DIR --fsdp 2 1
Each rank writes DIR/outcome-rank{R}.json (by FSDP version: the clean run, the bad run) and exits 0; reports go to
DIR/fsdp{V}/. The test reads what happened there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from blowup_models import Blowup, SumDataset, hook_count
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import nanwatch
from nanwatch.core.frames import Direction, Role, resolve
from nanwatch.core.stats.measure import measure
from nanwatch.core.stats.readback import holds_non_finite

ACCUMULATION = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class Net(nn.Module):
    """Linear -> 2 blocks -> Blowup -> Linear, returning {"loss", "logits"}."""

    def __init__(self, inject_at: int | None, inject_rank: int | None) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.blowup = Blowup(inject_at, inject_rank)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.out(self.blowup(hidden))
        return {"logits": logits, "loss": nn.functional.mse_loss(logits, labels)}


def build(version: int, inject_at: int | None, inject_rank: int | None) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    net = Net(inject_at, inject_rank)
    for index, block in enumerate(net.blocks):
        net.blocks[index] = checkpoint_wrapper(block)  # activation checkpointing (non-reentrant), as torchtitan does
    if version == 2:
        from torch.distributed.fsdp import fully_shard

        for module in (net.inp, *net.blocks, net.out):
            fully_shard(module)
        fully_shard(net)
        return net
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({Block, nn.Linear})
    return FullyShardedDataParallel(net, auto_wrap_policy=policy, device_id=torch.device("cpu"))


@contextlib.contextmanager
def no_sync(model: nn.Module, version: int, last: bool) -> Iterator[None]:
    """Gradients are reduced only on the last micro-batch of each accumulation group."""
    if last:
        yield
    elif version == 2:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
    else:
        with model.no_sync():  # type: ignore[operator]
            yield


def local_weights(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shard of every parameter (FSDP2: a DTensor's local tensor; FSDP1: the flat parameter's)."""
    return [getattr(p, "_local_tensor", p).detach().clone() for p in model.parameters()]


def train(
    model: nn.Module,
    version: int,
    handle: nanwatch.WatchHandle,
    optimizer: torch.optim.Optimizer,
    rank: int,
    micro_batches: int,
) -> dict[str, Any]:
    data = SumDataset(4 * micro_batches, seed=rank)
    before_step = local_weights(model)
    record: dict[str, Any] = {"ran": 0, "steps_done": 0, "error": None}
    try:
        for micro in range(micro_batches):
            batch = data[slice(4 * micro, 4 * micro + 4)]
            last = (micro + 1) % ACCUMULATION == 0
            with no_sync(model, version, last):
                loss = model(batch["x"], labels=batch["labels"])["loss"] / ACCUMULATION
                loss.backward()
            if last:
                optimizer.step()  # nanwatch agrees across ranks here; a bad micro-batch never reaches the weights
                optimizer.zero_grad()
                before_step = local_weights(model)
                record["steps_done"] += 1
            handle.step()
            record["ran"] += 1
    except nanwatch.NonFiniteError as caught:
        record["error"] = {
            "batch_number": caught.batch_number,
            "rank": caught.rank,
            "optimizer_step": caught.optimizer_step,
            "module_name": caught.module_name,
        }
    after = local_weights(model)
    record["weights_unchanged"] = all(torch.equal(a, b) for a, b in zip(after, before_step, strict=True))
    return record


def frames_seen(handle: nanwatch.WatchHandle) -> dict[str, Any]:
    """What the ring holds: every (batch, module, class) of a forward frame, and each parameter line's numbers."""
    frames = resolve(handle.watcher.recent_frames())
    forward = [f for f in frames if f.direction is Direction.FORWARD]
    parameters = {
        f"{frame.module_name}/{entry.label}": [list(entry.shape or ()), entry.abs_min, entry.abs_max]
        for frame in forward
        if frame.batch_number == handle.batch_number - 1
        for entry in frame.entries
        if entry.role is Role.PARAMETER
    }
    return {
        "forward": [[f.batch_number, f.module_name, f.class_name] for f in forward],
        "backward": sum(1 for f in frames if f.direction is Direction.BACKWARD),
        "parameters": parameters,
    }


def shards_measured(model: nn.Module) -> list[list[Any]]:
    """Each parameter measured as it is between forwards (FSDP2: a sharded DTensor), read back on this rank alone
    (a collective here, on one rank, would hang): [name, local numel, abs max read, abs max of the local shard]."""
    found = []
    for name, param in model.named_parameters():
        measurement = measure(param)
        local = getattr(param, "_local_tensor", param).detach()
        read = holds_non_finite([measurement]) if dist.get_rank() == 0 else None  # one rank only, on purpose
        expected = local.abs().max().item() if local.numel() else None
        got = measurement.abs_max.item() if measurement.abs_max is not None else None
        found.append([name, local.numel(), got, expected, read])
    return found


def clean_run(version: int, out: Path, rank: int) -> dict[str, Any]:
    """A clean run, with everything that reads on some ranks only: headroom (rank 0), a traced batch (rank 0), the
    backward frames, the report directory."""
    model = build(version, None, None)
    hooks_before = hook_count(model)  # FSDP's own
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", nanwatch.NanwatchWarning)
        config = {
            "headroom_warn_fraction": 0.5,
            "trace_batch_nums": [1],
            "watch_gradients": True,
            "max_frames_to_save": 400,
            "report_dir": out / "clean-reports",
        }
        with nanwatch.watch(model, config, optimizer=optimizer) as handle:
            clean = train(model, version, handle, optimizer, rank, micro_batches=6)
            clean.update(frames_seen(handle))
            clean["disabled_reason"] = handle.watcher.disabled_reason
    clean["warnings"] = [str(w.message) for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    clean["hooks_left"] = hook_count(model) - hooks_before
    clean["shards_measured"] = shards_measured(model)
    return clean


def bad_run(version: int, out: Path, rank: int, mode: str = "full") -> dict[str, Any]:
    """Micro-batch 3 (the last of optimizer step 1) goes inf on rank 1 only."""
    model = build(version, 3, 1)
    hooks_before = hook_count(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reports = out / ("reports" if mode == "full" else f"{mode}-reports")
    with nanwatch.watch(model, optimizer=optimizer, report_dir=reports, mode=mode) as handle:
        bad = train(model, version, handle, optimizer, rank, micro_batches=8)
    bad["hooks_left"] = hook_count(model) - hooks_before
    bad["optimizer_hooks_left"] = len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fsdp", type=int, choices=(1, 2), nargs="+", required=True)
    options = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    outcome: dict[str, Any] = {"rank": rank}
    for version in options.fsdp:  # one launch for both: starting two processes costs more than running them
        out = options.out / f"fsdp{version}"
        outcome[f"fsdp{version}"] = {
            "clean": clean_run(version, out, rank),
            "bad": bad_run(version, out, rank),
            "sentinel": bad_run(version, out, rank, mode="sentinel"),
        }
    (options.out / f"outcome-rank{rank}.json").write_text(json.dumps(outcome), encoding="utf-8")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
