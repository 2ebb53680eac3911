"""Settling: end the MLflow runs whose job is gone, with the status their run folder's events give.

Runs that started while the tracking server was away are known by their folders only (RUN_DIR/
deferred.json, repro.deferred) until delivery creates them: settle finds them under runs/ too.

A RUNNING or SCHEDULED run is left as it is while anything says its job may live: a heartbeat in
its run folder younger than the stale limit, its follower's process on this machine, a Slurm job
that Slurm still has queued or running (or a Slurm that cannot be asked). Otherwise the events decide:
an `end` event -> FINISHED, an `interrupted` event last -> KILLED (resumable), anything else ->
FAILED; the reason goes to the `repro.settled` tag, and the run folder is delivered like `repro sync`.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import psutil

from repro import deferred, events, slurm, tracking
from repro.delivery import HEARTBEAT_FILE, Delivery, Outcome
from repro.runfiles import RUN_FILE, RUNS_DIR

STALE_S = 120.0  # the follower beats every few seconds; this much silence means it is gone
REASON_TAG = "repro.settled"
SLURM_JOB_KEY = "slurm_job_id"  # in RUN_DIR/run.json, written when a job is submitted to Slurm


def follower_lives(sign: dict) -> bool:
    """The follower that wrote the heartbeat `sign` still runs on this machine (the same pid, started as it was)."""
    try:
        return abs(psutil.Process(sign["pid"]).create_time() - sign["started"]) < 1
    except (psutil.NoSuchProcess, KeyError):
        return False


def job_gone(run_dir: Path, stale_s: float) -> tuple[bool, str]:
    """(whether the run's job is gone, the evidence). Raises slurm.SlurmUnreachable when Slurm cannot be asked."""
    spec = json.loads((run_dir / RUN_FILE).read_text())
    heartbeat = run_dir / HEARTBEAT_FILE
    age = time.time() - (heartbeat if heartbeat.exists() else run_dir / RUN_FILE).stat().st_mtime
    if age < stale_s:
        return False, f"its heartbeat is {age:.0f} s old"
    evidence = [f"no heartbeat for {age:.0f} s"]
    if heartbeat.exists():
        sign = json.loads(heartbeat.read_text())
        if sign["host"] == socket.gethostname() and follower_lives(sign):
            return False, f"its follower (pid {sign['pid']}) still runs"
        here = sign["host"] == socket.gethostname()
        evidence.append(f"follower pid {sign['pid']} on {sign['host']} {'gone' if here else 'silent'}")
    job_id = spec.get(SLURM_JOB_KEY)
    if job_id:
        state = slurm.job_state(str(job_id))
        if state is not None and state not in slurm.ENDED:
            return False, f"Slurm job {job_id} is {state}"
        evidence.append(f"Slurm job {job_id} {state or 'no longer known to Slurm'}")
    return True, "; ".join(evidence)


def ending_from_events(run_dir: Path, evidence: str) -> Outcome:
    """How the job ended, as far as its events tell."""
    found = events.read_all(run_dir / events.EVENTS_FILE)
    marks = [e for e in found if e["event"] in (events.START, events.RESUME, events.INTERRUPTED, events.END)]
    steps = [e["step"] for e in found if "step" in e]
    last = marks[-1]["event"] if marks else None
    if last == events.END:
        return Outcome("FINISHED", None, {REASON_TAG: f"the job ended at step {steps[-1]}; its end was "
                                                      f"not recorded ({evidence})"})
    if last == events.INTERRUPTED:
        stop = marks[-1]
        reason = f"stopped by {stop['signal']} at step {stop['step']}"
        return Outcome("KILLED", reason, {REASON_TAG: f"{reason} ({evidence})",
                                          "repro.interrupted": f"{reason}; continue with: repro run ... --resume {run_dir}"})
    where = f"after step {steps[-1]}" if steps else "before its first step" if found else "before it started"
    reason = f"the job is gone without an end event, {where} ({evidence})"
    return Outcome("FAILED", reason, {REASON_TAG: reason})


def settle_folder(run_dir: Path, stale_s: float = STALE_S) -> str:
    """End the run of `run_dir` if its job is gone; deliver what is left. One line saying what was done."""
    delivery = Delivery(run_dir)
    if delivery.state.ended:
        return f"{run_dir}: already ended {delivery.state.ended}"
    outcome = Outcome.load(run_dir)
    if outcome is None:
        try:
            gone, evidence = job_gone(run_dir, stale_s)
        except slurm.SlurmUnreachable as error:
            return f"{run_dir}: left as it is: {error}"
        if not gone:
            return f"{run_dir}: left running: {evidence}"
        outcome = ending_from_events(run_dir, evidence)
        outcome.save(run_dir)
    try:
        delivery.deliver()
    except Exception as error:  # a server that is away: the folder says what is left, a later settle resumes
        delivery.record_undelivered(error)
        return f"{run_dir}: ends {outcome.status}, not delivered yet: {delivery.state.undelivered}"
    return f"{run_dir}: ended {outcome.status} ({outcome.tags.get(REASON_TAG, outcome.error or 'as its follower saw it')})"


def not_created(runs_dir: Path = RUNS_DIR) -> list[Path]:
    """The run folders under `runs_dir` whose MLflow run was never created (the server was away at their
    start and has not been reached since): MLflow does not know them, their folders do."""
    return sorted(path.parent for path in runs_dir.glob(f"*/{deferred.DEFERRED_FILE}")
                  if any(call[0] == "create" for call in deferred.pending(path.parent)))


def settle(uri: str, run_dirs: list[Path], stale_s: float = STALE_S) -> list[str]:
    """Settle the runs of `run_dirs`, or without any, every RUNNING or SCHEDULED run of the store `uri`
    and every run folder here whose run MLflow has not been told of yet."""
    if run_dirs:
        return [settle_folder(run_dir, stale_s) for run_dir in run_dirs]
    lines = [settle_folder(run_dir.resolve(), stale_s) for run_dir in not_created()]
    for run_id, status, tags in tracking.unfinished_runs(uri):
        folder = tags.get(f"{tracking.TAG_PREFIX}run_dir")
        if folder and (Path(folder) / RUN_FILE).exists():
            lines.append(settle_folder(Path(folder), stale_s))
        else:
            lines.append(f"run {run_id} ({status}): its run folder {folder or '(not recorded)'} is not on this "
                         "machine; settle it where the folder is")
    return lines
