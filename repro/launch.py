"""Command lines and job scripts, built by pure functions so they can be printed (--dry-run) and tested.

Every job runs PyTorch's own launcher (torchrun), one per node. On one machine it rendezvouses on
a free local port; across nodes the launchers join a c10d rendezvous hosted at the first node. On
SLURM, an sbatch script starts one srun task per node, each running torchrun (inside
`apptainer exec --nv` when an image is given), under a follower that feeds the job's events to
MLflow from the batch node. On a cluster without GPUs (no gpu GRES) the script asks for none and
each node's torchrun starts CPU processes standing in for them.
"""
from __future__ import annotations

import re
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from repro.runfiles import RANKS_DIR

LOOP_MODULE = "repro.loop"
RDZV_BASE_PORT = 20000
RDZV_PORT_SPAN = 20000
# torchrun forwards these to its workers before stopping them. Its default (--signals-to-handle,
# torch/distributed/run.py) lacks SIGUSR1, which would kill it outright, leaving the workers no time
# to save (see repro.loop.STOP_SIGNALS); it overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with that default.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def torchrun_tail(run_dir: Path) -> list[str]:
    """What every torchrun of a run shares: the stop signals it forwards, no restarts (a failed rank
    ends the job), each worker's lines prefixed with its rank and kept per rank in RUN_DIR/ranks, and
    the loop as the program."""
    return [
        "--signals-to-handle", TORCHRUN_SIGNALS, "--max-restarts", "0", "--tee", "3", "--log-dir",
        str(run_dir / RANKS_DIR), "-m", LOOP_MODULE, str(run_dir),
    ]


def torchrun_local(processes: int, run_dir: Path, python: str = sys.executable) -> list[str]:
    """PyTorch's own launcher on this machine: `processes` workers, rendezvous on a free local port."""
    return [
        python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes),
        *torchrun_tail(run_dir),
    ]


# The environment torchrun would give the one process of a one-process CPU run, started without a launcher;
# port 0: the rank hosts the store itself and binds a free port (no peer needs it).
SINGLE_RANK_ENV = ("RANK=0", "LOCAL_RANK=0", "WORLD_SIZE=1", "LOCAL_WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=0")
PRIMED_MODULE = "repro.warm.primed"


def single_rank(run_dir: Path, python: str = sys.executable) -> list[str]:
    """The one process of a one-process CPU run."""
    return ["env", *SINGLE_RANK_ENV, python, "-m", LOOP_MODULE, str(run_dir)]


def primed_single_rank(modules: Sequence[str], python: str = sys.executable) -> list[str]:
    """The same process started before its run folder is ready: it imports `modules`, then reads the
    folder's path from stdin (repro.warm.primed)."""
    return ["env", *SINGLE_RANK_ENV, python, "-m", PRIMED_MODULE, *modules]


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


def torchrun_node(
    nodes: int, per_node: int, endpoint: str, job_id: str, run_dir: Path, python: str = sys.executable,
) -> list[str]:
    """The launcher of one node of a multi-node job: it joins the c10d rendezvous at `endpoint` (HOST:PORT).

    The rendezvous, not the node's place on the command line, assigns global ranks; every node
    must pass the same `job_id`.
    """
    return [
        python, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job_id, *torchrun_tail(run_dir),
    ]


def rendezvous_port(job_id: int) -> int:
    """A port that differs between jobs sharing a node (same formula as the sbatch script's)."""
    return RDZV_BASE_PORT + job_id % RDZV_PORT_SPAN


STOP_WARNING_S = 120  # SIGUSR1 this long before the time limit: every rank saves and stops
# sbatch --time: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (Slurm's time_str2mins, src/common/parse_time.c)
SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def time_limit_s(limit: str) -> int:
    """Seconds in a Slurm time limit; ValueError naming the accepted forms when it is not one."""
    found = SLURM_TIME.fullmatch(limit)
    if not found:
        raise ValueError(f"{limit!r} is not a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    days, first, second, third = (int(part) if part else None for part in found.groups())
    if days is not None:
        return ((days * 24 + first) * 60 + (second or 0)) * 60 + (third or 0)
    if third is not None:
        return (first * 60 + second) * 60 + third
    return first * 60 + (second or 0)


def stop_warning_s(limit: str | None) -> int:
    """How long before the time limit the ranks are told to stop: 2 minutes, half a limit under 4 minutes."""
    return min(STOP_WARNING_S, time_limit_s(limit) // 2) if limit else STOP_WARNING_S


@dataclass(frozen=True)
class SlurmJob:
    name: str
    nodes: int
    gpus_per_node: int  # 0 on a cluster without GPUs: no GPU directive, the processes run on CPUs
    processes_per_node: int
    run_dir: Path
    data_root: Path
    tracking_uri: str
    python: str  # the follower's interpreter, on the batch node (the environment that submitted)
    image: str | None = None  # Apptainer image the workers run in
    time: str | None = None
    partition: str | None = None


def sbatch_script(job: SlurmJob) -> str:
    """The batch script of a multi-node job; compute nodes need no internet (data is pre-staged)."""
    run_dir = str(job.run_dir)
    # without GPUs, each process of a node (a stand-in for a GPU) gets a core; srun of Slurm 22.05
    # does not inherit --cpus-per-task from sbatch, so both ask
    cpus = [] if job.gpus_per_node else [f"--cpus-per-task={job.processes_per_node}"]
    resources = [f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else cpus
    directives = [
        f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1", *resources,
        f"--output={run_dir}/slurm-%j.out", f"--signal=USR1@{stop_warning_s(job.time)}",
    ]
    directives += [f"--time={job.time}"] * bool(job.time) + [f"--partition={job.partition}"] * bool(job.partition)
    container = []
    if job.image:
        container = ["apptainer", "exec", "--nv", "--bind", f"{run_dir},{job.data_root}", job.image]
    worker_python = "python" if job.image else job.python
    torchrun = torchrun_node(job.nodes, job.processes_per_node, '"$head_addr:$rdzv_port"', '"$SLURM_JOB_ID"',
                             job.run_dir, worker_python)
    srun = ["srun", f"--nodes={job.nodes}", "--ntasks-per-node=1", *cpus, "--kill-on-bad-exit=1"]
    follower = ["exec", job.python, "-m", "repro.cli", "attach", run_dir, "--"]
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -euo pipefail", ""]
    lines += ["# compute nodes are offline: libraries must not try the network; data is pre-staged"]
    lines += [f"export {name}=1" for name in OFFLINE_VARIABLES]
    lines += [
        f"export REPRO_DATA={shlex.quote(str(job.data_root))}",
        f"export MLFLOW_TRACKING_URI={shlex.quote(job.tracking_uri)}",
        "",
        "# the c10d rendezvous is hosted by the first node, at its address as Slurm knows it (node names",
        "# need not resolve), on a port derived from the job id",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        'head_addr=$(sinfo --noheader --Node --nodes="$head_node" --format=%o | head -n1)',
        f"rdzv_port=$(({RDZV_BASE_PORT} + SLURM_JOB_ID % {RDZV_PORT_SPAN}))",
        "",
        "# the follower (in the batch step's place, so a cancelled job leaves it time to record the end)",
        "# starts the job steps and records the run in MLflow (only it logs)",
        " \\\n    ".join(" ".join(map(quote_unless_expanded, part)) for part in (follower, srun, container, torchrun) if part),
        "",
    ]
    return "\n".join(lines)


def quote_unless_expanded(word: str) -> str:
    """Shell-quote a word, except those written as a double-quoted shell expansion ("$head_node:...")."""
    return word if word.startswith('"$') else shlex.quote(word)


WARM_MODULE = "repro.warm"


def warm_launcher(channel_fd: int, preload: Sequence[str], python: str = sys.executable) -> list[str]:
    """The warm launcher of CPU stand-in ranks (repro.warm): its fork server imports `preload` once, then
    forks the ranks of every job its parent sends over the channel (descriptor `channel_fd`)."""
    return [python, "-m", WARM_MODULE, "--channel", str(channel_fd), "--preload", ",".join(preload)]


def warm_job(launcher: list[str], entry: str, processes: int, run_dir: Path) -> list[str]:
    """A job of a warm launcher as the run records it (command.json) and --dry-run shows it: the launcher's
    command line, then what it is sent: `processes` ranks of `entry` on `run_dir`."""
    return [*launcher, "::", f"{processes} x {entry}", str(run_dir)]


def root_cause(exit_codes: dict[int, int]) -> int:
    """The rank that failed first, from the failed ranks' exit codes in the order they were observed: a rank
    killed from outside (by a signal other than SIGABRT, which gloo raises in a rank that lost a peer, and
    SIGTERM, which the launchers send the others after a failure) before the others, since ranks that lose a
    peer end on their own, with an error or an abort, in the same instant; else the first observed. Both
    torchrun (one summary per node, printed in no reliable order) and the warm launcher (torch's
    MultiprocessContext reports the lowest failed rank) need this: seen when a killed rank 1's peer rank 0
    aborted within the same poll, and rank 0 was blamed."""
    consequences = (-signal.SIGABRT, -signal.SIGTERM)
    killed = [rank for rank, code in exit_codes.items() if code < 0 and code not in consequences]
    return killed[0] if killed else next(iter(exit_codes))
