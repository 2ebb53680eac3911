"""The run folder from the parent's side: a new one, a stopped one resumed, a finished one extended.

RUN_DIR/run.json tells every rank of every node the recipe, the data and the MLflow run; RUN_DIR/
recipe.yaml is the same recipe for people.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import yaml

from repro import checkpoint, registry, tracking
from repro.data import Verified
from repro.deferred import DeferredRun
from repro.delivery import RECIPE_FILE
from repro.recipe import Recipe, differing_fields, resolve
from repro.run import record
from repro.run.options import Launch, LaunchError
from repro.runfiles import RUN_FILE, RUNS_DIR



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


def read_spec(run_dir: Path) -> dict:
    return json.loads((run_dir / RUN_FILE).read_text())


def write_spec(run_dir: Path, spec: dict) -> None:
    checkpoint.atomic_write_text(run_dir / RUN_FILE, json.dumps(spec, indent=2))


def write_recipe(run_dir: Path, recipe: Recipe) -> Path:
    path = run_dir / RECIPE_FILE
    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    return path


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
    recipe: Recipe, options: Launch, uri: str, experiment: str, data: Verified, status: str,
) -> tuple[Path, tracking.Run | DeferredRun, dict]:
    """A new run folder and its MLflow run, created in `status` (SCHEDULED while a Slurm job waits)."""
    run_dir = new_run_dir(recipe, options.run_dir)
    run = record.create(recipe, uri, experiment, data, run_dir, status, options.ignore_memory)
    spec = {
        "recipe": recipe.to_dict(), "data_dir": str(data.root.resolve()), "data_sha256": data.sha256,
        "tracking_uri": uri, "mlflow_run_id": run.run_id,
    }
    recipe_file = write_recipe(run_dir, recipe)
    write_spec(run_dir, spec)
    record.log_inputs(run, recipe_file)
    return run_dir, run, spec


def complete(recipe: Recipe, position: checkpoint.Position) -> bool:
    """Whether training under `recipe` has nothing left to do from `position`."""
    max_steps = recipe.train.max_steps
    return position.epoch >= recipe.train.epochs or bool(max_steps and position.step >= max_steps)


def continue_run(recipe: Recipe, options: Launch, status: str) -> tuple[Path, tracking.Run | DeferredRun | None, dict]:
    """A stopped run's folder and its MLflow run, in `status` again and tagged as resumed; a finished
    run asked for more epochs is extended (its recipe rewritten, the extension tagged). A run already
    complete under `recipe` comes back with no MLflow run: there is nothing to do, and it stays untouched."""
    run_dir = find_resumable(recipe, options.resume)
    refuse_if_different(recipe, run_dir, extendable=("train.epochs",))
    spec, recorded, position = read_spec(run_dir), recorded_recipe(run_dir), checkpoint.latest(run_dir)[1]
    if complete(recipe, position):
        return run_dir, None, spec
    run = record.reopen(spec["tracking_uri"], spec["mlflow_run_id"], status, run_dir)
    if recipe.train.epochs != recorded.train.epochs:
        extend(run_dir, spec, run, recipe, recorded.train.epochs, position)
    record.mark_resumed(run, position)
    return run_dir, run, spec


def extend(run_dir: Path, spec: dict, run: tracking.Run, recipe: Recipe, epochs: int, at: checkpoint.Position) -> None:
    """Give the run `recipe`'s epochs: the ranks read them from run.json."""
    spec["recipe"] = recipe.to_dict()
    recipe_file = write_recipe(run_dir, recipe)
    write_spec(run_dir, spec)
    record.mark_extended(run, recipe, epochs, at, recipe_file)
