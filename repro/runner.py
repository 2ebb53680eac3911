"""`repro run` from the parent's side, the front door: check, open the run's record, start its job.

The parts, one role each, are in repro.run (its docstring lists them). Nothing is lost when a run
fails: events are delivered as they are written, the job's output is kept in the run folder, and
the MLflow run ends FAILED with the last lines of that output (repro.run.follower).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from repro import registry
from repro.data import Verified
from repro.deferred import DeferredRun
from repro.recipe import Recipe
from repro.run import executors, lifecycle, preflight
from repro.run.executors.base import DRY_RUN_DIR, Executor
from repro.run.follower import follow
from repro.run.options import Launch, Result
from repro.run.progress import Progress
from repro.runfiles import RunFolder


def check_machine(recipe: Recipe, options: Launch) -> Executor:
    """The framework is installed here, the launching options fit, the devices exist: the executor to start with."""
    registry.available(recipe.run.framework)  # unavailable frameworks fail before anything starts
    preflight.check_nodes(recipe, options)
    executor = executors.for_launch(recipe, options)
    executor.check()
    return executor


def execute(
    recipe: Recipe, uri: str, experiment: str, options: Launch = Launch(), echo: Callable[[str], None] = print,
    progress: bool = True,
) -> Result:
    """Check everything (all a dry run does), then start the run, new or resumed, and follow it to its end."""
    executor = check_machine(recipe, options)
    data: Verified = preflight.check_data(recipe)
    if options.dry_run:
        echo(executor.dry_run(data.root, uri))
        return Result(0, None, DRY_RUN_DIR)
    shown = Progress(sys.stderr) if progress else None
    if not executor.records_run:
        return executor.start(RunFolder(options.run_dir.resolve()), None, echo, shown)
    with executor.running():
        if options.resume:
            folder, run = lifecycle.continue_run(recipe, options, executor.created_status)
            if run is None:
                echo(f"{folder.path}: the run is complete (MLflow run {folder.read_spec().mlflow_run_id}, "
                     f"{recipe.train.epochs} epochs); nothing to resume; to train longer: --resume {folder.path} --epochs N")
                return Result(0, None, folder.path)
        else:
            folder, run = lifecycle.new_run(recipe, options, uri, experiment, data, executor.created_status)
        if isinstance(run, DeferredRun):
            echo(f"repro: {run.reason}; the run goes on and is recorded in MLflow when the server answers "
                 f"(delivery tries while the job runs; after it: repro sync {folder.path})")
        return executor.start(folder, run, echo, shown)


def attach(run_dir: Path, command: list[str], echo: Callable[[str], None] = print) -> int:
    """Run `command` (the job steps) and follow its events into the run recorded in `run_dir`: a Slurm batch step."""
    return follow(command, RunFolder(run_dir), echo, Progress(sys.stderr))[0]
