"""One run from the parent's side: verify data, launch the job, follow its events into MLflow.

Nothing is lost when a run fails: events are delivered as they are written (repro.delivery, in a
thread of its own, so an MLflow outage never stops or slows the job), the job's output is kept in
the run folder, and the MLflow run ends FAILED with the last lines of that output.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import select
import shutil
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

from repro import checkpoint, delivery, doctor, events, hardware, launch, registry, slurm, tracking
from repro.data import DataError, Verified
from repro.data.sets import dataset
from repro.delivery import RECIPE_FILE
from repro.loop import RUN_FILE
from repro.recipe import Recipe, batch_too_big, differing_fields, resolve
from repro.schema import RecipeError
from repro.settle import SLURM_JOB_KEY

RUNS_DIR = Path("runs")
OUTPUT_FILE = "output.log"
JOB_SCRIPT = "job.sbatch"
TAIL_LINES = 80
ERROR_CHARS = 4800  # what of a failure's message fits in the repro.error tag (MLflow keeps 5000)
HEARTBEAT_S = 5  # how often the follower says it is alive (RUN_DIR/heartbeat.json)
POLL_S = 0.5  # the follower's loop: new events, heartbeat, grace periods (the launcher's exit wakes it at once)
# How often the follower lists the job's processes, to kill any left behind at the end (torchrun starts
# its workers in sessions of their own, beyond the reach of the launcher's process group). A listing
# reads all of /proc (about 1 ms of CPU here): every loop it would steal from the ranks it watches.
SCAN_EVERY_S = 2.0
# After the job: how long the follower keeps trying to deliver the rest before leaving it to `repro sync`
DELIVERY_BUDGET_S = float(os.environ.get("REPRO_DELIVERY_BUDGET_S", 60))
# After the ranks' `interrupted` event (all have saved): how long the job may take to end by itself. On
# scancel, srun waits for Slurm's KillWait (30 s by default) and the follower, in the batch step, is
# killed with it; it must record the end before.
SAVED_GRACE_S = 5
STOP_GRACE_S = 45  # after a stop signal, torchrun gives its workers 30 s to save before killing them
SPEC_WAIT_S = 120  # how long a node other than the first waits for the run folder to appear
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
CPU_PROCESSES_PER_CORE = 2  # stand-in GPUs per core before a run must ask for --oversubscribe
# torchrun's failure summary (ChildFailedError.format_msg, torch/distributed/elastic/multiprocessing/
# errors/__init__.py) names the first failed rank under this heading, as "rank      : 1 (local_rank: 1)"
# then "exitcode  : -9 (pid: ...)", and closes with a line of "="; the other ranks it stopped come before.
# In a job of several nodes each node's torchrun prints one: the first printed is the failure's node.
ROOT_CAUSE_HEADING = "Root Cause (first observed failure)"
ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
SUMMARY_END = re.compile(r"^=+$", re.MULTILINE)
# C++ stack frames that c10d appends to an error ("frame #3: c10d::... + 0x1f"): noise in repro.error
STACK_FRAME = re.compile(r"^.*frame #\d+: .*\n?", re.MULTILINE)


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
    oversubscribe: bool = False  # more CPU processes than CPU_PROCESSES_PER_CORE x cores, on purpose
    ignore_memory: bool = False  # launch even where the cost model predicts more memory than the devices have


@dataclass
class Outcome:
    returncode: int
    run_id: str | None  # None: nothing ran (a dry run, or --resume of a complete run)
    run_dir: Path
    status: str | None = None  # the MLflow run's end status, where this process recorded it


def verify_data(recipe: Recipe) -> Verified:
    """The verified data; refuses to run on missing or mismatching data unless allowed."""
    spec = dataset(recipe.data.dataset)
    try:
        return spec.verify()
    except DataError as error:
        if not recipe.run.allow_unverified:
            raise
        return Verified(spec.locate(), "unverified", f"none: --allow-unverified ({error})")


def preflight(recipe: Recipe, options: Launch) -> Verified:
    """The one validation pass after the recipe's own, before anything starts (and all --dry-run
    does): the framework is installed, the launching options fit, the devices exist, the data
    verifies and holds at least one global batch. Raises LaunchError, DataError or RecipeError."""
    check_machine(recipe, options)
    return check_data(recipe)


def check_machine(recipe: Recipe, options: Launch) -> None:
    """The framework is installed here, the launching options fit, the devices exist."""
    registry.adapter_class(recipe.run.framework)  # unavailable frameworks fail before anything starts
    check_launch(recipe, options)
    check_devices(recipe, options)
    check_memory(recipe, options)


def check_data(recipe: Recipe) -> Verified:
    """The data verifies (unless allowed not to) and holds at least one global batch."""
    data = verify_data(recipe)
    check_data_size(recipe, data.root)
    return data


def check_devices(recipe: Recipe, options: Launch) -> None:
    """This node has the GPUs the run needs, or cores for the CPU processes standing in for them.

    Explicit `run.device: cuda` and paper-scale recipes need one GPU per GPU of the run; a smoke run
    on `auto` may share fewer GPUs. SLURM allocates the devices, so nothing is checked here for it."""
    if options.launcher != "local":
        return
    run, gpus_here = recipe.run, hardware.gpu_count()
    needed = run.gpus // run.nodes
    strict = run.device == "cuda" or (run.device == "auto" and recipe.scale == "paper")
    if strict and gpus_here < needed:
        raise LaunchError(
            f"run.gpus: needs {needed} GPU{'s' if needed > 1 else ''}{' per node' if run.nodes > 1 else ''}, this machine has {gpus_here}: "
            "use --launcher slurm" + ("" if run.device == "cuda" else ", or --set run.device=cpu for CPU processes"))
    if run.device == "cuda" or (run.device == "auto" and gpus_here):
        return
    processes = registry.adapter_class(run.framework).processes(recipe) // run.nodes
    cores = hardware.cpu_cores()
    if processes > CPU_PROCESSES_PER_CORE * cores and not options.oversubscribe:
        raise LaunchError(
            f"run.gpus: {processes} CPU processes stand in for GPUs here, but this machine has {cores} cores and no "
            f"GPU (at most {CPU_PROCESSES_PER_CORE} x {cores} = {CPU_PROCESSES_PER_CORE * cores} processes): "
            "use fewer --gpus, --launcher slurm, or --oversubscribe")


def check_memory(recipe: Recipe, options: Launch) -> None:
    """The memory the cost model predicts per GPU fits this node's devices: a GPU's memory, or the RAM
    that the CPU processes standing in for its GPUs share. SLURM's nodes are not known here."""
    if options.launcher != "local" or options.ignore_memory:
        return
    from repro import costmodel

    try:
        predicted = costmodel.predict(costmodel.cell_of(recipe))
    except KeyError:  # no model for this framework or workload: nothing to check against
        return
    per_gpu = predicted.fit_bytes
    gpus = recipe.run.gpus // recipe.run.nodes
    on_gpu = recipe.run.device == "cuda" or (recipe.run.device == "auto" and hardware.gpu_count())
    need, have = (per_gpu, hardware.gpu_memory_bytes()) if on_gpu else (per_gpu * gpus, hardware.memory_gb() * 2**30)
    if need > have:
        standing_in = "" if on_gpu else f" x {gpus} CPU stand-in{'s' if gpus > 1 else ''} = {gib(need)}"
        raise LaunchError(
            f"memory: predicted {gib(per_gpu)} per GPU ({recipe.run.framework}, repro.costmodel){standing_in}, over "
            f"this machine's {'GPU memory' if on_gpu else 'RAM'}, {gib(have)}; --ignore-memory-check to launch anyway")


def gib(size: float) -> str:
    return f"{size / 2**30:,.1f} GiB"


def check_data_size(recipe: Recipe, data_dir: Path) -> None:
    """The training split holds at least one global batch, so every epoch has a step."""
    workload = registry.workload_class(recipe.workload)(recipe.model, recipe.data, data_dir)
    samples = workload.train_samples()
    batch = registry.adapter_class(recipe.run.framework).global_batch(recipe)
    if batch > samples:
        why = f"at most, in {recipe.data.dataset}"
        raise RecipeError(str(data_dir), "train.batch_per_gpu", batch_too_big(recipe, batch, samples, why))


def run_tags(recipe: Recipe, data: Verified, run_dir: Path, ignore_memory: bool = False) -> dict[str, str]:
    tags = {
        "model": recipe.workload, "framework": recipe.run.framework, "gpus": recipe.run.gpus,
        "nodes": recipe.run.nodes, "scale": recipe.scale, "seed": recipe.seed,
        "recipe_sha256": recipe.fingerprint(), "data_sha256": data.sha256, "data_check": data.check,
        "git_sha": doctor.git_sha(), "run_dir": run_dir,
    }
    if recipe.run.allow_unverified:
        tags["unverified_data"] = "true"
    if ignore_memory:
        tags["ignored_memory_check"] = "true"
    image = doctor.image()
    if image:
        tags["image"] = image
    source = {tracking.SOURCE_NAME: recipe.source, tracking.SOURCE_TYPE: "LOCAL", tracking.SOURCE_COMMIT: tags["git_sha"]}
    return {**{f"{tracking.TAG_PREFIX}{k}": str(v) for k, v in tags.items()}, **source}


def run_params(recipe: Recipe) -> dict[str, str]:
    """The recipe's fields, and what the framework really trains with under `effective.*` (the same
    names for every framework, so MLflow's compare view lines them up)."""
    params = recipe.flat()
    if recipe.optimizer() is not recipe.train.optimizer:  # the framework's section overrides the workload's
        params = {k: v for k, v in params.items() if not k.startswith("train.optimizer.")}
    effective = registry.adapter_class(recipe.run.framework).effective(recipe)
    return {**params, **{f"effective.{k}": str(v) for k, v in effective.items()}}


class OutputPump(threading.Thread):
    """Copies the job's output to the terminal and the run folder."""

    def __init__(self, stream: TextIO, log: Path, echo: Callable[[str], None]):
        super().__init__(daemon=True)
        self.stream, self.log, self.echo = stream, log, echo

    def run(self) -> None:
        with open(self.log, "a") as log:
            for line in self.stream:
                log.write(line)
                log.flush()
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
        if options.time:
            try:
                launch.time_limit_s(options.time)
            except ValueError as error:
                raise LaunchError(f"--time: {error}") from None
        if not options.dry_run and shutil.which("sbatch") is None:
            raise LaunchError("--launcher slurm: no sbatch on PATH; submit from a node of the cluster "
                              "(or load its Slurm module), or preview the script with --dry-run")
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
    gpus_per_node = recipe.run.gpus // nodes if cluster_has_gpus(options.partition, options.dry_run) else 0
    return launch.SlurmJob(
        name=recipe.run_name(), nodes=nodes, gpus_per_node=gpus_per_node,
        processes_per_node=processes // nodes, run_dir=run_dir, data_root=data_dir.parent, tracking_uri=uri,
        python=sys.executable, image=options.image, time=options.time, partition=options.partition,
    )


def cluster_has_gpus(partition: str | None, dry_run: bool) -> bool:
    """Whether the job's nodes have GPUs; a --dry-run away from a cluster shows the GPU form."""
    try:
        return slurm.partition_has_gpus(partition)
    except slurm.SlurmUnreachable as error:
        if dry_run:
            return True
        raise LaunchError(f"--launcher slurm: {error}") from None


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
    recipe: Recipe, options: Launch, uri: str, experiment: str, data: Verified,
) -> tuple[Path, tracking.Run, dict]:
    """A new run folder and MLflow run; RUN_DIR/run.json tells every rank of every node the recipe and run id.

    A SLURM run waits in the queue first: it is created SCHEDULED, and its job's follower marks it RUNNING."""
    run_dir = new_run_dir(recipe, options.run_dir)
    dataset_input = (recipe.data.dataset, data.sha256, str(data.root.resolve()))
    status = "SCHEDULED" if options.launcher == "slurm" else "RUNNING"
    run = tracking.Run.create(uri, experiment, recipe.run_name(), run_tags(recipe, data, run_dir, options.ignore_memory),
                              run_params(recipe), dataset_input, status)
    spec = {
        "recipe": recipe.to_dict(), "data_dir": str(data.root.resolve()), "data_sha256": data.sha256,
        "tracking_uri": uri, "mlflow_run_id": run.run_id,
    }
    (run_dir / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    checkpoint.atomic_write_text(run_dir / RUN_FILE, json.dumps(spec, indent=2))
    run.log_artifact(run_dir / RECIPE_FILE)
    run.log_dict(doctor.report(), "environment.json")
    run.log_dict(doctor.packages(), "packages.json")
    return run_dir, run, spec


# what a run's end records about that end; a resumed run starts without them
END_TAGS = ("repro.error", "repro.interrupted", "repro.failed_rank", "repro.settled")


def complete(recipe: Recipe, position: checkpoint.Position) -> bool:
    """Whether training under `recipe` has nothing left to do from `position`."""
    max_steps = recipe.train.max_steps
    return position.epoch >= recipe.train.epochs or bool(max_steps and position.step >= max_steps)


def continue_run(recipe: Recipe, options: Launch) -> tuple[Path, tracking.Run | None, dict]:
    """A stopped run's folder and its MLflow run, running again (waiting, for SLURM) and tagged as
    resumed; a finished run asked for more epochs is extended (its recipe rewritten, the extension
    tagged). A run already complete under `recipe` comes back with no MLflow run: there is nothing to
    do, and it stays untouched."""
    run_dir = find_resumable(recipe, options.resume)
    refuse_if_different(recipe, run_dir, extendable=("train.epochs",))
    spec, recorded, position = read_spec(run_dir), recorded_recipe(run_dir), checkpoint.latest(run_dir)[1]
    if complete(recipe, position):
        return run_dir, None, spec
    run = tracking.Run.reopen(spec["tracking_uri"], spec["mlflow_run_id"],
                              "SCHEDULED" if options.launcher == "slurm" else "RUNNING")
    run.delete_tags(END_TAGS)
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
    data = preflight(recipe, options)
    data_dir = data.root
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
        run_dir, run, spec = continue_run(recipe, options)
        if run is None:
            echo(f"{run_dir}: the run is complete (MLflow run {spec['mlflow_run_id']}, {recipe.train.epochs} epochs); "
                 f"nothing to resume; to train longer: --resume {run_dir} --epochs N")
            return Outcome(0, None, run_dir)
    else:
        run_dir, run, spec = new_run(recipe, options, uri, experiment, data)
    if options.launcher == "slurm":
        return submit(slurm_job(recipe, options, run_dir, data_dir, spec["tracking_uri"]), run, spec, echo)
    command = command_for(recipe, options, run_dir)
    returncode, status = follow(command, run_dir, echo, Progress(sys.stderr) if progress else None)
    return Outcome(returncode, run.run_id, run_dir, status)


def submit(job: launch.SlurmJob, run: tracking.Run, spec: dict, echo: Callable[[str], None]) -> Outcome:
    """Write the batch script into the run folder and hand it to sbatch; the job's follower logs the run.

    Every job of the run (the first and each resume) is kept, in order, in RUN_DIR/run.json
    ("slurm_job_ids") and the tag repro.slurm_job_ids; "slurm_job_id" and repro.slurm_job_id name the
    latest. Until the follower starts, the run stays SCHEDULED; `repro settle` ends it if the job goes
    without starting."""
    script = job.run_dir / JOB_SCRIPT
    script.write_text(launch.sbatch_script(job))
    run.log_artifact(script)
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if submitted.returncode:
        delivery.Outcome("FAILED", f"sbatch failed: {submitted.stderr.strip()}").save(job.run_dir)
        delivery.Delivery(job.run_dir).deliver()
        raise LaunchError(f"sbatch {script} failed: {submitted.stderr.strip()}")
    job_id = submitted.stdout.strip().split(";")[0]  # --parsable: "JOBID" or "JOBID;CLUSTER"
    spec[SLURM_JOB_KEY] = job_id  # the job `repro settle` asks Slurm about
    spec["slurm_job_ids"] = [*spec.get("slurm_job_ids", []), job_id]
    checkpoint.atomic_write_text(job.run_dir / RUN_FILE, json.dumps(spec, indent=2))
    run.set_tag("repro.slurm_job_id", job_id)
    run.set_tag("repro.slurm_job_ids", ",".join(spec["slurm_job_ids"]))
    echo(f"submitted SLURM job {job_id}; output in {job.run_dir}/slurm-{job_id}.out")
    return Outcome(0, run.run_id, job.run_dir)


def attach(run_dir: Path, command: list[str], echo: Callable[[str], None] = print) -> int:
    """Run `command` (the job steps) and follow its events into the run recorded in `run_dir`."""
    return follow(command, run_dir, echo, Progress(sys.stderr))[0]


def join(recipe: Recipe, options: Launch, echo: Callable[[str], None]) -> Outcome:
    """A node other than the first: start its launcher in the shared run folder; it logs nothing to MLflow."""
    run_dir = options.run_dir.resolve()
    deadline = time.monotonic() + SPEC_WAIT_S
    while not (run_dir / RUN_FILE).exists():
        if time.monotonic() > deadline:
            raise LaunchError(f"--node-rank {options.node_rank}: the first node made no run in {run_dir} "
                              f"within {SPEC_WAIT_S} s")
        time.sleep(POLL_S)
    refuse_if_different(recipe, run_dir)
    job = Job(command_for(recipe, options, run_dir), run_dir / f"output-node{options.node_rank}.log", echo)
    with job.forwarding_signals():
        while not job.finished():
            job.wait(POLL_S)
    return Outcome(job.returncode, None, run_dir)


def exit_notice(pid: int) -> int | None:
    """A descriptor that becomes readable when process `pid` exits (Linux's pidfd), so that waiting for
    it needs no polling; None where the system has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class Job:
    """The launcher and every process under it, started in its own session and stopped as a whole.

    Stop signals sent to `repro run` (Ctrl-C, SIGTERM, SIGUSR1) are forwarded to the launcher,
    which forwards them to the workers: they save a checkpoint and stop. Whatever still runs after
    the grace period, or after the launcher has exited, is killed, so no process outlives the run.
    """

    def __init__(self, command: list[str], output: Path, echo: Callable[[str], None]):
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop the job in order
        )
        self.output = output
        self.pump = OutputPump(self.process.stdout, output, echo)
        self.pump.start()
        self.tree = psutil.Process(self.process.pid)
        self.seen: set[psutil.Process] = set()
        self.scanned_at = -SCAN_EVERY_S
        self.exited = exit_notice(self.process.pid)
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

    def wait(self, seconds: float) -> None:
        """Until the launcher exits or `seconds` pass."""
        if self.exited is None:
            time.sleep(seconds)
        else:
            select.select([self.exited], [], [], seconds)

    def finished(self) -> bool:
        if time.monotonic() - self.scanned_at >= SCAN_EVERY_S:
            self.scanned_at = time.monotonic()
            with contextlib.suppress(psutil.NoSuchProcess):
                self.seen.update(self.tree.children(recursive=True))
        if self.stop_sent_at and time.monotonic() - self.stop_sent_at > STOP_GRACE_S:
            self.kill_leftovers()
        if self.process.poll() is None:
            return False
        self.returncode = self.process.returncode
        if self.exited is not None:
            os.close(self.exited)
            self.exited = None
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
        """(message, failing global rank): the first failure summary of the job's output, then its last lines.

        The message leads with the failed rank and fits the repro.error tag; C++ stack frames are left out."""
        output = STACK_FRAME.sub("", self.output.read_text(errors="replace"))
        tail = "".join(output.splitlines(keepends=True)[-TAIL_LINES:])
        heading = output.find(ROOT_CAUSE_HEADING)
        cause = ROOT_CAUSE.search(output, heading) if heading >= 0 else None
        if not cause:
            head, rank = f"exit code {self.returncode}", None
        else:
            rank, local_rank, code = cause.groups()
            end = SUMMARY_END.search(output, cause.end())
            summary = output[heading:end.start() if end else cause.end()].rstrip()
            head = f"rank {rank} (local rank {local_rank}) failed with exit code {code}\n{summary}"
        room = max(ERROR_CHARS - len(head), 0)
        return f"{head}\nlast output of the job:\n{tail[-room:] if room else ''}", rank


def follow(command: list[str], run_dir: Path, echo: Callable[[str], None], progress: Progress | None) -> tuple[int, str]:
    """Run the job while a courier thread delivers its events to MLflow; end the run with the job's status.

    FINISHED when the job succeeds; KILLED when it was stopped by a signal (after a stop signal the
    ranks save a checkpoint first, and the run is tagged with how to resume it); FAILED otherwise,
    with the failing rank and the last lines of output. The end is written to RUN_DIR/outcome.json
    first, so it survives an MLflow server that is away (`repro sync` delivers it later).
    """
    checkpoint.atomic_write_text(run_dir / "command.json", json.dumps(command, indent=2))
    reader = events.EventReader(run_dir / events.EVENTS_FILE)
    shown = progress.show if progress else lambda event: None
    for event in reader.new():  # a resumed run: the events already delivered, for the progress display
        shown(event)
    courier = delivery.Courier(delivery.Delivery(run_dir))
    courier.delivery.restart()
    delivery.beat(run_dir)
    courier.start()
    job = Job(command, run_dir / OUTPUT_FILE, echo)
    interrupted, last_beat = None, time.monotonic()
    outcome = delivery.Outcome("FAILED", "the follower stopped before the job")
    try:
        with job.forwarding_signals():
            while True:
                finished = job.finished()
                for event in reader.new():
                    shown(event)
                    if event["event"] == events.INTERRUPTED:
                        interrupted, saved_at = event, time.monotonic()
                if finished:
                    break
                if interrupted and time.monotonic() - saved_at > SAVED_GRACE_S:
                    job.kill_leftovers()  # every rank has saved; what lingers would hold the follower past KillWait
                if time.monotonic() - last_beat > HEARTBEAT_S:
                    delivery.beat(run_dir)
                    last_beat = time.monotonic()
                job.wait(POLL_S)
        outcome = ending(job, interrupted, run_dir)
    finally:
        outcome.save(run_dir)
        if not courier.finish(DELIVERY_BUDGET_S):
            echo(f"repro: MLflow did not take everything: {courier.delivery.state.undelivered}")
    return job.returncode, outcome.status


def ending(job: Job, interrupted: dict | None, run_dir: Path) -> delivery.Outcome:
    if job.returncode == 0:
        return delivery.Outcome("FINISHED")
    if interrupted or job.stop_signal:  # under SLURM the signal reaches the ranks, not the follower
        stopped_by = job.stop_signal.name if job.stop_signal else interrupted["signal"]
        outcome = delivery.Outcome("KILLED", f"stopped by {stopped_by}")
        if interrupted:
            then = (f"no checkpoint: {interrupted['no_checkpoint']}" if interrupted.get("no_checkpoint")
                    else f"continue with: repro run ... --resume {run_dir}")
            outcome.tags["repro.interrupted"] = f"{interrupted['signal']} at step {interrupted['step']}; {then}"
        return outcome
    error, rank = job.failure()
    return delivery.Outcome("FAILED", error, {"repro.failed_rank": rank} if rank is not None else {})
