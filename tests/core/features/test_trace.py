"""core/features/trace.py: with report_dir, a traced batch is written there and the log gets one line for it;
without, every frame is logged; a write that fails stops the writing (the trace goes on in the log), never the
watching."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch

# Run in a child process whose file size limit is tiny: the trace files hit it after a few frames and every write
# after that fails with EFBIG, from the operating system, as on a full disk. (SIGXFSZ is ignored, so the write fails
# instead of the process being killed.)
_FULL_DISK = """
import json, resource, signal, sys, warnings
from pathlib import Path
import torch
from torch import nn
import nanwatch

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
report_dir = Path(sys.argv[1])
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
caught = []
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    handle = nanwatch.watch(model, trace_batch_nums=[0, 1, 2, 3], report_dir=report_dir)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))
    try:
        for batch in range(6):
            x = torch.ones(2, 4) * (float("inf") if batch == 4 else 1.0)
            model(x)
            handle.step()
    except nanwatch.NonFiniteError as error:
        caught.append(error.batch_number)
    handle.close()
print(json.dumps({
    "caught": caught,
    "disabled": handle.watcher.disabled_reason,
    "warnings": [str(w.message) for w in seen],
}))
"""


@pytest.mark.slow
def test_a_full_disk_stops_the_trace_files_and_the_watching_goes_on(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["caught"] == [4]  # the inf after the failed writes is still found, at its batch
    assert outcome["disabled"] is None
    trace_warnings = [w for w in outcome["warnings"] if "stopped writing the trace" in w]
    assert len(trace_warnings) == 1  # warned once
    assert "File too large" in trace_warnings[0]
    assert any("could not write the report" in w for w in outcome["warnings"])  # the report hit the limit too
    assert "Detected inf/nan during batch_number=4" in result.stderr  # ... and was logged all the same
    # After the failure the log gets the frames themselves, under their batch's header (before it, only a line per
    # traced batch saying where its frames went). The warning is not logged to stderr as well: Python's warnings
    # print it (here, where they are recorded, nothing does), so it is never shown twice.
    assert "*** Starting batch number=" in result.stderr
    assert "stopped writing the trace" not in result.stderr
    leftovers = [path.name for path in tmp_path.iterdir() if ".tmp-" in path.name]
    assert leftovers == []  # no temporary file left behind
    assert (tmp_path / "nanwatch-trace-rank0.txt").stat().st_size <= 1500


def test_a_traced_batch_goes_to_both_trace_files_and_one_line_to_the_log(
    tmp_path: Path, nanwatch_log: pytest.LogCaptureFixture
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    traced = list(range(1, 11))
    with nanwatch.watch(model, trace_batch_nums=traced, report_dir=tmp_path) as handle:
        for _ in range(12):
            model(torch.ones(1, 2))
            handle.step()
    text = (tmp_path / "nanwatch-trace-rank0.txt").read_text()
    assert [text.count(f"*** Starting batch number={n} ***") for n in range(12)] == [0] + [1] * 10 + [0]
    assert text.count(" Linear\n") == 2 * 10  # every frame is in the file
    records = (tmp_path / "nanwatch-trace-rank0.jsonl").read_text().splitlines()
    assert {json.loads(line)["batch"] for line in records} == set(traced)
    # The log: one line per traced batch, saying where its frames went, and not one frame.
    messages = [record.getMessage() for record in nanwatch_log.records]
    assert messages == [
        f"nanwatch: tracing batch_number={n} to {tmp_path / 'nanwatch-trace-rank0.txt'} and "
        "nanwatch-trace-rank0.jsonl beside it"
        for n in traced
    ]


def test_without_report_dir_every_frame_is_logged(nanwatch_log: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with nanwatch.watch(model, trace_batch_nums=[0]) as handle:
        model(torch.ones(1, 2))
        handle.step()
    messages = [record.getMessage() for record in nanwatch_log.records]
    assert len(messages) == 3  # Linear, ReLU, the root: one record per frame, the first under the batch's header
    assert messages[0].startswith(" " * 18 + "*** Starting batch number=0 ***\nabs min  abs max  metadata\n")
    assert messages[1].startswith(" " * 18 + "1 ReLU\n")
    assert not any("tracing batch_number" in message for message in messages)
