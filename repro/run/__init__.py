"""One run from the parent's side, one role per module; `repro.runner` is the front door.

    options          what `repro run` is asked (Launch) and what came of it (Outcome)
    preflight        the checks before anything starts, and all --dry-run does
    record           the MLflow run: tags and params at the start, reopened on resume
    lifecycle        the run folder: new, resumed, extended
    executors        where the job runs: local torchrun, a node joining one, Slurm
    supervision      the job's process tree: output, signals forwarded, nothing left behind
    torchrun_failure what torchrun's failure summary says: the failed rank and why
    follower         the loop beside the job: events to MLflow, heartbeat, the end decided
    progress         the terminal's line per epoch
"""
