"""`on_detect="skip"` does no harm: every rank skips the same optimizer step, whatever the rank-local cause, and a step
the GradScaler skipped itself is neither listed nor skipped again. In both, a watched run with skip ends bit for bit
where an unwatched run that leaves out exactly the listed steps does."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.adapters.long_runs import batches, same, snapshot
from tests.models import small_mlp
from torch import nn

from nanwatch import watch

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))


# ------------------------------------------------------------------------------------------- two DDP ranks


@pytest.mark.multiprocess
def test_two_ddp_ranks_skip_the_same_step_when_only_rank_1_s_diagnostic_goes_inf(tmp_path: Path) -> None:
    # Before, rank 1 skipped optimizer step 1 and rank 0, which learned of it through the board only later, applied
    # step 1 and skipped step 2 instead: the replicas differed from then on.
    from torchrun_launch import run_torchrun

    args = ("--out", str(tmp_path), "--inject-at", "3", "--inject-rank", "1")
    result = run_torchrun("skip_vote_ddp_run.py", *args, timeout=240)

    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome-rank{rank}.json").read_text()) for rank in (0, 1)]
    for outcome in outcomes:
        assert outcome["error"] is None
        watched = outcome["watched"]
        assert [(entry["batch_number"], entry["rank"], entry["optimizer_step"]) for entry in watched["skipped"]] == [
            (3, 1, 1)
        ], "micro-batch 3 (optimizer step 1, accumulation 2) on rank 1, the same on both ranks"
        assert watched["finite"]
        assert watched["weights"] == outcome["twin"]["weights"], "not the unwatched run that leaves out step 1"
    assert outcomes[0]["watched"]["weights"] == outcomes[1]["watched"]["weights"], "the replicas differ"
    listed = [json.loads(line) for line in (tmp_path / "reports" / "skipped.jsonl").read_text().splitlines()]
    assert [(entry["batch_number"], entry["rank"], entry["optimizer_step"]) for entry in listed] == [(3, 1, 1)]
    assert (tmp_path / "reports" / "nanwatch-report-rank1-batch3.txt").exists()
    assert "did not reach the vote" not in result.stderr, "no rank waited out rank_wait_s"


# ------------------------------------------------------------------------------------------- the GradScaler


def _amp_run(optimizer_kind: str, report_dir: Path | None) -> dict[str, Any]:
    """A plain loop under CPU autocast (float16) and a GradScaler; the Scale module's output overflows float16 at
    micro-batch 2, so every gradient of that step is inf and the scaler skips the step itself. Watched with skip
    when `report_dir` is given, unwatched otherwise."""
    model = small_mlp()
    if optimizer_kind == "fused":  # told of the skip by found_inf, and called anyway
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    else:  # never called for a step the scaler skips
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    weights, scales = [], []
    handle = None
    if report_dir is not None:
        handle = watch(model, optimizer=optimizer, scaler=scaler, on_detect="skip", report_dir=report_dir)
    for index, (x, y) in enumerate(batches(6)):
        model[2].factor = 1e38 if index == 2 else 1.0
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(nn.functional.mse_loss(out.float(), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        if handle is not None:
            handle.step()
        weights.append(snapshot(model))
        scales.append(scaler.get_scale())
    skipped = None
    if handle is not None:
        handle.close()
        skipped = handle.skipped
    return {"weights": weights, "scales": scales, "skipped": skipped}


@pytest.mark.parametrize("optimizer_kind", ["plain", "fused"])
def test_a_step_the_grad_scaler_skipped_is_neither_listed_nor_skipped_again(
    tmp_path: Path, optimizer_kind: str
) -> None:
    # Before, the detection held for micro-batch 2's step (which the scaler skipped: no optimizer.step() came for a
    # plain optimizer) was carried to micro-batch 3's healthy step, which nanwatch skipped and listed; a fused
    # optimizer, called with found_inf set, had micro-batch 2's step listed as nanwatch's skip.
    watched = _amp_run(optimizer_kind, tmp_path)
    twin = _amp_run(optimizer_kind, None)

    assert watched["scales"] == twin["scales"]
    assert watched["scales"][2] < watched["scales"][1], "the scaler skipped micro-batch 2's step"
    assert same(watched["weights"][2], watched["weights"][1]), "micro-batch 2's step changed nothing"
    assert not same(watched["weights"][3], watched["weights"][2]), "micro-batch 3's step applied"
    assert all(same(a, b) for a, b in zip(watched["weights"], twin["weights"], strict=True)), "not the unwatched run"
    assert watched["skipped"] == []
    assert not (tmp_path / "skipped.jsonl").exists()
    assert (tmp_path / "nanwatch-report-rank0-batch2.txt").exists(), "the forward overflow is still reported"
