"""Executors, one per launcher, behind one interface (base.Executor); `for_launch` picks one.

To add one: a module here with a subclass of Executor, and its class in EXECUTORS before any that
would also take its launches (the first whose `fits` says yes starts the job)."""
from __future__ import annotations

from repro.recipe import Recipe
from repro.run.executors.base import Executor
from repro.run.executors.join import JoinExecutor
from repro.run.executors.local import LocalExecutor
from repro.run.executors.slurm import SlurmExecutor
from repro.run.executors.warm import WarmExecutor
from repro.run.options import Launch

EXECUTORS: tuple[type[Executor], ...] = (SlurmExecutor, JoinExecutor, WarmExecutor, LocalExecutor)


def for_launch(recipe: Recipe, options: Launch) -> Executor:
    """The executor that starts jobs launched with `options`."""
    executor = next(cls for cls in EXECUTORS if cls.fits(recipe, options))
    return executor(recipe, options)
