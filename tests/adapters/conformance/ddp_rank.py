"""One rank of an adapter's harness under torchrun (2 processes, gloo on the CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 2 ddp_rank.py ADAPTER SCENARIO_JSON OUT

with the repository root on PYTHONPATH. Each rank runs `tests.adapters.conformance.{ADAPTER}_harness.run(scenario,
OUT)`, writes what came of it to OUT/outcome-rank{R}.json (`Outcome.record()`), waits for the other rank at a barrier
and exits 0, even when training raised (the error is in the record):
- torchrun stops every other worker as soon as one exits non-zero, which could cut the other rank's record short;
- the barrier keeps a rank from closing its connections while the other may still be in its framework's clean-up;
  a rank that hangs leaves the other one waiting there, and the test's timeout reports it;
- `os._exit` skips the interpreter's and C++'s teardown, where gloo's threads occasionally abort the process
  ("terminate called without an active exception") after everything the test looks at is done.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from tests.adapters.conformance.common import Scenario


def main() -> None:
    adapter, scenario_json, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    harness = importlib.import_module(f"tests.adapters.conformance.{adapter}_harness")
    outcome = harness.run(Scenario(**json.loads(scenario_json)), out)
    record = {**outcome.record(), "ended_at": time.time()}
    (out / f"outcome-rank{os.environ['RANK']}.json").write_text(json.dumps(record), encoding="utf-8")
    if dist.is_initialized():  # a framework may have left the process group already
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
