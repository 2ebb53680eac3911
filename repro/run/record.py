"""The MLflow run of a run, as the parent writes it: tags and params at the start, reopened on resume.

What the job then does reaches the run through its folder (repro.delivery); how it ended, through
the follower's outcome. A server that does not answer does not stop the run: these calls are kept in
the folder and made by delivery once it answers (repro.deferred). The tags a run's end records are listed here, because a resumed run starts
without them.
"""
from __future__ import annotations

from pathlib import Path

from repro import deferred, doctor, registry, tracking
from repro.checkpoint import Position
from repro.data import Verified
from repro.deferred import DeferredRun
from repro.recipe import Recipe

# what a run's end records about that end; a resumed run starts without them
END_TAGS = ("repro.error", "repro.interrupted", "repro.failed_rank", "repro.settled")


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


def create(recipe: Recipe, uri: str, experiment: str, data: Verified, run_dir: Path, status: str,
           ignore_memory: bool) -> tracking.Run | DeferredRun:
    """A new MLflow run: the recipe's tags and params, the data as its input, in `status`; while the server
    does not answer, its creation kept in the run folder for delivery to make (repro.deferred)."""
    dataset_input = (recipe.data.dataset, data.sha256, str(data.root.resolve()))
    return deferred.create_or_defer(run_dir, uri, experiment, recipe.run_name(),
                                    run_tags(recipe, data, run_dir, ignore_memory), run_params(recipe), dataset_input, status)


def log_inputs(run: tracking.Run, recipe_file: Path) -> None:
    """What the run starts from: the resolved recipe, the environment and the installed packages."""
    run.log_artifact(recipe_file)
    run.log_dict(doctor.report(), "environment.json")
    run.log_dict(doctor.packages(), "packages.json")


def reopen(uri: str, run_id: str | None, status: str, run_dir: Path) -> tracking.Run | DeferredRun:
    """A stopped run, in `status` again, without the tags of its last end (kept for later, in order, while
    the server does not answer or calls of an earlier outage wait: repro.deferred)."""
    run = deferred.reopen_or_defer(run_dir, uri, run_id, status)
    run.delete_tags(END_TAGS)
    return run


def mark_resumed(run: tracking.Run, position: Position) -> None:
    run.set_tag("repro.resumed", "true")
    run.set_tag("repro.resumed_from_step", str(position.step))


def mark_extended(run: tracking.Run, recipe: Recipe, epochs: int, at: Position, recipe_file: Path) -> None:
    """MLflow keeps the first value of a param, so the tags say what the run became."""
    run.set_tag("repro.extended", f"train.epochs {epochs} -> {recipe.train.epochs} at step {at.step}")
    run.set_tag(f"{tracking.TAG_PREFIX}recipe_sha256", recipe.fingerprint())
    run.log_artifact(recipe_file)


def mark_submitted(run: tracking.Run, job_ids: list[str]) -> None:
    """The Slurm jobs of the run, in order; repro.slurm_job_id names the latest."""
    run.set_tag("repro.slurm_job_id", job_ids[-1])
    run.set_tag("repro.slurm_job_ids", ",".join(job_ids))
