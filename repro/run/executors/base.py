"""The executor interface: where and how a run's job starts, one class per launcher.

Every executor answers the same four questions, so the front door (repro.runner) never asks which
launcher it has: are the launching options and this node fit (`check`), what starts the job
(`command`), what --dry-run shows (`dry_run`), and start it (`start`). Two class attributes say how
the run's record is kept: the MLflow run's status while the job has not started yet, and whether
this process keeps a record at all (a node joining another's job does not).
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

from repro import tracking
from repro.recipe import Recipe
from repro.run.options import Launch, Outcome
from repro.run.progress import Progress


class Executor(ABC):
    created_status = "RUNNING"  # of the MLflow run when it is created or reopened, before the job starts
    records_run = True  # whether this process creates (or reopens) the MLflow run and follows the job into it

    def __init__(self, recipe: Recipe, options: Launch):
        self.recipe, self.options = recipe, options

    @classmethod
    @abstractmethod
    def fits(cls, recipe: Recipe, options: Launch) -> bool:
        """Whether this executor starts the jobs of `recipe` launched with `options`."""

    @abstractmethod
    def check(self) -> None:
        """The launching options work together and this node can start the job; raises LaunchError."""

    @abstractmethod
    def command(self, run_dir: Path) -> list[str]:
        """The command line that starts the job of the run in `run_dir`."""

    @abstractmethod
    def dry_run(self, data_dir: Path, tracking_uri: str) -> str:
        """What --dry-run prints: the job as it would start, with RUN_DIR for the run folder."""

    def running(self) -> contextlib.AbstractContextManager:
        """Held from before the run's record is made until its job has ended: what the executor keeps
        for the job meanwhile (a warm launcher, importing while MLflow is set up)."""
        return contextlib.nullcontext()

    @abstractmethod
    def start(self, run_dir: Path, run: tracking.Run | None, spec: dict | None, echo: Callable[[str], None],
              progress: Progress | None) -> Outcome:
        """Start the job of the run in `run_dir` (recorded in `run`, described by `spec`, run.json)."""


DRY_RUN_DIR = Path("RUN_DIR")  # the run folder as --dry-run shows it
