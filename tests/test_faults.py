"""Fault handling: a rank that dies ends the whole job within 60 s, leaves no process behind, fails the
MLflow run naming the rank, and keeps the last good checkpoint; Ctrl-C or SIGUSR1 saves and ends the run KILLED."""
from __future__ import annotations

import json
import signal
import sys
import time

import psutil
import pytest
import torch

from conftest import mlflow_runs, rank_of, read_events, wait_for_event

# 64 steps an epoch: the second epoch is long enough to be interrupted in its middle
RUN = ("run", "gpt2", "--gpus", "2", "--epochs", "2", "--set", "data.max_val_samples=32", "--run-dir", "runs/job")
STEPS_PER_EPOCH = 1024 // 16


def job_processes(job) -> list[psutil.Process]:
    return psutil.Process(job.pid).children(recursive=True)


def interrupt_mid_second_epoch(repro, job) -> list[psutil.Process]:
    """Wait until the first epoch is checkpointed and the second is under way; return the job's processes."""
    wait_for_event(repro.cwd / "runs", "checkpoint", job, step=STEPS_PER_EPOCH)
    wait_for_event(repro.cwd / "runs", "step", job, step=STEPS_PER_EPOCH + 2)
    return job_processes(job)


def assert_nothing_left(processes: list[psutil.Process]) -> None:
    """When `repro run` has returned, not one of its job's processes is left: none running, none a zombie
    (the warm launcher's fork server and resource tracker included)."""
    left = [(p.pid, p.status(), p.name()) for p in processes if p.is_running()]
    assert not left, left


@pytest.mark.end_to_end
def test_a_rank_killed_mid_epoch_fails_the_run_within_60_s(repro):
    job = repro.start(*RUN)
    processes = interrupt_mid_second_epoch(repro, job)
    (victim,) = [p for p in processes if rank_of(p, repro.cwd / "runs" / "job") == "1"]
    victim.kill()
    assert job.wait(timeout=60) != 0  # the whole job ends within 60 s of the death of one rank
    assert_nothing_left(processes)

    (run,) = mlflow_runs(repro.tracking_uri)
    assert run.info.status == "FAILED"
    assert run.data.tags["repro.failed_rank"] == "1"
    assert run.data.tags["repro.error"].startswith("rank 1 (local rank 1) failed with exit code -9")

    run_dir = repro.cwd / "runs" / "job"
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["position"]["step"] == STEPS_PER_EPOCH and pointer["position"]["epoch"] == 1
    state = torch.load(run_dir / "checkpoints" / pointer["folder"] / "adapter.pt")
    assert state["model"] and all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.end_to_end
@pytest.mark.parametrize("signum, ranks_got", [(signal.SIGINT, "SIGTERM"), (signal.SIGUSR1, "SIGUSR1")])
def test_a_stop_signal_saves_mid_epoch_and_ends_the_run_killed(repro, signum, ranks_got):
    """Ctrl-C (forwarded to torchrun as SIGTERM) and SIGUSR1 (SLURM's warning before the time limit, or
    `kill -USR1`; torchrun's own --signals-to-handle default lacks it, the kit passes it) reach the
    ranks, which save where they are and stop."""
    job = repro.start(*RUN)
    processes = interrupt_mid_second_epoch(repro, job)
    job.send_signal(signum)
    assert job.wait(timeout=60) != 0
    assert_nothing_left(processes)
    (run,) = mlflow_runs(repro.tracking_uri)
    assert run.info.status == "KILLED" and run.data.tags["repro.error"] == f"stopped by {signum.name}"
    run_dir = repro.cwd / "runs" / "job"
    (interrupted,) = [e for e in read_events(run_dir) if e["event"] == "interrupted"]
    assert interrupted["signal"] == ranks_got and STEPS_PER_EPOCH < interrupted["step"] < 2 * STEPS_PER_EPOCH
    assert run.data.tags["repro.interrupted"].startswith(f"{ranks_got} at step {interrupted['step']}")
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["position"]["step"] == interrupted["step"]


@pytest.mark.units
def test_the_follower_wakes_when_the_launcher_exits_and_kills_what_it_left(tmp_path):
    """The follower waits on the launcher's exit, not on a poll interval: a 30 s wait ends when the
    launcher does. torchrun starts its workers in sessions of their own: one that outlives the launcher
    is found by the follower's scans of the job's processes (every SCAN_EVERY_S) and killed."""
    from repro.run.supervision import POLL_S, SCAN_EVERY_S, Job

    quick = Job(["sleep", "1"], tmp_path / "quick.log", echo=lambda line: None)
    started = time.monotonic()
    quick.wait(30)
    assert quick.finished() and quick.returncode == 0 and time.monotonic() - started < 15

    launcher = ("import subprocess, sys, time; worker = subprocess.Popen(['sleep', '300'], start_new_session=True); "
                f"print(worker.pid, flush=True); time.sleep({2 * SCAN_EVERY_S}); sys.exit(3)")
    job = Job([sys.executable, "-c", launcher], tmp_path / "output.log", echo=lambda line: None)
    while not job.finished():  # as the follower's loop does
        job.wait(POLL_S)
    assert job.returncode == 3
    worker = psutil.Process(int((tmp_path / "output.log").read_text().split()[0]))
    worker.wait(timeout=5)  # raises TimeoutExpired while the follower has left it running
