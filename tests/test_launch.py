"""Launch commands and SLURM batch scripts: pure functions, checked against recorded golden files."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from repro import launch

pytestmark = pytest.mark.units

GOLDEN = Path(__file__).parent / "golden"
JOB = launch.SlurmJob(
    name="gpt2-zero-8g-paper-s1234", nodes=2, gpus_per_node=4, processes_per_node=4,
    run_dir=Path("/scratch/repro/runs/gpt2-zero-8g-paper-s1234-20260101T000000000000"),
    data_root=Path("/scratch/repro/data"), tracking_uri="http://mlflow.cluster:5000",
    python="/opt/repro/.venv/bin/python", image="/scratch/images/repro.sif", time="04:00:00", partition="gpu",
)
# a cluster without GPU GRES: no GPU directive, a core for each process standing in for a GPU
CPU = launch.SlurmJob(**{**JOB.__dict__, "gpus_per_node": 0, "image": None, "time": None, "partition": None})


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/NAME; REPRO_UPDATE_GOLDEN=1 records the file instead."""
    path = GOLDEN / name
    if os.environ.get("REPRO_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("name, job", [("sbatch-2node-apptainer.sh", JOB), ("sbatch-2node-cpu.sh", CPU)])
def test_sbatch_script_matches_golden(name, job):
    check_golden(name, launch.sbatch_script(job))


def test_sbatch_script_is_valid_bash_and_derives_the_documented_port():
    script = launch.sbatch_script(JOB)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    port_line = next(line for line in script.splitlines() if line.startswith("rdzv_port="))
    port = subprocess.run(["bash", "-c", f"SLURM_JOB_ID=4242421; {port_line}; echo $rdzv_port"],
                          capture_output=True, text=True).stdout.strip()
    assert int(port) == launch.rendezvous_port(4242421) == 22421


def test_sbatch_script_runs_offline_in_the_image():
    script = launch.sbatch_script(JOB)
    for name in launch.OFFLINE_VARIABLES:
        assert f"export {name}=1" in script
    assert "export REPRO_DATA=/scratch/repro/data" in script
    assert "apptainer exec --nv" in script and "srun --nodes=2 --ntasks-per-node=1" in script
    assert "--rdzv-backend c10d" in script and '--rdzv-endpoint "$head_addr:$rdzv_port"' in script
    assert "apptainer" not in launch.sbatch_script(CPU)


@pytest.mark.parametrize("limit, seconds", [
    ("30", 1800), ("2:30", 150), ("04:00:00", 14400), ("1-0", 86400), ("1-2:03", 93780), ("1-2:03:04", 93784),
])
def test_slurm_time_limits_are_read_in_all_of_sbatchs_forms(limit, seconds):
    assert launch.time_limit_s(limit) == seconds


def test_the_stop_warning_is_two_minutes_or_half_a_short_limit():
    assert [launch.stop_warning_s(t) for t in (None, "04:00:00", "4", "3", "1")] == [120, 120, 120, 90, 30]
    with pytest.raises(ValueError, match="not a Slurm time limit"):
        launch.time_limit_s("4h")


def test_a_wrong_time_limit_is_refused_before_anything_starts(repro):
    out = repro.here("run", "gpt2", "--gpus", "2", "--nodes", "2", "--launcher", "slurm", "--time", "4h", "--dry-run")
    assert out.returncode == 2 and "repro: --time: '4h' is not a Slurm time limit" in out.stderr


def test_torchrun_node_joins_the_c10d_rendezvous():
    command = launch.torchrun_node(2, 4, "node0:29400", "job7", Path("/runs/x"), python="python")
    assert command == [
        "python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7", "--signals-to-handle", launch.TORCHRUN_SIGNALS,
        "--max-restarts", "0", "--tee", "3",
        "--log-dir", "/runs/x/ranks", "-m", "repro.loop", "/runs/x",
    ]


def test_cli_dry_run_prints_the_batch_script(repro):
    out = repro.here("run", "gpt2", "--gpus", "4", "--nodes", "2", "--launcher", "slurm", "--image", "repro.sif",
                "--time", "01:00:00", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=gpt2-ddp-4g-smoke-s1234\n#SBATCH --nodes=2\n")
    assert "#SBATCH --gpus-per-node=2" in out.stdout and "--nproc-per-node 2" in out.stdout
    assert "#SBATCH --time=01:00:00" in out.stdout
    assert not (repro.cwd / "runs").exists()


def test_no_sbatch_on_path_is_refused_before_anything_starts(repro):
    repro.env["PATH"] = str(repro.cwd)  # no Slurm client here
    out = repro.here("run", "gpt2", "--gpus", "2", "--nodes", "2", "--launcher", "slurm")
    assert out.returncode == 2 and "repro: --launcher slurm: no sbatch on PATH" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (repro.cwd / "runs").exists() and not (repro.cwd / "mlflow.db").exists()
