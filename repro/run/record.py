"""The MLflow run of a run, as the parent writes it: tags and params at the start, reopened on resume.

What the job then does reaches the run through its folder (repro.delivery); how it ended, through
the follower's outcome. A server that does not answer does not stop the run: these calls are kept in
the folder and made by delivery once it answers (repro.deferred). The names of tags and params are in
repro.names.
"""
from __future__ import annotations

from pathlib import Path

from repro import deferred, doctor, names, registry, tracking
from repro.data import Verified
from repro.deferred import DeferredRun
from repro.recipe import Recipe
from repro.runfiles import Position, RunFolder


def run_tags(recipe: Recipe, data: Verified, run_dir: Path, ignore_memory: bool = False) -> dict[str, str]:
    tags = {
        names.MODEL: recipe.workload, names.FRAMEWORK: recipe.run.framework, names.GPUS: recipe.run.gpus,
        names.NODES: recipe.run.nodes, names.SCALE: recipe.scale, names.SEED: recipe.seed,
        names.RECIPE_SHA256: recipe.fingerprint(), names.DATA_SHA256: data.sha256, names.DATA_CHECK: data.check,
        names.GIT_SHA: doctor.git_sha(), names.RUN_DIR: run_dir,
    }
    if recipe.run.allow_unverified:
        tags[names.UNVERIFIED_DATA] = "true"
    if ignore_memory:
        tags[names.IGNORED_MEMORY_CHECK] = "true"
    image = doctor.image()
    if image:
        tags[names.IMAGE] = image
    source = {tracking.SOURCE_NAME: recipe.source, tracking.SOURCE_TYPE: "LOCAL", tracking.SOURCE_COMMIT: tags[names.GIT_SHA]}
    return {**{k: str(v) for k, v in tags.items()}, **source}


def run_params(recipe: Recipe) -> dict[str, str]:
    """The recipe's fields, and what the framework really trains with under `effective.*` (the same
    names for every framework, so MLflow's compare view lines them up)."""
    params = recipe.flat()
    if recipe.optimizer() is not recipe.train.optimizer:  # the framework's section overrides the workload's
        params = {k: v for k, v in params.items() if not k.startswith("train.optimizer.")}
    effective = registry.plan_class(recipe.run.framework).effective(recipe)
    return {**params, **{f"{names.EFFECTIVE}{k}": str(v) for k, v in effective.items()}}


def create(recipe: Recipe, uri: str, experiment: str, data: Verified, folder: RunFolder, status: str,
           ignore_memory: bool) -> tracking.Run | DeferredRun:
    """A new MLflow run: the recipe's tags and params, the data as its input, in `status`; while the server
    does not answer, its creation kept in the run folder for delivery to make (repro.deferred)."""
    dataset_input = (recipe.data.dataset, data.sha256, str(data.root.resolve()))
    return deferred.create_or_defer(folder, uri, experiment, recipe.run_name(),
                                    run_tags(recipe, data, folder.path, ignore_memory), run_params(recipe), dataset_input,
                                    status)


def log_inputs(run: tracking.Run, recipe_file: Path) -> None:
    """What the run starts from: the resolved recipe, the environment and the installed packages."""
    run.log_artifact(recipe_file)
    run.log_dict(doctor.report(), "environment.json")
    run.log_dict(doctor.packages(), "packages.json")


def reopen(uri: str, run_id: str | None, status: str, folder: RunFolder) -> tracking.Run | DeferredRun:
    """A stopped run, in `status` again, without the tags of its last end (kept for later, in order, while
    the server does not answer or calls of an earlier outage wait: repro.deferred)."""
    run = deferred.reopen_or_defer(folder, uri, run_id, status)
    run.delete_tags(names.END_TAGS)
    return run


def mark_resumed(run: tracking.Run, position: Position) -> None:
    run.set_tag(names.RESUMED, "true")
    run.set_tag(names.RESUMED_FROM_STEP, str(position.step))


def mark_extended(run: tracking.Run, recipe: Recipe, epochs: int, at: Position, recipe_file: Path) -> None:
    """MLflow keeps the first value of a param, so the tags say what the run became."""
    run.set_tag(names.EXTENDED, f"train.epochs {epochs} -> {recipe.train.epochs} at step {at.step}")
    run.set_tag(names.RECIPE_SHA256, recipe.fingerprint())
    run.log_artifact(recipe_file)


def mark_submitted(run: tracking.Run, job_ids: list[str]) -> None:
    """The Slurm jobs of the run, in order, and the latest."""
    run.set_tag(names.SLURM_JOB_ID, job_ids[-1])
    run.set_tag(names.SLURM_JOB_IDS, ",".join(job_ids))
