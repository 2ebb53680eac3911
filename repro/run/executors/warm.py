"""CPU stand-in ranks on this node, started warm (docs/launch.md): forked from a warm launcher's fork
server (repro.warm), which `repro table2` keeps for the whole matrix (Launch.warm) and a run of several
processes starts for itself; a run of one process starts its one rank without any launcher process, before
the run's folder and MLflow record are made (repro.warm.primed), so that it imports meanwhile.

Runs whose ranks are not torchrun's workers of the loop on this node, on CPU (GPU runs, a framework
with its own runtime such as LBANN's driver) keep torchrun: LocalExecutor.
"""
from __future__ import annotations

import contextlib
import functools
import subprocess
from pathlib import Path
from typing import Callable, Iterator

from repro import hardware, launch, registry, tracking
from repro.recipe import Recipe
from repro.run.executors.base import DRY_RUN_DIR
from repro.run.executors.local import LocalExecutor
from repro.run.follower import follow
from repro.run.options import Launch, Result
from repro.run.progress import Progress
from repro.run.supervision import LauncherProcess
from repro.runfiles import RunFolder
from repro.warm import plan
from repro.warm.client import Launcher

CHANNEL_SHOWN = 3  # the launcher's end of its channel as --dry-run shows it (the real one is known at start)


def stand_in_ranks(recipe: Recipe, options: Launch) -> bool:
    """Whether the run's ranks would be torchrun's workers of the loop on this node, on CPU."""
    if options.launcher != "local" or options.node_rank:
        return False
    on_gpu = recipe.run.device == "cuda" or (recipe.run.device == "auto" and hardware.gpu_count())
    command = registry.plan_class(recipe.run.framework).command(recipe, DRY_RUN_DIR, options.rdzv_endpoint)
    return not on_gpu and plan.runs_torchrun_of_the_loop(recipe, command, DRY_RUN_DIR)


class WarmExecutor(LocalExecutor):
    def __init__(self, recipe: Recipe, options: Launch):
        super().__init__(recipe, options)
        self.processes = registry.plan_class(recipe.run.framework).processes(recipe)
        self.launcher: Launcher | None = options.warm
        self.primed: LauncherProcess | None = None

    @classmethod
    def fits(cls, recipe: Recipe, options: Launch) -> bool:
        return stand_in_ranks(recipe, options)

    def command(self, run_dir: Path) -> list[str]:
        if self.launcher is None and self.processes == 1:
            return launch.single_rank(run_dir)
        launcher = self.launcher.command if self.launcher else launch.warm_launcher(CHANNEL_SHOWN, self.preload())
        return launch.warm_job(launcher, plan.RANK_ENTRY, self.processes, run_dir)

    def preload(self) -> list[str]:
        return plan.preload([self.recipe])

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Started now, to import while the run's folder and MLflow record are made, and ended with the run:
        a launcher of the run's own for several ranks, or the one rank of a one-process run (primed)."""
        if self.launcher is not None:
            yield
        elif self.processes == 1:
            self.primed = LauncherProcess(launch.primed_single_rank(self.preload()), stdin=subprocess.PIPE)
            try:
                yield
            finally:  # ended here only if it never got its run folder (start hands it over)
                if self.primed.stdin and not self.primed.stdin.closed:
                    self.primed.kill()
                    self.primed.wait()
        else:
            with Launcher(self.preload()) as self.launcher:
                yield

    def hand_over(self, folder: RunFolder) -> LauncherProcess:
        """The primed rank, told its run folder."""
        assert self.primed.stdin is not None
        self.primed.stdin.write(f"{folder.path}\n")
        self.primed.stdin.close()
        return self.primed

    def start(self, folder: RunFolder, run: tracking.Run | None, echo: Callable[[str], None],
              progress: Progress | None) -> Result:
        start = None
        if self.launcher is not None:
            start = functools.partial(self.launcher.start, plan.RANK_ENTRY, self.processes, [str(folder.path)],
                                      folder.ranks_dir)
        elif self.primed is not None:
            start = functools.partial(self.hand_over, folder)
        returncode, status = follow(self.command(folder.path), folder, echo, progress, start)
        return Result(returncode, folder.read_spec().mlflow_run_id, folder.path, status)  # delivery may have made it
