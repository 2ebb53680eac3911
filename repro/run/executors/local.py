"""torchrun on this machine: the job of a run of one node, or the first node of a job of several."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from repro import registry, tracking
from repro.run import preflight
from repro.run.executors.base import DRY_RUN_DIR, Executor
from repro.run.follower import follow
from repro.recipe import Recipe
from repro.run.options import Launch, Result
from repro.run.progress import Progress
from repro.runfiles import RunFolder


class LocalExecutor(Executor):
    @classmethod
    def fits(cls, recipe: Recipe, options: Launch) -> bool:
        return options.launcher == "local"

    def check(self) -> None:
        preflight.check_local_options(self.recipe, self.options)
        preflight.check_devices(self.recipe, self.options)
        preflight.check_memory(self.recipe, self.options)

    def command(self, run_dir: Path) -> list[str]:
        """The framework's launch line (torchrun of repro.loop, unless its plan says otherwise)."""
        return registry.plan_class(self.recipe.run.framework).command(self.recipe, run_dir, self.options.rdzv_endpoint)

    def dry_run(self, data_dir: Path, tracking_uri: str) -> str:
        return " ".join(self.command(DRY_RUN_DIR))

    def start(self, folder: RunFolder, run: tracking.Run | None, echo: Callable[[str], None],
              progress: Progress | None) -> Result:
        """Run the job here and follow it into the MLflow run until it ends."""
        returncode, status = follow(self.command(folder.path), folder, echo, progress)
        return Result(returncode, folder.read_spec().mlflow_run_id, folder.path, status)  # delivery may have made it
