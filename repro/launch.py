"""Command lines, built by pure functions so they can be printed (--dry-run) and tested."""
from __future__ import annotations

import sys
from pathlib import Path

LOOP_MODULE = "repro.loop"


def torchrun_local(processes: int, run_dir: Path, python: str = sys.executable) -> list[str]:
    """PyTorch's own launcher on this machine: `processes` workers, rendezvous on a free local port."""
    return [
        python, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes), "--max-restarts", "0",
        "-m", LOOP_MODULE, str(run_dir),
    ]


def lbann_srun(nodes: int, gpus: int, lbann: str, prototext: Path) -> list[str]:
    """LBANN under SLURM, one rank per GPU spread evenly over the nodes (as LBANN's launcher does)."""
    return [
        "srun", f"--nodes={nodes}", f"--ntasks={gpus}", f"--ntasks-per-node={gpus // nodes}",
        lbann, f"--prototext={prototext}",
    ]


def lbann_mpirun(nodes: int, gpus: int, lbann: str, prototext: Path) -> list[str]:
    """LBANN under a plain (Open MPI) launcher: one rank per GPU, `gpus // nodes` per node; LBANN
    binds each rank to its GPU itself, so MPI binds nothing."""
    return [
        "mpirun", "-np", str(gpus), "--map-by", f"ppr:{gpus // nodes}:node", "--bind-to", "none",
        lbann, f"--prototext={prototext}",
    ]


LBANN_LAUNCHERS = {"slurm": lbann_srun, "mpirun": lbann_mpirun}


def lbann_launcher(choice: str, environ: dict[str, str]) -> str:
    """'auto' means srun inside a SLURM allocation, else mpirun."""
    if choice != "auto":
        return choice
    return "slurm" if "SLURM_JOB_ID" in environ else "mpirun"
