"""The run folder, RUN_DIR: one owner of its files and of the keys of run.json.

The parent writes the spec (run.json: the resolved recipe, the data, the MLflow run) and the recipe;
every rank, the LBANN driver, the follower, `repro sync` and `repro settle` read it. The ranks append
events and publish checkpoints; the follower writes the job's output, its heartbeat and how the job
ended; delivery keeps its place. They all meet here, so no other module spells a file name of the
folder or a key of run.json. This module imports no torch and no layer above it.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from repro.recipe import Recipe, resolve

RUN_FILE = "run.json"  # the spec: the input of every process of a run
RECIPE_FILE = "recipe.yaml"  # the resolved recipe, for people; logged when the run is created
EVENTS_FILE = "events.jsonl"  # the reporting rank's structured events (repro.events)
OUTCOME_FILE = "outcome.json"  # how the job ended, as its follower (or `repro settle`) decided
HEARTBEAT_FILE = "heartbeat.json"  # the follower's sign of life
DELIVERY_FILE = "delivery.json"  # how far delivery to MLflow got
OUTPUT_FILE = "output.log"  # the job's output, as the follower saw it
COMMAND_FILE = "command.json"  # the command line the follower started
JOB_SCRIPT = "job.sbatch"  # a Slurm run's batch script
CHECKPOINTS_DIR = "checkpoints"
RANKS_DIR = "ranks"  # each rank's output as its launcher keeps it (torchrun's --log-dir; a warm job's pids.json)
LATEST_FILE = "latest.json"  # in CHECKPOINTS_DIR: the pointer to the last complete checkpoint
DEFERRED_FILE = "deferred.json"  # MLflow calls kept while the tracking server did not answer (repro.deferred)
# what delivery leaves out of a run's artifacts: its inputs (logged when the run is created) and its bookkeeping
NOT_ARTIFACTS = {RUN_FILE, RECIPE_FILE, OUTCOME_FILE, HEARTBEAT_FILE, DELIVERY_FILE, DEFERRED_FILE}
RUNS_DIR = Path("runs")  # where `repro run` makes run folders, relative to where it runs


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename: a reader sees the old file or the new one."""
    temporary = temporary_name(path)
    temporary.write_text(text)
    os.replace(temporary, path)


@dataclass
class Spec:
    """run.json: what every process of the run starts from."""

    recipe: dict[str, Any]  # the resolved recipe (Recipe.to_dict); "source" names where it came from
    # None in a folder made without `repro run` (a test's probe, a benchmark): its ranks need the recipe and data only
    data_dir: str | None = None
    data_sha256: str | None = None
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    slurm_job_ids: list[str] = field(default_factory=list)  # every Slurm job of the run, in order

    @property
    def slurm_job_id(self) -> str | None:
        """The latest Slurm job, the one `repro settle` asks Slurm about."""
        return self.slurm_job_ids[-1] if self.slurm_job_ids else None

    def to_json(self) -> str:
        record = asdict(self)
        if self.slurm_job_ids:
            record["slurm_job_id"] = self.slurm_job_id
        else:
            del record["slurm_job_ids"]
        return json.dumps(record, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        record = json.loads(text)
        record.pop("slurm_job_id", None)  # derived: the last of slurm_job_ids
        return cls(**record)


@dataclass
class Position:
    """Where training stands: enough, with the per-epoch seeded sampler, to continue bit for bit."""

    epoch: int = 0  # the epoch in progress, or the next one to start
    epoch_step: int = 0  # batches of that epoch already trained
    step: int = 0  # optimizer steps since the start of the run
    elapsed_s: float = 0.0  # training time of the finished epochs
    epoch_s: float = 0.0  # training time already spent in the epoch in progress


@dataclass
class Outcome:
    """How the job ended, as whoever saw it end decided (the follower, or `repro settle`)."""

    status: str  # FINISHED, FAILED or KILLED
    error: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # of the run as a whole: the model check (names.MODEL_CHECK)


class RunFolder:
    """One run's folder. Paths for the files others write in their own formats (events, output,
    checkpoint contents); reads and writes for the ones whose format is the run's contract."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def file(self, name: str) -> Path:
        return self.path / name

    # the spec and the recipe
    @property
    def spec_file(self) -> Path:
        return self.path / RUN_FILE

    def exists(self) -> bool:
        """Whether the folder holds a run (its spec is written)."""
        return self.spec_file.exists()

    def read_spec(self) -> Spec:
        return Spec.from_json(self.spec_file.read_text())

    def write_spec(self, spec: Spec) -> None:
        atomic_write_text(self.spec_file, spec.to_json())

    def recipe(self) -> Recipe:
        """The run's Recipe, resolved from its spec as every process of the run reads it."""
        recipe = self.read_spec().recipe
        return resolve(recipe, recipe["source"])

    @property
    def recipe_file(self) -> Path:
        return self.path / RECIPE_FILE

    def write_recipe(self, recipe: dict[str, Any]) -> Path:
        self.recipe_file.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return self.recipe_file

    # what the job writes
    @property
    def events_file(self) -> Path:
        return self.path / EVENTS_FILE

    @property
    def output_file(self) -> Path:
        return self.path / OUTPUT_FILE

    @property
    def ranks_dir(self) -> Path:
        return self.path / RANKS_DIR

    def node_output_file(self, node_rank: int) -> Path:
        """The output of a node other than the first, in a job of several without Slurm."""
        return self.path / f"output-node{node_rank}.log"

    def write_command(self, command: list[str]) -> None:
        atomic_write_text(self.path / COMMAND_FILE, json.dumps(command, indent=2))

    @property
    def job_script(self) -> Path:
        return self.path / JOB_SCRIPT

    def artifacts(self) -> list[Path]:
        """What the job left in the folder (events, output, files an adapter wrote): inputs and bookkeeping excluded."""
        return sorted(p for p in self.path.iterdir()
                      if p.is_file() and p.name not in NOT_ARTIFACTS and not p.name.startswith("."))

    # the end, the heartbeat, delivery's place
    def read_outcome(self) -> Outcome | None:
        path = self.path / OUTCOME_FILE
        return Outcome(**json.loads(path.read_text())) if path.exists() else None

    def write_outcome(self, outcome: Outcome) -> None:
        atomic_write_text(self.path / OUTCOME_FILE, json.dumps(asdict(outcome), indent=2))

    def clear_outcome(self) -> None:
        (self.path / OUTCOME_FILE).unlink(missing_ok=True)

    def read_heartbeat(self) -> dict[str, Any] | None:
        path = self.path / HEARTBEAT_FILE
        return json.loads(path.read_text()) if path.exists() else None

    def write_heartbeat(self, sign: dict[str, Any]) -> None:
        atomic_write_text(self.path / HEARTBEAT_FILE, json.dumps(sign))

    def heartbeat_age_s(self, now: float) -> float:
        """Seconds since the follower's last beat, or since the spec was written where it never beat."""
        beat = self.path / HEARTBEAT_FILE
        return now - (beat if beat.exists() else self.spec_file).stat().st_mtime

    def read_delivery(self) -> dict[str, Any] | None:
        path = self.path / DELIVERY_FILE
        return json.loads(path.read_text()) if path.exists() else None

    def write_delivery(self, state: dict[str, Any]) -> None:
        atomic_write_text(self.path / DELIVERY_FILE, json.dumps(state, indent=2))

    def read_deferred(self) -> dict[str, Any] | None:
        path = self.path / DEFERRED_FILE
        return json.loads(path.read_text()) if path.exists() else None

    def write_deferred(self, record: dict[str, Any] | None) -> None:
        """Keep the deferred calls' record, or with None (none left) remove it."""
        path = self.path / DEFERRED_FILE
        if record is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write_text(path, json.dumps(record, indent=2))

    # checkpoints: one folder per save, made current by an atomically replaced pointer
    def checkpoint_folder(self, step: int) -> Path:
        return self.path / CHECKPOINTS_DIR / f"step-{step:09d}"

    def latest_checkpoint(self) -> tuple[Path, Position] | None:
        """The last complete checkpoint folder and its position, or None when the run has none."""
        pointer = self.path / CHECKPOINTS_DIR / LATEST_FILE
        if not pointer.exists():
            return None
        record = json.loads(pointer.read_text())
        return self.path / CHECKPOINTS_DIR / record["folder"], Position(**record["position"])

    def publish_checkpoint(self, folder: Path, position: Position) -> None:
        """Make `folder` the current checkpoint, then delete the older ones."""
        pointer = self.path / CHECKPOINTS_DIR / LATEST_FILE
        atomic_write_text(pointer, json.dumps({"folder": folder.name, "position": asdict(position)}, indent=2))
        for old in folder.parent.glob("step-*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
