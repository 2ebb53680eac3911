"""Delivery of a run folder to its MLflow run: events, outcome and files, each stored once, whatever the outages.

The run folder is the truth (events.jsonl; outcome.json, how the job ended); the MLflow run is its
copy. Delivery keeps its place in RUN_DIR/delivery.json: the byte offset of the events delivered,
the files delivered (name -> size and mtime), whether the run was marked running and ended, and,
while something is left, what and why (`undelivered`). A failed attempt leaves the place where it
was, so the next one (the follower's next try, `repro sync`) resumes there. What an interrupted
attempt sent twice is stored once: MLflow's SQL store skips a metric point identical to one it holds
(sqlalchemy_store.py, `_log_metrics`: "Primary key can be violated if it is tried to log a metric with
same value, timestamp, step, and key"), a param logged again with its value is accepted, and a tag or
an artifact written again replaces itself.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from repro import deferred, events, tracking
from repro.runfiles import RunFolder

EVENTS_PER_BATCH = 200  # the place moves after each batch, so an outage costs at most one batch's resend
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.5, 15.0  # between failed attempts: doubling from the first to the longest
# Between deliveries while the job runs. Each one is a batch of SQL writes in the follower, next to the
# ranks it measures: once a second cost about 1.6% of a core on 2 cores (2 ranks of the smoke GPT-2);
# once every 10 s, MLflow still shows a run's losses seconds after they are made.
DELIVERY_INTERVAL_S = float(os.environ.get("REPRO_DELIVERY_INTERVAL_S", 10))


@dataclass
class State:
    """How far delivery got (RUN_DIR/delivery.json)."""

    events_offset: int = 0  # bytes of events.jsonl delivered
    events_delivered: int = 0
    points_delivered: int = 0  # metric points in the delivered events
    files: dict[str, list[int]] = field(default_factory=dict)  # name -> [size, mtime_ns] as delivered
    marked_running: bool = False
    ended: str | None = None  # the end status delivered
    undelivered: str | None = None  # what is left and the last error, while something is

    @classmethod
    def load(cls, run_dir: Path) -> "State":
        record = RunFolder(run_dir).read_delivery()
        return cls(**record) if record is not None else cls()

    def save(self, run_dir: Path) -> None:
        RunFolder(run_dir).write_delivery(asdict(self))


def beat(folder: RunFolder) -> None:
    """The follower's sign of life (RUN_DIR/heartbeat.json), which `repro settle` reads."""
    started = psutil.Process().create_time()  # with the pid, tells this process from a later one given its pid
    folder.write_heartbeat({"pid": os.getpid(), "started": started, "host": socket.gethostname(), "time": time.time()})


def file_mark(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


class Delivery:
    """Brings one run's MLflow run up to date with its folder; each call resumes where the last stopped."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.folder = run_dir, RunFolder(run_dir)
        self.state = State.load(run_dir)
        self._run: tracking.Run | None = None

    def run(self) -> tracking.Run:
        """The MLflow run, connected on first use (a server that is down fails the attempt, not the caller's setup)."""
        if self._run is None:  # created (or reopened) here if the parent could not (repro.deferred)
            self._run = deferred.replay(self.folder)
        return self._run

    def restart(self) -> None:
        """The job starts (again): the run is to be marked running, and a previous end no longer holds."""
        self.folder.clear_outcome()
        self.state.marked_running, self.state.ended = False, None
        self.state.save(self.run_dir)

    def deliver_events(self) -> None:
        """Mark the run running, then deliver the events written since the last delivery, a batch at a time."""
        if not self.state.marked_running and self.state.ended is None:
            self.run().mark_running()
            self.state.marked_running = True
            self.state.save(self.run_dir)
        reader = events.EventReader(self.folder.events_file, self.state.events_offset)
        batch: list[dict[str, Any]] = []
        for event in reader.new():
            batch.append(event)
            if len(batch) == EVENTS_PER_BATCH:
                self._deliver_batch(batch, reader.offset)
                batch = []
        if batch:
            self._deliver_batch(batch, reader.offset)

    def _deliver_batch(self, batch: list[dict[str, Any]], offset: int) -> None:
        self.run().log_events(batch)
        self.state.events_offset = offset
        self.state.events_delivered += len(batch)
        self.state.points_delivered += sum(len(tracking.event_metrics(e)) for e in batch)
        self.state.save(self.run_dir)

    def deliver(self) -> bool:
        """Everything the folder holds: events; once the job has ended, its files and its end. True when up to date."""
        self.deliver_events()
        outcome = self.folder.read_outcome()
        if outcome is None or self.state.ended:
            return outcome is not None
        for path in self.folder.artifacts():
            mark = file_mark(path)
            if self.state.files.get(path.name) != mark:
                self.run().log_artifact(path)
                self.state.files[path.name] = mark
                self.state.save(self.run_dir)
        if outcome.tags or outcome.metrics:
            self.run().log_values(outcome.metrics, outcome.tags)
        self.run().end(outcome.status, outcome.error)
        self.state.ended, self.state.undelivered = outcome.status, None
        self.state.save(self.run_dir)
        return True

    def record_undelivered(self, error: Exception) -> None:
        """Say in the run folder what is left to deliver, why, and how to deliver it."""
        left = list(events.EventReader(self.folder.events_file, self.state.events_offset).new())
        points = sum(len(tracking.event_metrics(e)) for e in left)
        files = [p.name for p in self.folder.artifacts() if self.state.files.get(p.name) != file_mark(p)]
        end = "" if self.state.ended else ", the run's end"
        calls = deferred.pending(self.folder)
        kept = f"{len(calls)} MLflow calls kept while the server was away (the run's creation first), " if calls else ""
        self.state.undelivered = (
            f"{kept}{len(left)} events ({points} metric points), {len(files)} files{end}; last error: "
            f"{type(error).__name__}: {str(error)[:300]}; deliver with: repro sync {self.run_dir}"
        )
        self.state.save(self.run_dir)


class Courier(threading.Thread):
    """Delivers a run folder while its job runs, in its own thread: the follower never waits on MLflow.

    A failed attempt (a server that is down, a bug in delivery) is tried again after a pause that
    doubles from FIRST_PAUSE_S up to LONGEST_PAUSE_S, for as long as the job runs; nothing it raises
    reaches the follower. `finish` then delivers the end for at most its budget of seconds and, if
    the server is still away, leaves `undelivered` in RUN_DIR/delivery.json for `repro sync`.
    """

    def __init__(self, delivery: Delivery, interval_s: float = DELIVERY_INTERVAL_S):
        super().__init__(daemon=True, name="mlflow-courier")
        self.delivery, self.interval_s = delivery, interval_s
        self.closing = threading.Event()
        self.deadline = float("inf")
        self.done = False
        self.error: Exception | None = None

    def run(self) -> None:
        pause = FIRST_PAUSE_S
        while True:
            closing = self.closing.is_set()
            try:
                if closing:
                    self.done = self.delivery.deliver()
                    return
                self.delivery.deliver_events()
                self.error, pause = None, FIRST_PAUSE_S
            except Exception as error:  # delivery must never end the follower; the next attempt resumes
                self.error, pause = error, min(pause * 2, LONGEST_PAUSE_S)
                if closing and time.monotonic() + pause > self.deadline:
                    return
            self.closing.wait(self.interval_s if self.error is None else pause)

    def finish(self, budget_s: float) -> bool:
        """After the job's end was written (outcome.json): deliver the rest within `budget_s`. True when all arrived."""
        self.deadline = time.monotonic() + budget_s
        self.closing.set()
        self.join(timeout=budget_s + tracking.REQUEST_TIMEOUT_S)
        if not self.done:
            self.delivery.record_undelivered(self.error or TimeoutError(f"not delivered within {budget_s:.0f} s"))
        return self.done
