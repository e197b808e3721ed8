"""`nanwatch doctor` with real processes on the CPU (gloo): through its own launcher, through torchrun, and with a rank
that never arrives, which must be named, with a non-zero exit, within a bounded time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanwatch.cli import build_parser, main
from nanwatch.cli.doctor import SIMULATE_ABSENT_RANK_ENV, SUMMARY_STEM, _compact, find_free_port, torchrun_command

pytestmark = pytest.mark.multiprocess

OK_LINE = re.compile(
    r"^\[(?P<host>[^\]:]+):(?P<rank>\d+)/(?P<world>\d+)\] OK \(gloo, cpu, all_reduce \d+\.\d\d ms\)$", re.M
)
# Generous: two CPU cores shared with other tests; the point is that it ends at all, and not after torch's 10-minute
# default.
BOUND_S = 90


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"}}
    env.pop("MASTER_PORT", None)
    env.pop(SIMULATE_ABSENT_RANK_ENV, None)
    env.update(extra)
    return env


def _run(command: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=BOUND_S, check=False)
    return result, time.monotonic() - start


def _assert_all_ok(result: subprocess.CompletedProcess[str], world: int) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = sorted(int(m["rank"]) for m in OK_LINE.finditer(result.stdout))
    assert ranks == list(range(world)), result.stdout
    assert all(int(m["world"]) == world for m in OK_LINE.finditer(result.stdout))
    assert f"nanwatch doctor: all {world} ranks OK on 1 host (backend gloo" in result.stdout
    assert "ranks 0-1 on cpu" in result.stdout


@pytest.mark.timeout(BOUND_S + 30)  # in-process: the launcher's own bound on torchrun is longer than this test's
def test_doctor_launches_torchrun_itself(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # `nanwatch doctor --nproc 2`, run through the same entry point as the console script; torchrun and both ranks
    # are real processes writing to this process's stdout and stderr. The config file's report_dir is overridden on
    # the line (file < options): the ranks check that directory and rank 0 writes the summary there.
    config = tmp_path / "watch.yaml"
    config.write_text(f"report_dir: {tmp_path / 'from-file'}\nmax_frames_to_save: 50\n", encoding="utf-8")
    reports = tmp_path / "from-line" / "doctor"  # created by the check, as a watched run would
    stale = tmp_path / "from-line" / "doctor" / f"{SUMMARY_STEM}-rank0.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"ok": false}', encoding="utf-8")  # from an earlier, failed check: must not survive this one
    start = time.monotonic()
    argv = ["doctor", "--nproc", "2", "--master-port", str(find_free_port()), "--timeout", "30"]
    status = main([*argv, "--config", str(config), "--report-dir", str(reports)])
    stdout, stderr = capfd.readouterr()
    assert time.monotonic() - start < BOUND_S
    _assert_all_ok(subprocess.CompletedProcess([], status, stdout, stderr), world=2)
    # stderr: the command it ran, and where torchrun's own output went; nothing else.
    log = reports / f"{SUMMARY_STEM}-torchrun.log"
    assert stderr.splitlines()[1:] == [f"nanwatch doctor: torchrun's own output goes to {log}"]
    assert "-m torch.distributed.run --nproc_per_node=2" in stderr.splitlines()[0]
    assert f"-m nanwatch doctor --timeout 30 --backend auto --alloc-mb 64 --report-dir {reports}" in stderr
    assert not (tmp_path / "from-file").exists()
    assert sorted(path.name for path in reports.iterdir()) == [
        f"{SUMMARY_STEM}-torchrun.log",
        f"{SUMMARY_STEM}.json",
        f"{SUMMARY_STEM}.txt",
    ]
    summary = (reports / f"{SUMMARY_STEM}.txt").read_text()
    assert summary.startswith("nanwatch doctor: all 2 ranks OK on 1 host (backend gloo")
    # stdout is the verdict alone: each rank's line in rank order, then the summary (the file holds the same).
    lines = stdout.splitlines()
    assert [int(m["rank"]) for m in map(OK_LINE.match, lines[:2]) if m] == [0, 1]
    assert "\n".join(lines[2:]) + "\n" == summary
    assert OK_LINE.search(log.read_text())  # the ranks' own output is in the log
    data = json.loads((reports / f"{SUMMARY_STEM}.json").read_text())
    assert (data["ok"], data["world_size"], data["backend"]) == (True, 2, "gloo")
    assert [rank["rank"] for rank in data["ranks"]] == [0, 1]
    assert all(rank["all_reduce_ms"] > 0 for rank in data["ranks"])


def test_doctor_under_torchrun_with_debug() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(find_free_port()), "-m", "nanwatch", "doctor", "--timeout", "30", "--debug"]
    result, _ = _run(command, _clean_env())
    _assert_all_ok(result, world=2)
    # TORCH_DISTRIBUTED_DEBUG=DETAIL took effect on the ranks: its wrapper logs each collective's fingerprint.
    assert "Running collective: CollectiveFingerPrint" in result.stderr


def test_a_rank_that_never_starts_is_named(tmp_path: Path) -> None:
    # One real process told that the world has two: rank 1 is never started, so it never reaches the rendezvous.
    # The config file's report_dir keeps the diagnosis on disk.
    env = _clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(find_free_port())
    config = tmp_path / "watch.json"
    config.write_text(json.dumps({"report_dir": str(tmp_path / "reports")}), encoding="utf-8")
    command = [sys.executable, "-m", "nanwatch", "doctor", "--timeout", "2", "--config", str(config)]
    result, elapsed = _run(command, env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ":0/2] FAIL (rendezvous): rank 1 never arrived within 2 s (1 of 2 arrived: rank 0 on" in result.stderr
    assert "OK" not in result.stdout
    assert elapsed < 2 + 30
    failure = json.loads((tmp_path / "reports" / f"{SUMMARY_STEM}-rank0.json").read_text())
    assert (failure["ok"], failure["rank"], failure["world_size"]) == (False, 0, 2)
    assert failure["diagnosis"].startswith("(rendezvous): rank 1 never arrived within 2 s")
    text = (tmp_path / "reports" / f"{SUMMARY_STEM}-rank0.txt").read_text()
    assert text.strip() in result.stderr  # the file holds the FAIL line the rank printed
    assert not (tmp_path / "reports" / f"{SUMMARY_STEM}.json").exists()  # no summary: the check did not pass


def test_a_report_dir_a_rank_cannot_write_fails_the_check(tmp_path: Path) -> None:
    # A world of one, no torchrun: the rank serves its own rendezvous, passes every stage, then cannot create
    # report_dir (a file stands where its parent should be), so a watched run would lose its reports there.
    (tmp_path / "a-file").write_text("", encoding="utf-8")
    env = _clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(find_free_port())
    report_dir = tmp_path / "a-file" / "x"
    command = [sys.executable, "-m", "nanwatch", "doctor", "--timeout", "10", "--report-dir", str(report_dir)]
    result, _ = _run(command, env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f":0/1] FAIL (report_dir): cannot write to report_dir {str(report_dir)!r}: " in result.stderr
    assert "a watched run with this config would lose its reports on this rank" in result.stderr
    assert not OK_LINE.search(result.stdout)


def test_a_typo_in_the_config_file_stops_doctor_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "watch.yaml"
    config.write_text("report_dirr: /tmp/x\n", encoding="utf-8")
    assert main(["doctor", "--nproc", "2", "--config", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "unknown field 'report_dirr' (did you mean 'report_dir'?" in err
    assert len(err.splitlines()) == 1  # torchrun was never started
    help_text = " ".join(build_parser().parse_args(["doctor"]).parser.format_help().split())
    assert "WatchConfig fields used by doctor" in help_text
    assert "report_dir: every rank checks that it can create and write this directory" in help_text
    assert "The other WatchConfig fields are accepted and ignored by doctor" in help_text
    assert "--max-frames-to-save" not in help_text


def test_a_rank_that_joins_but_never_reaches_the_barrier_is_named(tmp_path: Path) -> None:
    # Through doctor's own launcher: both ranks start and join the process group; rank 1 then stays away, and rank
    # 0's monitored barrier names it. torchrun's traceback and banners go to the log; the verdict is on stdout, last.
    command = [sys.executable, "-m", "nanwatch", "doctor", "--nproc", "2", "--master-port", str(find_free_port())]
    command += ["--timeout", "2", "--report-dir", str(tmp_path)]
    result, elapsed = _run(command, _clean_env(**{SIMULATE_ABSENT_RANK_ENV: "1"}))
    assert result.returncode == 1
    assert elapsed < 2 + 40
    lines = result.stdout.splitlines()
    assert re.fullmatch(
        r"\[[^\]]+:0/2\] FAIL \(barrier\): rank 1 joined the process group but did not reach the barrier within 2 s: "
        r"stuck or crashed after start-up",
        lines[0],
    ), result.stdout
    log = tmp_path / f"{SUMMARY_STEM}-torchrun.log"
    assert re.fullmatch(
        r"nanwatch doctor: FAILED \(torchrun exit status \d+\)(; rank 1 ended with no verdict \(crashed\?\))?; "
        rf"the FAIL lines name the rank and stage, torchrun's own output is in {re.escape(str(log))}",
        lines[-1],
    ), result.stdout
    assert not OK_LINE.search(result.stdout)
    assert "Traceback" not in result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 2  # the command it ran, and where torchrun's output went
    assert "FAIL (barrier)" in log.read_text()  # what the ranks printed is in the log too


def test_launcher_validates_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--nnodes", "2", "--node-rank", "2"]) == 2
    assert capsys.readouterr().err == (
        "nanwatch doctor: --node-rank must be below --nnodes=2, got 2; see nanwatch doctor --help\n"
    )
    assert main(["doctor", "--timeout", "0"]) == 2
    assert "argument --timeout: must be a positive, finite number, got '0'" in capsys.readouterr().err
    assert main(["doctor", "--nproc", "two"]) == 2
    assert "argument --nproc: expected an integer, got 'two'" in capsys.readouterr().err


def test_torchrun_command_bounds_the_multi_node_rendezvous() -> None:
    single = torchrun_command(nproc=4, nnodes=1, node_rank=0, master_addr="h", master_port=1234, timeout=60)
    assert single[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc_per_node=4" in single
    assert "--master_port=1234" in single
    assert not any(arg.startswith("--rdzv_conf") for arg in single)
    assert single[-3:] == ["-m", "nanwatch", "doctor"]
    multi = torchrun_command(
        nproc=8, nnodes=2, node_rank=1, master_addr="h", master_port=1, timeout=12.5, doctor_args=["--debug"]
    )
    assert "--rdzv_conf=timeout=13" in multi
    assert "--node_rank=1" in multi
    assert multi[-4:] == ["-m", "nanwatch", "doctor", "--debug"]


def test_rank_lists_are_compacted() -> None:
    assert _compact([5, 0, 1, 2, 8, 7]) == "0-2, 5, 7-8"
    assert _compact([3]) == "3"
