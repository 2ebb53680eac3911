"""What `repro run` is asked to do (its launching options) and what came of it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from repro import registry

if TYPE_CHECKING:
    from repro.warm.client import Launcher


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
    warm: Launcher | None = None  # a warm launcher kept across runs (repro table2) for CPU stand-in ranks


@dataclass
class Outcome:
    returncode: int
    run_id: str | None  # None: nothing ran (a dry run, or --resume of a complete run)
    run_dir: Path
    status: str | None = None  # the MLflow run's end status, where this process recorded it
