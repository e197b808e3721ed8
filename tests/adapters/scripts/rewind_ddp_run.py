"""A hand-written DDP loop with `on_detect="rewind"`: rank 0 alone saves a checkpoint through the handle every
`--save-every` optimizer steps; rank 1's diagnostic probe (its output only logged, so the inf never reaches the
gradients and rank 0 sees nothing) goes inf at micro-batch `--inject-at`. Both ranks must rewind to the same
checkpoint (rank 1 learns which through the store), hold exactly its weights and optimizer state right after the
rewind, and end with the same weights.

Run by tests/adapters/test_rewind.py as
    torchrun --nproc_per_node 2 rewind_ddp_run.py --out DIR --inject-at 5 --inject-rank 1
Each rank writes DIR/outcome-rank{R}.json.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from blowup_models import SumDataset, finish_rank
from skip_vote_ddp_run import Probed
from torch.nn.parallel import DistributedDataParallel

import nanwatch


def same_state(a: Any, b: Any) -> bool:
    """Whether two saved states are the same, byte for byte: every tensor `torch.equal` (and of the same dtype), every
    other value equal, in the same nested dicts, lists and tuples."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def train(options: argparse.Namespace, rank: int) -> dict[str, Any]:
    model = Probed(options.inject_at, options.inject_rank)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam([p for p in ddp.parameters() if p.requires_grad], lr=0.01)
    data = SumDataset(4 * options.micro_batches, seed=rank)
    config = {"report_dir": options.out / "reports", "on_detect": "rewind", "rank_wait_s": options.rank_wait_s}
    record: dict[str, Any] = {}
    with nanwatch.watch(ddp, optimizer=optimizer, **config) as handle:
        for micro in range(options.micro_batches):
            batch = data[slice(4 * micro, 4 * micro + 4)]
            optimizer.zero_grad()
            ddp(batch["x"], labels=batch["labels"])["loss"].backward()
            optimizer.step()
            if micro == options.inject_at:  # right after the rewind: the checkpoint's state, exactly
                record["after_rewind"] = {
                    "model": {name: value.clone() for name, value in ddp.state_dict().items()},
                    "optimizer": copy.deepcopy(optimizer.state_dict()),
                }
            handle.step()
            if rank == 0 and (micro + 1) % options.save_every == 0:
                state = {"model": ddp.state_dict(), "optimizer": optimizer.state_dict()}
                handle.save_checkpoint(state, options.out / f"checkpoint-{micro + 1}.pt")
        record["rewinds"] = [asdict(rewind) for rewind in handle.rewinds]
    weights = torch.cat([param.detach().flatten() for param in model.parameters()])
    record["weights"] = weights.double().tolist()  # float32 values, exactly
    record["finite"] = bool(torch.isfinite(weights).all())
    return record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject-at", type=int, required=True)
    parser.add_argument("--inject-rank", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--rank-wait-s", type=float, default=30.0)
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    error: BaseException | None = None
    record: dict[str, Any] = {"rank": rank, "error": None}
    try:
        run = train(options, rank)
        after = run.pop("after_rewind", None)
        record.update(run)
        if after is not None and record["rewinds"]:
            saved = torch.load(record["rewinds"][0]["path"], weights_only=True)
            record["model_as_saved"] = same_state(after["model"], saved["model"])
            record["optimizer_as_saved"] = same_state(after["optimizer"], saved["optimizer"])
    except nanwatch.NanwatchError as caught:
        error = caught
        record["error"] = str(caught)
    return finish_rank(options.out, rank, record, error)


if __name__ == "__main__":
    sys.exit(main())
