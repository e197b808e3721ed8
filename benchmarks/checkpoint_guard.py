"""What the checkpoint guard costs against the save it guards: the fused finiteness check of the weights and the
optimizer state vs `torch.save` of the same state to disk, on the CPU.

Models: the GPT-2 of benchmarks/overhead.py (4 layers, 256 wide: 5.1 M parameters, 21 MB) and one 8 times larger
(8 layers, 512 wide), each with AdamW's state after one step (weights + two moments: three times the weights).

    python benchmarks/checkpoint_guard.py --output benchmarks/results/checkpoint_guard.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

# The guard's check alone, timed apart from the save it guards: the public API runs the two together.
from nanwatch.core.stats.finite import non_finite_tensors


def _state(layers: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1024, n_positions=128, n_embd=width, n_layer=layers, n_head=4)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _median_s(action: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        action()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "checkpoint.pt"
        for layers, width in ((4, 256), (8, 512)):
            state = _state(layers, width)
            bad, tensors = non_finite_tensors(state)
            assert not bad
            size = sum(t.numel() * t.element_size() for t in state["model"].values())
            check = _median_s(lambda state=state: non_finite_tensors(state), args.rounds)
            save = _median_s(lambda state=state: torch.save(state, path), args.rounds)
            written = path.stat().st_size
            row = {
                "layers": layers,
                "width": width,
                "weights_mb": size / 1e6,
                "file_mb": written / 1e6,
                "tensors_checked": tensors,
                "check_ms": check * 1e3,
                "save_ms": save * 1e3,
                "check_over_save": check / save,
            }
            rows.append(row)
            print(
                f"GPT-2 {layers} layers x {width}: {tensors} tensors, file {written / 1e6:.0f} MB | check "
                f"{check * 1e3:.1f} ms, torch.save {save * 1e3:.1f} ms: the check is {check / save * 100:.1f} % of "
                "the save",
                flush=True,
            )
    if args.output:
        Path(args.output).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
