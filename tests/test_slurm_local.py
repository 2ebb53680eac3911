"""The generated batch script, run for real on this machine: sbatch, srun and scontrol are stood in for
by small shell scripts (one "node" per srun task, all on 127.0.0.1), everything else is the real job."""
from __future__ import annotations

import random
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import mlflow_runs, read_events
from repro import launch

SHIMS = {
    # records the submission and answers like `sbatch --parsable`
    "sbatch": 'echo "$@" > "$(dirname "$0")/submitted"; echo "$FAKE_SLURM_JOB_ID"',
    # `scontrol show hostnames LIST`: every node is this machine
    "scontrol": "echo 127.0.0.1",
    # srun --nodes=N [options] COMMAND: N tasks at once, one per "node"; fails if any task fails
    "srun": """nodes=1
while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
pids=()
for ((node = 0; node < nodes; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status""",
}


def job_id_with_a_free_port() -> int:
    """A job id whose derived rendezvous port is free here."""
    while True:
        port = random.randrange(launch.RDZV_BASE_PORT, launch.RDZV_BASE_PORT + launch.RDZV_PORT_SPAN)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 7 * launch.RDZV_PORT_SPAN + port - launch.RDZV_BASE_PORT


@pytest.mark.slow
def test_the_batch_script_runs_a_two_node_job_recorded_once(repro):
    shims = repro.cwd / "shims"
    shims.mkdir()
    for name, body in SHIMS.items():
        (shims / name).write_text(f"#!/bin/bash\n{body}\n")
        (shims / name).chmod(0o755)
    job_id = job_id_with_a_free_port()
    repro.env.update(PATH=f"{shims}:{repro.env['PATH']}", FAKE_SLURM_JOB_ID=str(job_id))

    out = repro("run", "gpt2", "--gpus", "2", "--nodes", "2", "--launcher", "slurm", "--max-steps", "4",
                "--set", "data.max_train_samples=128", "--set", "data.max_val_samples=32")
    assert out.returncode == 0, out.stderr
    (run_dir,) = (repro.cwd / "runs").iterdir()
    assert f"submitted SLURM job {job_id}" in out.stdout
    assert (shims / "submitted").read_text().split() == ["--parsable", str(run_dir / "job.sbatch")]
    (queued,) = mlflow_runs(repro.tracking_uri)
    assert queued.info.status == "RUNNING" and queued.data.tags["repro.slurm_job_id"] == str(job_id)

    env = {**repro.env, "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "node[1-2]"}
    batch = subprocess.run(["bash", str(run_dir / "job.sbatch")], cwd=repro.cwd, env=env,
                           capture_output=True, text=True, timeout=300)
    assert batch.returncode == 0, batch.stdout[-3000:] + batch.stderr[-3000:]
    (run,) = mlflow_runs(repro.tracking_uri)
    assert run.info.run_id == queued.info.run_id and run.info.status == "FINISHED"
    events = read_events(run_dir)
    assert [e["world"] for e in events if e["event"] == "start"] == [2]
    assert len([e for e in events if e["event"] == "step"]) == 4
    assert len(list((run_dir / "ranks").glob(f"{job_id}_*"))) == 2  # one torchrun per node
