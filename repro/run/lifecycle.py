"""The run folder from the parent's side: a new one, a stopped one resumed, a finished one extended.

RUN_DIR/run.json (repro.runfiles.Spec) tells every rank of every node the recipe, the data and the
MLflow run; RUN_DIR/recipe.yaml is the same recipe for people.
"""
from __future__ import annotations

import datetime
from pathlib import Path

from repro import registry, tracking
from repro.data import Verified
from repro.deferred import DeferredRun
from repro.recipe import Recipe, differing_fields
from repro.run import record
from repro.run.options import Launch, LaunchError
from repro.runfiles import RUN_FILE, RUNS_DIR, Position, RunFolder, Spec


def new_folder(recipe: Recipe, explicit: Path | None = None) -> RunFolder:
    if explicit is not None:
        if RunFolder(explicit).exists():
            raise LaunchError(f"--run-dir {explicit}: it already holds a run; continue it with --resume {explicit}")
        explicit.mkdir(parents=True, exist_ok=True)
        return RunFolder(explicit.resolve())
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = RUNS_DIR / f"{recipe.run_name()}-{stamp}"
    path.mkdir(parents=True)
    return RunFolder(path.resolve())


def find_resumable(recipe: Recipe, wanted: str) -> RunFolder:
    """The run folder to continue: the one named, or the newest of this recipe's run name."""
    framework = recipe.run.framework
    refusal = registry.plan_class(framework).no_checkpoint_because(framework)
    if refusal:
        raise LaunchError(f"--resume: {refusal}")
    if wanted != "latest":
        run_dir = Path(wanted)
    else:
        candidates = sorted(RUNS_DIR.glob(f"{recipe.run_name()}-*"))
        if not candidates:
            raise LaunchError(f"--resume: no run folder of {recipe.run_name()} under {RUNS_DIR}/")
        run_dir = candidates[-1]
    folder = RunFolder(run_dir)
    if not folder.exists():
        raise LaunchError(f"--resume {run_dir}: not a run folder (no {RUN_FILE})")
    if folder.latest_checkpoint() is None:
        raise LaunchError(f"--resume {run_dir}: the run has no complete checkpoint; start it again instead")
    return RunFolder(run_dir.resolve())


def refuse_if_different(recipe: Recipe, folder: RunFolder, extendable: tuple[str, ...] = ()) -> None:
    """A run is only continued, or joined, with the recipe it was started with (`extendable` fields
    may grow: more epochs)."""
    recorded = folder.recipe()
    fields = [f for f in differing_fields(recorded, recipe)
              if not (f in extendable and recipe.flat()[f] > recorded.flat()[f])]
    if fields:
        shown = ", ".join(f"{f} ({recorded.flat().get(f)} -> {recipe.flat().get(f)})" for f in fields)
        raise LaunchError(f"{folder.path}: the recipe differs from the run's in {shown}; the run needs the same recipe")


def new_run(
    recipe: Recipe, options: Launch, uri: str, experiment: str, data: Verified, status: str,
) -> tuple[RunFolder, tracking.Run | DeferredRun]:
    """A new run folder and its MLflow run, created in `status` (SCHEDULED while a Slurm job waits)."""
    folder = new_folder(recipe, options.run_dir)
    run = record.create(recipe, uri, experiment, data, folder, status, options.ignore_memory)
    spec = Spec(recipe.to_dict(), str(data.root.resolve()), data.sha256, uri, run.run_id)
    recipe_file = folder.write_recipe(spec.recipe)
    folder.write_spec(spec)
    record.log_inputs(run, recipe_file)
    return folder, run


def complete(recipe: Recipe, position: Position) -> bool:
    """Whether training under `recipe` has nothing left to do from `position`."""
    max_steps = recipe.train.max_steps
    return position.epoch >= recipe.train.epochs or bool(max_steps and position.step >= max_steps)


def continue_run(recipe: Recipe, options: Launch, status: str) -> tuple[RunFolder, tracking.Run | DeferredRun | None]:
    """A stopped run's folder and its MLflow run, in `status` again and tagged as resumed; a finished
    run asked for more epochs is extended (its recipe rewritten, the extension tagged). A run already
    complete under `recipe` comes back with no MLflow run: there is nothing to do, and it stays untouched."""
    folder = find_resumable(recipe, options.resume)
    refuse_if_different(recipe, folder, extendable=("train.epochs",))
    spec, recorded, position = folder.read_spec(), folder.recipe(), folder.latest_checkpoint()[1]
    if complete(recipe, position):
        return folder, None
    run = record.reopen(spec.tracking_uri, spec.mlflow_run_id, status, folder)
    if recipe.train.epochs != recorded.train.epochs:
        extend(folder, spec, run, recipe, recorded.train.epochs, position)
    record.mark_resumed(run, position)
    return folder, run


def extend(folder: RunFolder, spec: Spec, run: tracking.Run | DeferredRun, recipe: Recipe, epochs: int, at: Position) -> None:
    """Give the run `recipe`'s epochs: the ranks read them from run.json."""
    spec.recipe = recipe.to_dict()
    recipe_file = folder.write_recipe(spec.recipe)
    folder.write_spec(spec)
    record.mark_extended(run, recipe, epochs, at, recipe_file)
