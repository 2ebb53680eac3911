"""`repro run --launcher slurm` against a real Slurm cluster (slurmctld and two slurmd on this host,
tests/slurm_cluster.py), as a user would run it: the batch script, stops, time limits and failures."""
from __future__ import annotations

import json
import time

import psutil
import pytest

from conftest import mlflow_runs, read_events
from repro import names
from slurm_cluster import PROGRAMS

pytestmark = [pytest.mark.services, pytest.mark.programs(*PROGRAMS)]

TERMINAL = ("FINISHED", "FAILED", "KILLED")
SMALL = ("--set", "data.max_train_samples=128", "--set", "data.max_val_samples=32")


def submit(repro, slurm, *args: str):
    """`repro run gpt2 --gpus 2 --nodes 2 --launcher slurm ARGS` on the cluster: (job id, run folder)."""
    repro.env.update(slurm.env)
    out = repro("run", "gpt2", "--framework", "ddp", "--gpus", "2", "--nodes", "2", "--launcher", "slurm", *args)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split("submitted SLURM job ")[1].split(";")[0]
    run_dir = sorted((repro.cwd / "runs").iterdir())[-1]
    return job_id, run_dir


def wait_for_run(repro, statuses=TERMINAL, timeout: float = 240):
    """The only MLflow run, once its status is one of `statuses`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (run,) = mlflow_runs(repro.tracking_uri)
        if run.info.status in statuses:
            return run
        time.sleep(0.5)
    raise TimeoutError(f"run still {run.info.status} after {timeout} s")


def job_state(slurm, job_id: str) -> str:
    """Slurm's state of the job (squeue keeps ended jobs MinJobAge seconds: the cluster has no accounting)."""
    return slurm.client("squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T").stdout.strip()


def wait_for_job_end(slurm, job_id: str, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while (state := job_state(slurm, job_id)) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s"
        time.sleep(0.5)
    return state


def wait_for_step(run_dir, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["event"] == "step" and e["step"] >= step for e in read_events(run_dir)):
        assert time.monotonic() < deadline, f"no step {step} in {run_dir} after {timeout} s"
        time.sleep(0.2)


def logged_steps(repro, run) -> list[int]:
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri=repro.tracking_uri).get_metric_history(run.info.run_id, names.TRAIN_LOSS)
    return sorted(m.step for m in history)


def test_a_two_node_job_finishes_recorded_once(repro, slurm):
    job_id, run_dir = submit(repro, slurm, "--max-steps", "4", *SMALL)
    script = (run_dir / "job.sbatch").read_text()
    assert "--gpus-per-node" not in script and "#SBATCH --cpus-per-task=1" in script  # a CPU cluster
    run = wait_for_run(repro)
    assert run.info.status == "FINISHED", run.data.tags.get("repro.error")
    assert run.data.tags["repro.slurm_job_ids"] == job_id == run.data.tags["repro.slurm_job_id"]
    assert json.loads((run_dir / "run.json").read_text())["slurm_job_ids"] == [job_id]
    events = read_events(run_dir)
    assert [e["world"] for e in events if e["event"] == "start"] == [2]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]
    assert len(list((run_dir / "ranks").glob(f"{job_id}_*"))) == 2  # one torchrun per node



@pytest.mark.parametrize("slurm", ["gpu"], indirect=True)
def test_the_gpu_form_is_accepted_by_nodes_with_gpu_gres(repro, slurm):
    """Nodes declaring fake GPUs (gres.conf, devices made with mknod): the script asks a GPU per process."""
    job_id, run_dir = submit(repro, slurm, "--max-steps", "2", *SMALL)
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=1" in script and "--cpus-per-task" not in script
    run = wait_for_run(repro)  # no CUDA behind the fake devices: the ranks train on CPU
    assert run.info.status == "FINISHED", run.data.tags.get("repro.error")
    assert [e["step"] for e in read_events(run_dir) if e["event"] == "step"] == [1, 2]


STEPS = 1024 // 16  # one epoch of the smoke recipe on 2 processes


def test_scancel_of_a_running_job_keeps_a_mid_epoch_checkpoint_and_resume_finishes_the_same_run(repro, slurm):
    first, run_dir = submit(repro, slurm, "--epochs", "1", "--set", "data.max_val_samples=32")
    wait_for_step(run_dir, 5)
    assert slurm.client("scancel", first).returncode == 0
    assert wait_for_job_end(slurm, first) == "CANCELLED"
    # the follower, in the batch step, is killed KillWait (30 s) after the scancel: it records the end
    # before, and a follower too slow for that (a loaded machine) leaves its outcome to `repro settle`
    assert "ended KILLED" in settle(repro, run_dir)
    killed = wait_for_run(repro, timeout=1)
    assert killed.info.status == "KILLED" and killed.data.tags["repro.error"].startswith("stopped by SIGTERM")
    (interrupted,) = [e for e in read_events(run_dir) if e["event"] == "interrupted"]
    assert interrupted["signal"] == "SIGTERM" and 5 <= interrupted["step"] < STEPS  # in the middle of the epoch
    assert killed.data.tags["repro.interrupted"].startswith(f"SIGTERM at step {interrupted['step']}")
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["position"]["step"] == interrupted["step"]

    second, _ = submit(repro, slurm, "--epochs", "1", "--set", "data.max_val_samples=32", "--resume", str(run_dir))
    run = wait_for_run(repro, ("FINISHED", "FAILED"))
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    assert logged_steps(repro, run) == list(range(1, STEPS + 1))  # every step once
    assert run.data.tags["repro.slurm_job_ids"] == f"{first},{second}"
    assert not {"repro.error", "repro.interrupted"} & set(run.data.tags)
    assert run.data.tags["repro.resumed_from_step"] == str(interrupted["step"])


def test_the_time_limit_warning_saves_every_rank_and_ends_the_run_killed_by_sigusr1(repro, slurm):
    job_id, run_dir = submit(repro, slurm, "--time", "10", "--epochs", "50", "--set", "data.max_val_samples=32")
    assert "#SBATCH --signal=USR1@120" in (run_dir / "job.sbatch").read_text()
    wait_for_step(run_dir, 3)
    # the limit now ends in 1 to 2 minutes: inside the warning, so slurmctld's next check sends SIGUSR1
    # (how long a loaded machine takes to start the ranks no longer decides whether it comes in time)
    elapsed = slurm.client("squeue", "--noheader", f"--jobs={job_id}", "--format=%M").stdout.strip()
    minutes = sum(int(part) * 60 ** i for i, part in enumerate(reversed(elapsed.split(":")))) // 60 + 2
    assert slurm.client("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}").returncode == 0
    run = wait_for_run(repro, timeout=150)
    assert run.info.status == "KILLED", run.data.tags.get("repro.error")
    assert run.data.tags["repro.error"] == "stopped by SIGUSR1"
    (interrupted,) = [e for e in read_events(run_dir) if e["event"] == "interrupted"]
    assert run.data.tags["repro.interrupted"].startswith(f"SIGUSR1 at step {interrupted['step']}")
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["position"]["step"] == interrupted["step"]
    assert wait_for_job_end(slurm, job_id) in ("FAILED", "COMPLETED")  # it ended before its time limit


def test_a_rank_killed_on_the_second_node_fails_the_run_within_60_s_naming_it(repro, slurm):
    job_id, run_dir = submit(repro, slurm, "--epochs", "1", "--set", "data.max_val_samples=32")
    wait_for_step(run_dir, 3)
    ranks = [p for p in psutil.process_iter(["cmdline"]) if "repro.loop" in (p.info["cmdline"] or [])
             and str(run_dir) in p.info["cmdline"] and "torch.distributed.run" not in p.info["cmdline"]]
    (victim,) = [p for p in ranks if p.environ().get("SLURM_NODEID") == "1"]
    rank = victim.environ()["RANK"]
    victim.kill()
    killed_at = time.monotonic()
    run = wait_for_run(repro, timeout=60)
    assert time.monotonic() - killed_at < 60
    assert run.info.status == "FAILED"
    assert run.data.tags["repro.failed_rank"] == rank
    error = run.data.tags["repro.error"]
    assert error.startswith(f"rank {rank} (local rank 0) failed with exit code -9\nRoot Cause"), error[:500]
    assert "frame #" not in error and len(error) < 5000
    assert wait_for_job_end(slurm, job_id) == "FAILED"


def settle(repro, run_dir) -> str:
    out = repro("settle", str(run_dir), "--stale-after", "0")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_pending_job_cancelled_waits_scheduled_then_is_settled(repro, slurm):
    blocker = slurm.client("sbatch", "--parsable", "--nodes=2", "--exclusive", "--wrap", "sleep 600").stdout.strip()
    try:
        job_id, run_dir = submit(repro, slurm, "--max-steps", "2", *SMALL)
        assert job_state(slurm, job_id) == "PENDING"
        assert wait_for_run(repro, ("SCHEDULED",), timeout=1).info.status == "SCHEDULED"
        assert f"Slurm job {job_id} is PENDING" in settle(repro, run_dir)  # a queued job is left waiting
        assert slurm.client("scancel", job_id).returncode == 0
        assert wait_for_job_end(slurm, job_id) == "CANCELLED"
        assert "ended FAILED" in settle(repro, run_dir)
    finally:
        slurm.client("scancel", blocker)
    (run,) = mlflow_runs(repro.tracking_uri)
    assert run.info.status == "FAILED"
    assert f"Slurm job {job_id} " in run.data.tags["repro.settled"]  # CANCELLED, or already forgotten by Slurm
    assert not read_events(run_dir)  # it never started


def test_a_job_held_by_a_down_partition_waits_and_an_inactive_one_refuses_it(repro, slurm):
    job_id, run_dir = submit(repro, slurm, "--partition", "down", "--max-steps", "2", *SMALL)
    reason = slurm.client("squeue", "--noheader", f"--jobs={job_id}", "--format=%T %r").stdout.split()
    assert reason == ["PENDING", "PartitionDown"]
    assert f"Slurm job {job_id} is PENDING" in settle(repro, run_dir)
    assert wait_for_run(repro, ("SCHEDULED",), timeout=1).info.status == "SCHEDULED"  # it waits, it does not run
    assert slurm.client("scancel", job_id).returncode == 0
    assert wait_for_job_end(slurm, job_id) == "CANCELLED"
    assert "ended FAILED" in settle(repro, run_dir)
    assert wait_for_run(repro, ("FAILED",), timeout=1).info.status == "FAILED"

    out = repro("run", "gpt2", "--gpus", "2", "--nodes", "2", "--launcher", "slurm", "--partition", "inactive",
                "--max-steps", "2", *SMALL)
    refusal = "Batch job submission failed: Required partition not available (inactive or drain)"
    assert out.returncode == 2 and refusal in out.stderr
    refused = [r for r in mlflow_runs(repro.tracking_uri) if refusal in r.data.tags.get("repro.error", "")]
    assert [r.info.status for r in refused] == ["FAILED"]
