"""What Slurm says about a job, asked of `squeue` (the only module that does)."""
from __future__ import annotations

import subprocess

# Job states after which nothing of the job runs any more (squeue(1), JOB STATE CODES)
ENDED = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT",
})
# slurm_strerror(ESLURM_INVALID_JOB_ID) (src/common/slurm_errno.c), which squeue prints for a job
# that slurmctld has already purged ("slurm_load_jobs error: Invalid job id specified")
UNKNOWN_JOB = "Invalid job id specified"
SQUEUE_TIMEOUT_S = 30


class SlurmUnreachable(RuntimeError):
    """squeue is not installed here, or it could not get an answer from slurmctld: nobody can tell
    whether the job is gone, so whoever asked must leave the job's run as it is."""


def job_state(job_id: str) -> str | None:
    """Slurm's state name for the job (PENDING, RUNNING, COMPLETING, COMPLETED, ...), or None when Slurm
    no longer knows it (slurmctld forgets a finished job after MinJobAge, 300 s by default).

    Raises SlurmUnreachable when squeue is absent or fails otherwise."""
    command = ["squeue", "-h", "-j", job_id, "-o", "%T"]
    try:
        answer = subprocess.run(command, capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmUnreachable(f"squeue not found: cannot ask Slurm about job {job_id}; run this where squeue works")
    except subprocess.TimeoutExpired:
        raise SlurmUnreachable(f"{' '.join(command)}: no answer within {SQUEUE_TIMEOUT_S} s")
    if answer.returncode == 0:
        states = answer.stdout.split()
        return states[0] if states else None
    if UNKNOWN_JOB in answer.stderr:
        return None
    raise SlurmUnreachable(f"{' '.join(command)} failed: {answer.stderr.strip()}")
