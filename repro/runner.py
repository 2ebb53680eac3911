"""One run from the parent's side: verify data, launch the job, follow its events into MLflow.

Nothing is lost when a run fails: events are ingested as they are written, the job's output is
kept in the run folder, and the MLflow run ends FAILED with the last lines of that output.
"""
from __future__ import annotations

import collections
import datetime
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

import yaml

from repro import doctor, events, registry, tracking
from repro.data import DataError
from repro.data.sets import dataset
from repro.loop import RUN_FILE
from repro.recipe import Recipe

RUNS_DIR = Path("runs")
OUTPUT_FILE = "output.log"
RECIPE_FILE = "recipe.yaml"
TAIL_LINES = 40


@dataclass
class Outcome:
    returncode: int
    run_id: str | None
    run_dir: Path


def verify_data(recipe: Recipe) -> tuple[Path, str]:
    """(data folder, dataset SHA-256); refuses to run on missing or mismatching data unless allowed."""
    spec = dataset(recipe.data.dataset)
    try:
        return spec.verify()
    except DataError:
        if not recipe.run.allow_unverified:
            raise
        return spec.locate(), "unverified"


def run_tags(recipe: Recipe, data_sha: str) -> dict[str, str]:
    tags = {
        "model": recipe.workload, "framework": recipe.run.framework, "gpus": recipe.run.gpus,
        "nodes": recipe.run.nodes, "scale": recipe.scale, "seed": recipe.seed,
        "recipe_sha256": recipe.fingerprint(), "data_sha256": data_sha, "git_sha": doctor.git_sha(),
    }
    if recipe.run.allow_unverified:
        tags["unverified_data"] = "true"
    image = doctor.image()
    if image:
        tags["image"] = image
    return {f"{tracking.TAG_PREFIX}{k}": str(v) for k, v in tags.items()}


class OutputPump(threading.Thread):
    """Copies the job's output to the terminal and the run folder, keeping the last lines."""

    def __init__(self, stream: TextIO, log: Path, echo: Callable[[str], None]):
        super().__init__(daemon=True)
        self.stream, self.log, self.echo = stream, log, echo
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def run(self) -> None:
        with open(self.log, "a") as log:
            for line in self.stream:
                log.write(line)
                log.flush()
                self.tail.append(line)
                self.echo(line.rstrip("\n"))


class Progress:
    """One line per epoch, and a step counter that rewrites itself on a terminal."""

    def __init__(self, out: TextIO):
        self.out, self.total, self.epochs = out, None, None
        self.tty = out.isatty()

    def show(self, event: dict) -> None:
        kind = event["event"]
        if kind == events.START:
            per_epoch = event["steps_per_epoch"]
            self.epochs = event["epochs"]
            self.total = min(per_epoch * self.epochs, event["max_steps"] or per_epoch * self.epochs)
        elif kind == events.STEP and self.tty:
            self.out.write(f"\r  step {event['step']}/{self.total}  loss {event['loss']:.4f}   ")
            self.out.flush()
        elif kind == events.EPOCH:
            val = "  ".join(f"{k} {v:.4g}" for k, v in event["val"].items())
            lead = "\r" if self.tty else ""
            self.out.write(
                f"{lead}epoch {event['epoch'] + 1}/{self.epochs}  step {event['step']}/{self.total}  "
                f"{event['epoch_s']:.1f}s  {event['samples_per_s']:.1f} samples/s  {val}\n"
            )
            self.out.flush()


def new_run_dir(recipe: Recipe) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = RUNS_DIR / f"{recipe.run_name()}-{stamp}"
    path.mkdir(parents=True)
    return path.resolve()


def command_for(recipe: Recipe, run_dir: Path) -> list[str]:
    return registry.adapter_class(recipe.run.framework).command(recipe, run_dir)


def execute(
    recipe: Recipe, uri: str, experiment: str, dry_run: bool = False, echo: Callable[[str], None] = print,
    progress: bool = True,
) -> Outcome:
    registry.adapter_class(recipe.run.framework)  # unavailable frameworks fail before anything starts
    data_dir, data_sha = verify_data(recipe)
    if dry_run:
        command = command_for(recipe, Path("RUN_DIR"))
        echo(" ".join(command))
        return Outcome(0, None, Path("RUN_DIR"))
    run_dir = new_run_dir(recipe)
    command = command_for(recipe, run_dir)
    spec = {"recipe": recipe.to_dict(), "data_dir": str(data_dir.resolve()), "data_sha256": data_sha}
    (run_dir / RUN_FILE).write_text(json.dumps(spec, indent=2))
    (run_dir / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    run = tracking.Run(uri, experiment, recipe.run_name(), run_tags(recipe, data_sha), recipe.flat())
    run.log_artifact(run_dir / RECIPE_FILE)
    run.log_dict(doctor.report(), "environment.json")
    run.log_dict(doctor.packages(), "packages.json")
    run.log_dict(command, "command.json")
    returncode = follow(command, run_dir, run, echo, Progress(sys.stderr) if progress else None)
    return Outcome(returncode, run.run_id, run_dir)


def job_files(run_dir: Path) -> list[Path]:
    """What the job left in its run folder (events, output, files an adapter wrote), inputs excluded."""
    inputs = {RUN_FILE, RECIPE_FILE}
    return sorted(p for p in run_dir.iterdir() if p.is_file() and p.name not in inputs)


def follow(
    command: list[str], run_dir: Path, run: tracking.Run, echo: Callable[[str], None], progress: Progress | None,
) -> int:
    """Run the job, feeding its events to MLflow as they come; end the run with the job's status."""
    reader = events.EventReader(run_dir / events.EVENTS_FILE)
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    pump = OutputPump(job.stdout, run_dir / OUTPUT_FILE, echo)
    pump.start()
    status, error = "FAILED", None
    try:
        while True:
            finished = job.poll() is not None
            batch = list(reader.new())
            for event in batch if progress else ():
                progress.show(event)
            if batch:
                run.log_events(batch)
            if finished:
                break
            time.sleep(0.5)
        pump.join(timeout=10)
        if job.returncode == 0:
            status = "FINISHED"
        else:
            error = f"exit code {job.returncode}; last output:\n" + "".join(pump.tail)
    except KeyboardInterrupt:
        job.terminate()
        job.wait(timeout=30)
        status, error = "KILLED", "interrupted by the user"
        raise
    finally:
        for path in job_files(run_dir):
            run.log_artifact(path)
        run.end(status, error)
    return job.returncode
