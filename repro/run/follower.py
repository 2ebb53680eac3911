"""The follower: the loop beside a running job, and the one that decides how the job ended.

It runs the job while a courier thread delivers its events to MLflow (repro.delivery, in a thread of
its own, so an MLflow outage never stops or slows the job), beats a heartbeat for `repro settle`,
and writes the end to RUN_DIR/outcome.json first, so the end survives an MLflow server that is away
(`repro sync` delivers it later). The job's output is kept in the run folder. A finished run checks the
cost model against its own counters (repro.model.check): the figures and errors go with its end, and
the follower says in one line whether the model held.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from repro import delivery, events, names
from repro.model import check
from repro.run.progress import Progress
from repro.run.supervision import POLL_S, Job, LauncherProcess
from repro.run.torchrun_failure import describe_failure
from repro.runfiles import Outcome, RunFolder

HEARTBEAT_S = 5  # how often the follower says it is alive (RUN_DIR/heartbeat.json)
# After the job: how long the follower keeps trying to deliver the rest before leaving it to `repro sync`
DELIVERY_BUDGET_S = float(os.environ.get("REPRO_DELIVERY_BUDGET_S", 60))
# After the ranks' `interrupted` event (all have saved): how long the job may take to end by itself. On
# scancel, srun waits for Slurm's KillWait (30 s by default) and the follower, in the batch step, is
# killed with it; it must record the end before.
SAVED_GRACE_S = 5


def follow(command: list[str], folder: RunFolder, echo: Callable[[str], None], progress: Progress | None,
           start: Callable[[], LauncherProcess] | None = None) -> tuple[int, str]:
    """Run the job while a courier thread delivers its events to MLflow; end the run with the job's status.

    FINISHED when the job succeeds; KILLED when it was stopped by a signal (after a stop signal the
    ranks save a checkpoint first, and the run is tagged with how to resume it); FAILED otherwise,
    with the failing rank and the last lines of output. `command` starts the job, unless `start` does
    (a job of a warm launcher); either way it is what RUN_DIR/command.json records.
    """
    folder.write_command(command)
    reader = events.EventReader(folder.events_file)
    shown = progress.show if progress else lambda event: None
    last: dict[str, dict] = {}  # the last event of each kind: the model check reads the start's and the epoch's
    for event in reader.new():  # a resumed run: the events already delivered, for the progress display
        shown(event)
        last[event["event"]] = event
    courier = delivery.Courier(delivery.Delivery(folder.path))
    courier.delivery.restart()
    delivery.beat(folder)
    courier.start()
    job = Job(start() if start else command, folder.output_file, echo)  # `start`: a job already launched
    interrupted, last_beat = None, time.monotonic()
    outcome = Outcome("FAILED", "the follower stopped before the job")
    try:
        with job.forwarding_signals():
            while True:
                finished = job.finished()
                for event in reader.new():
                    shown(event)
                    last[event["event"]] = event
                    if event["event"] == events.INTERRUPTED:
                        interrupted, saved_at = event, time.monotonic()
                if finished:
                    break
                if interrupted and time.monotonic() - saved_at > SAVED_GRACE_S:
                    job.kill_leftovers()  # every rank has saved; what lingers would hold the follower past KillWait
                if time.monotonic() - last_beat > HEARTBEAT_S:
                    delivery.beat(folder)
                    last_beat = time.monotonic()
                job.wait(POLL_S)
        outcome = ending(job, interrupted, folder)
        if outcome.status == "FINISHED":
            self_check(outcome, folder, last, echo)
    finally:
        folder.write_outcome(outcome)
        if not courier.finish(DELIVERY_BUDGET_S):
            echo(f"repro: MLflow did not take everything: {courier.delivery.state.undelivered}")
    return job.returncode, outcome.status


def self_check(outcome: Outcome, folder: RunFolder, last: dict[str, dict], echo: Callable[[str], None]) -> None:
    """The cost model against the run's counters, into `outcome` (metrics and a tag) and one line on the console."""
    recipe = folder.recipe()
    checked = check.of_events(recipe, last.get(events.START), last.get(events.EPOCH))
    line = check.summary(checked)
    outcome.metrics.update(check.metrics(checked))
    outcome.tags[names.MODEL_CHECK_LINE] = line
    echo(line)


def ending(job: Job, interrupted: dict | None, folder: RunFolder) -> Outcome:
    if job.returncode == 0:
        return Outcome("FINISHED")
    if interrupted or job.stop_signal:  # under SLURM the signal reaches the ranks, not the follower
        stopped_by = job.stop_signal.name if job.stop_signal else interrupted["signal"]
        outcome = Outcome("KILLED", f"stopped by {stopped_by}")
        if interrupted:
            then = (f"no checkpoint: {interrupted['no_checkpoint']}" if interrupted.get("no_checkpoint")
                    else f"continue with: repro run ... --resume {folder.path}")
            outcome.tags[names.INTERRUPTED] = f"{interrupted['signal']} at step {interrupted['step']}; {then}"
        return outcome
    error, rank = describe_failure(job.output.read_text(errors="replace"), job.returncode, names.ERROR_CHARS)
    return Outcome("FAILED", error, {names.FAILED_RANK: rank} if rank is not None else {})
