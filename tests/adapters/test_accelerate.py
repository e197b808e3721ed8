"""OverflowTracker with a real Accelerator on the CPU: one process in-process, two processes under torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from tests.models import small_mlp  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from nanwatch import NanwatchWarning, NonFiniteError, WatchConfig  # noqa: E402
from nanwatch.adapters.accelerate import OverflowTracker  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
MICRO_BATCHES_PER_EPOCH = 6


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def make_run(
    tracker: OverflowTracker,
) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, DataLoader[tuple[torch.Tensor, ...]]]:
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True, log_with=[tracker])
    model = small_mlp(scale=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(2 * MICRO_BATCHES_PER_EPOCH, 4), torch.randn(2 * MICRO_BATCHES_PER_EPOCH, 1))
    loader = DataLoader(data, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    tracker.attach(accelerator, model)
    return accelerator, model, optimizer, loader


def hooks_left(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    real = optimizer.optimizer  # type: ignore[attr-defined]
    found = [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if real._optimizer_step_pre_hooks or real._optimizer_step_post_hooks:
        found.append("optimizer")
    return found


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[tuple[torch.Tensor, ...]],
    *,
    inf_at: int,
    at_start: dict[int, list[torch.Tensor]],
) -> None:
    """Three epochs of the usual Accelerate loop; `at_start` gets the weights as each micro-batch begins."""
    micro_batch = 0
    for _ in range(3):
        for x, y in loader:
            at_start[micro_batch] = weights(model)
            if micro_batch == inf_at:
                x = x.clone()
                x[0, 0] = float("inf")
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            micro_batch += 1


def run_micro_batches(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    for x, y in batches:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize(
    "inf_at",
    [
        pytest.param(8, id="first-micro-batch-of-a-window"),  # caught at the next micro-batch's forward
        pytest.param(9, id="micro-batch-that-steps"),  # caught just before the optimizer step
    ],
)
def test_gradient_accumulation_stops_before_the_step(inf_at: int, tmp_path: Path) -> None:
    tracker = OverflowTracker(WatchConfig(report_dir=tmp_path), max_frames_to_save=5, capture_on_detect=True)
    accelerator, model, optimizer, loader = make_run(tracker)
    at_start: dict[int, list[torch.Tensor]] = {}
    with pytest.raises(NonFiniteError) as caught:
        train(accelerator, model, optimizer, loader, inf_at=inf_at, at_start=at_start)

    error = caught.value
    assert max(at_start) == 9  # stopped inside micro-batch 9, whichever of 8 and 9 held the inf
    assert (error.batch_number, error.rank, error.module_name, error.phase) == (inf_at, 0, "0", "train")
    # Two micro-batches per step: steps 0-3 applied (micro-batches 0-7), micro-batches 8 and 9 belong to step 4.
    assert error.optimizer_step == 4
    assert error.epoch == inf_at // MICRO_BATCHES_PER_EPOCH == 1
    # The weights are those from before the window: the step that would apply the inf never ran ...
    for now, before in zip(weights(model), at_start[8], strict=True):
        assert torch.equal(now, before)
    # ... while the steps before it did run.
    assert any(not torch.equal(a, b) for a, b in zip(at_start[8], at_start[0], strict=True))
    assert hooks_left(model, optimizer) == []
    report = (tmp_path / f"nanwatch-report-rank0-batch{inf_at}.txt").read_text()
    assert report.startswith(f"Detected inf/nan during batch_number={inf_at}\n")
    assert error.report + "\n" == report
    # The replay copy is of the failing micro-batch, even when the next one's forward had begun (inf_at=8).
    assert (tmp_path / f"replay-rank0-batch{inf_at}.pt").is_file()


@pytest.mark.parametrize("watch_eval", [False, True])
def test_eval_forwards_are_not_counted_unless_asked(watch_eval: bool) -> None:
    tracker = OverflowTracker(watch_eval=watch_eval)
    accelerator, model, optimizer, loader = make_run(tracker)
    batches = list(loader)
    run_micro_batches(accelerator, model, optimizer, batches[:3])
    model.eval()
    bad = batches[3][0].clone()
    bad[1, 2] = float("nan")
    if watch_eval:
        with torch.no_grad(), pytest.raises(NonFiniteError) as caught:
            model(bad)
        assert (caught.value.phase, caught.value.batch_number, caught.value.module_name) == ("eval", 0, "0")
        assert hooks_left(model, optimizer) == []
        return
    with torch.no_grad():
        model(bad)
        model(bad)
    model.train()
    x, y = batches[3]
    with accelerator.accumulate(model):
        model(x)
    assert tracker.batch_number == 3  # the eval forwards neither counted nor checked
    assert tracker.watcher is not None
    assert tracker.watcher.counters.eval_batch_number == 0
    tracker.detach()
    assert hooks_left(model, optimizer) == []


def test_end_training_removes_the_hooks_and_counters_survive_a_resume(tmp_path: Path) -> None:
    tracker = OverflowTracker()
    accelerator, model, optimizer, loader = make_run(tracker)
    accelerator.register_for_checkpointing(tracker)
    accelerator.init_trackers("nanwatch-test")  # end_training() calls finish() on the trackers it initialised
    batches = list(loader)
    run_micro_batches(accelerator, model, optimizer, batches[:4])
    tracker.set_epoch(7)
    accelerator.save_state(tmp_path / "checkpoint")
    accelerator.end_training()
    assert hooks_left(model, optimizer) == []

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed = OverflowTracker()
    accelerator, model, optimizer, _ = make_run(resumed)
    accelerator.register_for_checkpointing(resumed)
    accelerator.load_state(tmp_path / "checkpoint")
    x, y = batches[4]
    x = x.clone()
    x[1, 3] = float("nan")
    resumed_batches = [(x, y), batches[5]]
    # Micro-batch 4 opens a window, so it is checked as micro-batch 5's forward begins.
    with pytest.raises(NonFiniteError) as caught:
        run_micro_batches(accelerator, model, optimizer, resumed_batches)
    # The fifth micro-batch of the whole run, even though this process saw only one.
    assert (caught.value.batch_number, caught.value.optimizer_step, caught.value.epoch) == (4, 2, 7)
    assert hooks_left(model, optimizer) == []


def test_bad_config_and_double_attach_are_refused() -> None:
    with pytest.raises(ValueError, match="max_frames_to_save"):
        OverflowTracker(max_frames_to_save=0)
    tracker = OverflowTracker()
    accelerator, model, optimizer, _ = make_run(tracker)
    with pytest.raises(RuntimeError, match="already attached"):
        tracker.attach(accelerator, model)
    tracker.detach()
    assert hooks_left(model, optimizer) == []


@pytest.mark.slow
def test_accelerate_is_imported_only_by_the_adapter_and_its_absence_names_the_extra() -> None:
    code = (
        "import sys\n"
        "import nanwatch, nanwatch.adapters\n"
        "print('accelerate' in sys.modules)\n"
        "sys.modules['accelerate'] = None  # as if it were not installed\n"
        "from nanwatch.adapters.accelerate import OverflowTracker\n"
        "try:\n"
        "    OverflowTracker()\n"
        "except ImportError as error:\n"
        "    assert isinstance(error.__cause__, ImportError), error.__cause__\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    imported, message = done.stdout.splitlines()
    assert imported == "False"
    assert message == (
        'OverflowTracker needs the "accelerate" package; install it with: pip install "nanwatch[accelerate]"'
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.multiprocess
def test_two_ranks_stop_together_and_rank_one_reports(tmp_path: Path) -> None:
    reports, markers = tmp_path / "reports", tmp_path / "markers"
    markers.mkdir()
    # `accelerate launch --cpu` starts several processes only through mpirun; torchrun is what it uses otherwise.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(SCRIPTS / "accelerate_two_ranks.py"),
        str(reports),
        str(markers),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    finished = time.time()
    assert done.returncode != 0, done.stdout + done.stderr

    caught = [json.loads((markers / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for process, seen in enumerate(caught):
        assert (seen["process"], seen["rank"], seen["batch_number"]) == (process, 1, 3), seen
        assert seen["optimizer_step"] == 1  # micro-batches 2 and 3 make step 1; it never ran
        assert seen["hooks_left"] is False
    detected = min(seen["time"] for seen in caught)
    assert finished - detected < 60

    assert sorted(p.name for p in reports.iterdir()) == [
        "nanwatch-report-rank1-batch3.json",
        "nanwatch-report-rank1-batch3.jsonl",
        "nanwatch-report-rank1-batch3.txt",
    ]
    text = (reports / "nanwatch-report-rank1-batch3.txt").read_text()
    assert text.startswith("Detected inf/nan during batch_number=3 on rank 1\n")
    data = json.loads((reports / "nanwatch-report-rank1-batch3.json").read_text())
    assert (data["rank"], data["batch_number"]) == (1, 3)


@pytest.mark.slow
def test_example_overflows_and_reports(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "accelerate_loop.py"), "--report-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "first in module 'loss_fn'; weights still finite: True" in done.stdout
    (report,) = tmp_path.glob("nanwatch-report-rank0-batch*.txt")
    batch = int(report.stem.rsplit("batch", 1)[1])
    assert f"stopped: inf/nan in batch_number={batch} " in done.stdout
    text = report.read_text()
    assert text.startswith(f"Detected inf/nan during batch_number={batch}\n")
    # The frames end at the loss's inf output; after a blank line, the culprit: the loss made it from finite inputs.
    frames, trailing = text.rstrip().split("\n\n")
    assert frames.endswith("inf      inf output")
    # After a blank line: the cause (the example overflows float16's range), the capsule written for it, then the
    # culprit.
    cause, capsule, culprit = trailing.splitlines()[:3]
    assert cause.startswith("cause: precision: "), cause
    assert "float16's range overflowed" in cause
    assert capsule.startswith("repro capsule: "), capsule
    assert culprit.startswith("first non-finite value produced by loss_fn (MSELoss): inputs finite (abs max ")
    assert text.rstrip("\n") in done.stderr  # the same report was logged


def test_an_optimizer_accelerate_did_not_prepare_is_warned_about_once() -> None:
    # No optimizer was prepared (nor passed to attach): its steps run unguarded, which nanwatch says, once.
    tracker = OverflowTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    model = small_mlp(scale=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = accelerator.prepare(model)
    tracker.attach(accelerator, model)
    batches = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(3)]

    def loop() -> None:
        for x, y in batches:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    with pytest.warns(NanwatchWarning) as record:
        loop()
    tracker.detach()
    messages = [str(warning.message) for warning in record if warning.category is NanwatchWarning]
    assert len(messages) == 1, messages
    assert "this SGD steps the watched model's weights unguarded" in messages[0]
    assert "optimizers=optimizer" in messages[0]


def test_a_prepared_optimizer_is_guarded_and_not_warned_about() -> None:
    tracker = OverflowTracker()
    accelerator, model, optimizer, loader = make_run(tracker)
    run_micro_batches(accelerator, model, optimizer, [batch for batch, _ in zip(loader, range(4), strict=False)])
    tracker.detach()  # pyproject turns a NanwatchWarning into an error: none came
