"""One run from the parent's side: verify data, launch the job, follow its events into MLflow.

Nothing is lost when a run fails: events are ingested as they are written, the job's output is
kept in the run folder, and the MLflow run ends FAILED with the last lines of that output.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, TextIO

import psutil
import yaml

from repro import checkpoint, doctor, events, launch, registry, tracking
from repro.data import DataError
from repro.data.sets import dataset
from repro.loop import RUN_FILE
from repro.recipe import Recipe, differing_fields, resolve

RUNS_DIR = Path("runs")
OUTPUT_FILE = "output.log"
JOB_SCRIPT = "job.sbatch"
RECIPE_FILE = "recipe.yaml"
TAIL_LINES = 80
STOP_GRACE_S = 45  # after a stop signal, torchrun gives its workers 30 s to save before killing them
SPEC_WAIT_S = 120  # how long a node other than the first waits for the run folder to appear
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# torchrun's failure summary names the first failed rank under this heading, as
# "rank      : 1 (local_rank: 1)" then "exitcode  : -9 (pid: ...)"; the other ranks it stopped come before
ROOT_CAUSE_HEADING = "Root Cause (first observed failure)"
ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


class LaunchError(registry.Unavailable):
    """Launching options that cannot work together, or a run that cannot be resumed; says what to do.

    A kind of Unavailable: whoever skips runs that cannot start here (the table2 matrix skips cells
    of several nodes on one machine) skips these too."""


@dataclass
class Launch:
    """Where and how the job runs: the launching options of `repro run`."""

    launcher: Literal["local", "slurm"] = "local"
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of the first node, for --nodes > 1 without SLURM
    run_dir: Path | None = None  # shared by all nodes of a multi-node job
    resume: str | None = None  # a run folder, or "latest": the newest folder of the recipe's run name
    image: str | None = None
    time: str | None = None
    partition: str | None = None
    dry_run: bool = False


@dataclass
class Outcome:
    returncode: int
    run_id: str | None  # None: nothing ran (a dry run, or --resume of a complete run)
    run_dir: Path
    status: str | None = None  # the MLflow run's end status, where this process recorded it


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


def new_run_dir(recipe: Recipe, explicit: Path | None = None) -> Path:
    if explicit is not None:
        if (explicit / RUN_FILE).exists():
            raise LaunchError(f"--run-dir {explicit}: it already holds a run; continue it with --resume {explicit}")
        explicit.mkdir(parents=True, exist_ok=True)
        return explicit.resolve()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = RUNS_DIR / f"{recipe.run_name()}-{stamp}"
    path.mkdir(parents=True)
    return path.resolve()


def check_launch(recipe: Recipe, options: Launch) -> None:
    nodes = recipe.run.nodes
    processes = registry.adapter_class(recipe.run.framework).processes(recipe)
    if processes % nodes:
        raise LaunchError(f"--nodes {nodes}: {processes} processes do not spread evenly over {nodes} nodes")
    if not 0 <= options.node_rank < nodes:
        raise LaunchError(f"--node-rank {options.node_rank}: must be between 0 and nodes - 1 = {nodes - 1}")
    if options.launcher == "slurm":
        if options.node_rank or options.rdzv_endpoint:
            raise LaunchError("--launcher slurm starts every node itself; drop --node-rank and --rdzv-endpoint")
        return
    if nodes > 1 and not (options.rdzv_endpoint and options.run_dir):
        raise LaunchError(
            f"--nodes {nodes} with the local launcher: start `repro run` on every node with the same "
            "--rdzv-endpoint HOST:PORT (the first node's) and --run-dir (a shared folder), and --node-rank 0.."
            f"{nodes - 1}; or use --launcher slurm"
        )
    if nodes == 1 and (options.rdzv_endpoint or options.node_rank):
        raise LaunchError("--rdzv-endpoint and --node-rank are for jobs of several nodes (--nodes N)")


def command_for(recipe: Recipe, options: Launch, run_dir: Path) -> list[str]:
    return registry.adapter_class(recipe.run.framework).command(recipe, run_dir, options.rdzv_endpoint)


def slurm_job(recipe: Recipe, options: Launch, run_dir: Path, data_dir: Path, uri: str) -> launch.SlurmJob:
    processes = registry.adapter_class(recipe.run.framework).processes(recipe)
    nodes = recipe.run.nodes
    return launch.SlurmJob(
        name=recipe.run_name(), nodes=nodes, gpus_per_node=recipe.run.gpus // nodes,
        processes_per_node=processes // nodes, run_dir=run_dir, data_root=data_dir.parent, tracking_uri=uri,
        python=sys.executable, image=options.image, time=options.time, partition=options.partition,
    )


def read_spec(run_dir: Path) -> dict:
    return json.loads((run_dir / RUN_FILE).read_text())


def find_resumable(recipe: Recipe, wanted: str) -> Path:
    """The run folder to continue: the one named, or the newest of this recipe's run name."""
    framework = recipe.run.framework
    refusal = registry.adapter_class(framework).no_checkpoint_because(framework)
    if refusal:
        raise LaunchError(f"--resume: {refusal}")
    if wanted != "latest":
        run_dir = Path(wanted)
    else:
        candidates = sorted(RUNS_DIR.glob(f"{recipe.run_name()}-*"))
        if not candidates:
            raise LaunchError(f"--resume: no run folder of {recipe.run_name()} under {RUNS_DIR}/")
        run_dir = candidates[-1]
    if not (run_dir / RUN_FILE).exists():
        raise LaunchError(f"--resume {run_dir}: not a run folder (no {RUN_FILE})")
    if checkpoint.latest(run_dir) is None:
        raise LaunchError(f"--resume {run_dir}: the run has no complete checkpoint; start it again instead")
    return run_dir.resolve()


def recorded_recipe(run_dir: Path) -> Recipe:
    spec = read_spec(run_dir)
    return resolve(spec["recipe"], spec["recipe"]["source"])


def refuse_if_different(recipe: Recipe, run_dir: Path, extendable: tuple[str, ...] = ()) -> None:
    """A run is only continued, or joined, with the recipe it was started with (`extendable` fields
    may grow: more epochs)."""
    recorded = recorded_recipe(run_dir)
    fields = [f for f in differing_fields(recorded, recipe)
              if not (f in extendable and recipe.flat()[f] > recorded.flat()[f])]
    if fields:
        shown = ", ".join(f"{f} ({recorded.flat().get(f)} -> {recipe.flat().get(f)})" for f in fields)
        raise LaunchError(f"{run_dir}: the recipe differs from the run's in {shown}; the run needs the same recipe")


def new_run(
    recipe: Recipe, options: Launch, uri: str, experiment: str, data_dir: Path, data_sha: str,
) -> tuple[Path, tracking.Run, dict]:
    """A new run folder and MLflow run; RUN_DIR/run.json tells every rank of every node the recipe and run id."""
    run_dir = new_run_dir(recipe, options.run_dir)
    run = tracking.Run.create(uri, experiment, recipe.run_name(), run_tags(recipe, data_sha), recipe.flat())
    spec = {
        "recipe": recipe.to_dict(), "data_dir": str(data_dir.resolve()), "data_sha256": data_sha,
        "tracking_uri": uri, "mlflow_run_id": run.run_id,
    }
    (run_dir / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    checkpoint.atomic_write_text(run_dir / RUN_FILE, json.dumps(spec, indent=2))
    run.log_artifact(run_dir / RECIPE_FILE)
    run.log_dict(doctor.report(), "environment.json")
    run.log_dict(doctor.packages(), "packages.json")
    return run_dir, run, spec


def complete(recipe: Recipe, position: checkpoint.Position) -> bool:
    """Whether training under `recipe` has nothing left to do from `position`."""
    max_steps = recipe.train.max_steps
    return position.epoch >= recipe.train.epochs or bool(max_steps and position.step >= max_steps)


def continue_run(recipe: Recipe, wanted: str) -> tuple[Path, tracking.Run | None, dict]:
    """A stopped run's folder and its MLflow run, running again and tagged as resumed; a finished run
    asked for more epochs is extended (its recipe rewritten, the extension tagged). A run already
    complete under `recipe` comes back with no MLflow run: there is nothing to do, and it stays untouched."""
    run_dir = find_resumable(recipe, wanted)
    refuse_if_different(recipe, run_dir, extendable=("train.epochs",))
    spec, recorded, position = read_spec(run_dir), recorded_recipe(run_dir), checkpoint.latest(run_dir)[1]
    if complete(recipe, position):
        return run_dir, None, spec
    run = tracking.Run.reopen(spec["tracking_uri"], spec["mlflow_run_id"])
    if recipe.train.epochs != recorded.train.epochs:
        extend(run_dir, spec, run, recipe, recorded.train.epochs, position)
    run.set_tag("repro.resumed", "true")
    run.set_tag("repro.resumed_from_step", str(position.step))
    return run_dir, run, spec


def extend(run_dir: Path, spec: dict, run: tracking.Run, recipe: Recipe, epochs: int, at: checkpoint.Position) -> None:
    """Give the run `recipe`'s epochs: the ranks read them from run.json; MLflow keeps the first
    value of a param, so the tags say what the run became."""
    spec["recipe"] = recipe.to_dict()
    (run_dir / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    checkpoint.atomic_write_text(run_dir / RUN_FILE, json.dumps(spec, indent=2))
    run.set_tag("repro.extended", f"train.epochs {epochs} -> {recipe.train.epochs} at step {at.step}")
    run.set_tag(f"{tracking.TAG_PREFIX}recipe_sha256", recipe.fingerprint())
    run.log_artifact(run_dir / RECIPE_FILE)


def execute(
    recipe: Recipe, uri: str, experiment: str, options: Launch = Launch(), echo: Callable[[str], None] = print,
    progress: bool = True,
) -> Outcome:
    registry.adapter_class(recipe.run.framework)  # unavailable frameworks fail before anything starts
    check_launch(recipe, options)
    data_dir, data_sha = verify_data(recipe)
    if options.dry_run:
        placeholder = Path("RUN_DIR")
        if options.launcher == "slurm":
            echo(launch.sbatch_script(slurm_job(recipe, options, placeholder, data_dir, uri)))
        else:
            echo(" ".join(command_for(recipe, options, placeholder)))
        return Outcome(0, None, placeholder)
    if options.node_rank:
        return join(recipe, options, echo)
    if options.resume:
        run_dir, run, spec = continue_run(recipe, options.resume)
        if run is None:
            echo(f"{run_dir}: the run is complete (MLflow run {spec['mlflow_run_id']}, {recipe.train.epochs} epochs); "
                 f"nothing to resume; to train longer: --resume {run_dir} --epochs N")
            return Outcome(0, None, run_dir)
    else:
        run_dir, run, spec = new_run(recipe, options, uri, experiment, data_dir, data_sha)
    if options.launcher == "slurm":
        return submit(slurm_job(recipe, options, run_dir, data_dir, spec["tracking_uri"]), run, echo)
    command = command_for(recipe, options, run_dir)
    run.log_dict(command, "command.json")
    returncode, status = follow(command, run_dir, run, echo, Progress(sys.stderr) if progress else None)
    return Outcome(returncode, run.run_id, run_dir, status)


def submit(job: launch.SlurmJob, run: tracking.Run, echo: Callable[[str], None]) -> Outcome:
    """Write the batch script into the run folder and hand it to sbatch; the job's follower logs the run."""
    script = job.run_dir / JOB_SCRIPT
    script.write_text(launch.sbatch_script(job))
    run.log_artifact(script)
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if submitted.returncode:
        run.end("FAILED", f"sbatch failed: {submitted.stderr.strip()}")
        raise LaunchError(f"sbatch {script} failed: {submitted.stderr.strip()}")
    job_id = submitted.stdout.strip().split(";")[0]
    run.set_tag("repro.slurm_job_id", job_id)
    echo(f"submitted SLURM job {job_id}; output in {job.run_dir}/slurm-{job_id}.out")
    return Outcome(0, run.run_id, job.run_dir)


def attach(run_dir: Path, command: list[str], echo: Callable[[str], None] = print) -> int:
    """Run `command` (the job steps) and follow its events into the run recorded in `run_dir`."""
    spec = read_spec(run_dir)
    run = tracking.Run.reopen(spec["tracking_uri"], spec["mlflow_run_id"])
    run.log_dict(command, "command.json")
    return follow(command, run_dir, run, echo, Progress(sys.stderr))[0]


def join(recipe: Recipe, options: Launch, echo: Callable[[str], None]) -> Outcome:
    """A node other than the first: start its launcher in the shared run folder; it logs nothing to MLflow."""
    run_dir = options.run_dir.resolve()
    deadline = time.monotonic() + SPEC_WAIT_S
    while not (run_dir / RUN_FILE).exists():
        if time.monotonic() > deadline:
            raise LaunchError(f"--node-rank {options.node_rank}: the first node made no run in {run_dir} "
                              f"within {SPEC_WAIT_S} s")
        time.sleep(0.5)
    refuse_if_different(recipe, run_dir)
    job = Job(command_for(recipe, options, run_dir), run_dir / f"output-node{options.node_rank}.log", echo)
    with job.forwarding_signals():
        while not job.finished():
            time.sleep(0.5)
    return Outcome(job.returncode, None, run_dir)


class Job:
    """The launcher and every process under it, started in its own session and stopped as a whole.

    Stop signals sent to `repro run` (Ctrl-C, SIGTERM, SIGUSR1) are forwarded to the launcher,
    which forwards them to the workers: they save a checkpoint and stop. Whatever still runs after
    the grace period, or after the launcher has exited, is killed, so no process outlives the run.
    """

    def __init__(self, command: list[str], output: Path, echo: Callable[[str], None]):
        env = {**os.environ, "TORCHELASTIC_SIGNALS_TO_HANDLE": launch.TORCHRUN_SIGNALS}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop the job in order
        )
        self.pump = OutputPump(self.process.stdout, output, echo)
        self.pump.start()
        self.tree = psutil.Process(self.process.pid)
        self.seen: set[psutil.Process] = set()
        self.stop_signal: signal.Signals | None = None
        self.stop_sent_at = 0.0
        self.returncode: int | None = None

    def forward(self, signum: int, frame: object) -> None:
        self.stop_signal = signal.Signals(signum)
        self.stop_sent_at = self.stop_sent_at or time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)

    @contextlib.contextmanager
    def forwarding_signals(self) -> Iterator[None]:
        previous = {signum: signal.signal(signum, self.forward) for signum in FORWARDED_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.kill_leftovers()

    def finished(self) -> bool:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen.update(self.tree.children(recursive=True))
        if self.stop_sent_at and time.monotonic() - self.stop_sent_at > STOP_GRACE_S:
            self.kill_leftovers()
        if self.process.poll() is None:
            return False
        self.returncode = self.process.returncode
        self.kill_leftovers()
        self.pump.join(timeout=10)
        return True

    def kill_leftovers(self) -> None:
        for process in [self.tree, *self.seen]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def failure(self) -> tuple[str, str | None]:
        """(message, failing global rank) from the launcher's failure summary and the ranks' last lines."""
        tail = "".join(self.pump.tail)
        cause = ROOT_CAUSE.search(tail, tail.rfind(ROOT_CAUSE_HEADING) + 1)
        if not cause:
            return f"exit code {self.returncode}; last output:\n{tail}", None
        rank, local_rank, code = cause.groups()
        own = "".join(line for line in self.pump.tail if line.startswith(f"[default{local_rank}]:"))
        return (
            f"rank {rank} (local rank {local_rank}) failed with exit code {code}; its last lines:\n{own}\n"
            f"last output of the job:\n{tail}", rank,
        )


def job_files(run_dir: Path) -> list[Path]:
    """What the job left in its run folder (events, output, files an adapter wrote), inputs excluded."""
    inputs = {RUN_FILE, RECIPE_FILE}
    return sorted(p for p in run_dir.iterdir() if p.is_file() and p.name not in inputs)


def follow(
    command: list[str], run_dir: Path, run: tracking.Run, echo: Callable[[str], None], progress: Progress | None,
) -> tuple[int, str]:
    """Run the job, feeding its events to MLflow as they come; end the run with the job's status.

    FINISHED when the job succeeds; KILLED when it was stopped by a signal (after a stop signal the
    ranks save a checkpoint first, and the run is tagged with how to resume it); FAILED otherwise,
    with the failing rank and the last lines of output.
    """
    reader = events.EventReader(run_dir / events.EVENTS_FILE)
    shown = progress.show if progress else lambda event: None
    for event in reader.new():  # a resumed run: the events already in MLflow, for the progress display
        shown(event)
    job = Job(command, run_dir / OUTPUT_FILE, echo)
    interrupted = None
    status, error = "FAILED", "the follower stopped before the job"
    try:
        with job.forwarding_signals():
            while True:
                finished = job.finished()
                batch = list(reader.new())
                for event in batch:
                    shown(event)
                    interrupted = event if event["event"] == events.INTERRUPTED else interrupted
                if batch:
                    run.log_events(batch)
                if finished:
                    break
                time.sleep(0.5)
        if job.returncode == 0:
            status, error = "FINISHED", None
        elif interrupted or job.stop_signal:
            status, error = "KILLED", f"stopped by {(job.stop_signal or signal.SIGTERM).name}"
            if interrupted:
                then = (f"no checkpoint: {interrupted['no_checkpoint']}" if interrupted.get("no_checkpoint")
                        else f"continue with: repro run ... --resume {run_dir}")
                run.set_tag("repro.interrupted", f"{interrupted['signal']} at step {interrupted['step']}; {then}")
        else:
            error, rank = job.failure()
            if rank is not None:
                run.set_tag("repro.failed_rank", rank)
    finally:
        for path in job_files(run_dir):
            run.log_artifact(path)
        run.end(status, error)
    return job.returncode, status
