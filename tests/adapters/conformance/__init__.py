"""One harness per adapter, one interface: `run(scenario, workdir) -> Outcome` (see common.py).

Each harness trains the same tiny model (common.ConformanceNet, whose `Fault` module injects inf or raises the user's
error at a chosen micro-batch) through its framework for real, on the CPU, in float32, and returns what the
conformance tests assert on. Under torchrun (WORLD_SIZE=2) the same harness runs one DDP rank (ddp_rank.py).

The harness modules end in `_harness` so that a script run from this folder cannot shadow `lightning` or `accelerate`.
"""
