"""Seeding, full determinism, and `main_process_first` (with two real gloo processes for the ordering)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import nanwatch
from nanwatch.cli.doctor import find_free_port


@pytest.fixture(autouse=True)
def _restore_torch_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The helpers change process-wide state; put it back so other tests run as they would alone.
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def _draws() -> tuple[float, list[float]]:
    return random.random(), torch.rand(3).tolist()


def test_set_seed_repeats_python_and_torch_draws() -> None:
    nanwatch.set_seed(1234)
    first = _draws()
    nanwatch.set_seed(1234)
    assert _draws() == first
    nanwatch.set_seed(1235)
    assert _draws() != first
    assert not torch.are_deterministic_algorithms_enabled()


def test_set_seed_repeats_numpy_draws() -> None:
    np = pytest.importorskip("numpy")
    nanwatch.set_seed(7)
    first = np.random.rand(4).tolist()
    nanwatch.set_seed(7)
    assert np.random.rand(4).tolist() == first


def test_set_seed_deterministic_turns_on_deterministic_algorithms() -> None:
    nanwatch.set_seed(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True, "3"])
def test_set_seed_rejects_bad_seeds(seed: object) -> None:
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 4294967295\], got"):
        nanwatch.set_seed(seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("warn_only", [False, True])
def test_enable_full_determinism_sets_everything(warn_only: bool) -> None:
    torch.backends.cudnn.benchmark = True
    nanwatch.enable_full_determinism(99, warn_only=warn_only)
    first = _draws()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    assert torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    nanwatch.set_seed(99)
    assert _draws() == first


def test_enable_full_determinism_keeps_the_other_deterministic_cublas_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    nanwatch.enable_full_determinism(0)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_main_process_first_without_a_process_group_just_runs() -> None:
    ran = []
    with nanwatch.main_process_first():
        ran.append("local")
    with nanwatch.main_process_first(local=False):
        ran.append("global")
    assert ran == ["local", "global"]


def test_main_process_first_leaves_the_users_exception_alone() -> None:
    with pytest.raises(KeyError, match="mine"), nanwatch.main_process_first():
        raise KeyError("mine")


_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    import torch.distributed as dist

    import nanwatch
    from nanwatch.errors import NanwatchError

    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=30))
    record = {}

    def scenario(name, local, pause):
        marker = out / f"{name}-main-done"
        # Both ranks leave this barrier together: without main_process_first's wait, rank 1 would enter at once.
        dist.barrier()
        with nanwatch.main_process_first(local=local):
            entered = time.monotonic()
            saw_marker = marker.exists()
            if rank == 0:
                time.sleep(pause)
                marker.write_text("done")
            record[name] = {"entered": entered, "left": time.monotonic(), "saw_main_done": saw_marker}

    scenario("local", local=True, pause=0.5)
    os.environ["LOCAL_RANK"] = "0"  # as if each rank were the first process of its own node
    scenario("two_nodes_local", local=True, pause=1.0)
    scenario("two_nodes_global", local=False, pause=0.5)

    dist.barrier()
    try:
        with nanwatch.main_process_first(local=False):
            if rank == 0:
                raise KeyError("main failed")
            record["failure"] = "ran the block"
    except KeyError as error:
        record["failure"] = f"KeyError {error}"
    except NanwatchError as error:
        record["failure"] = f"NanwatchError {error}"
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    """
)


@pytest.mark.multiprocess
def test_main_process_first_orders_two_real_processes(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    base = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), WORLD_SIZE="2")
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=90)[0])
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert [p.returncode for p in processes] == [0, 0], outputs
    main, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))

    # Rank 1 (local rank 1) waited until rank 0 had finished the block, then ran it.
    assert not main["local"]["saw_main_done"]
    assert other["local"]["saw_main_done"]
    assert other["local"]["entered"] >= main["local"]["left"]
    # Both ranks are the first of their "node": neither waits for the other.
    assert not other["two_nodes_local"]["saw_main_done"]
    assert other["two_nodes_local"]["entered"] < main["two_nodes_local"]["left"]
    # local=False: only global rank 0 goes first, whatever LOCAL_RANK says.
    assert other["two_nodes_global"]["saw_main_done"]
    assert other["two_nodes_global"]["entered"] >= main["two_nodes_global"]["left"]
    # The main process keeps its own exception; the waiting one is told, instead of waiting forever or running on.
    assert main["failure"] == "KeyError 'main failed'"
    assert other["failure"].startswith("NanwatchError main_process_first: rank 0 raised inside the block, so rank 1")
