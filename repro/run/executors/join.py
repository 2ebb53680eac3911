"""A node other than the first of a job without Slurm: its torchrun joins the first node's rendezvous
in the shared run folder; it records nothing in MLflow (the first node's follower does)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from repro import tracking
from repro.run.executors.local import LocalExecutor
from repro.run.lifecycle import refuse_if_different
from repro.recipe import Recipe
from repro.run.options import Launch, LaunchError, Outcome
from repro.run.progress import Progress
from repro.run.supervision import POLL_S, Job
from repro.runfiles import RUN_FILE

SPEC_WAIT_S = 120  # how long a node other than the first waits for the run folder to appear


class JoinExecutor(LocalExecutor):
    records_run = False

    @classmethod
    def fits(cls, recipe: Recipe, options: Launch) -> bool:
        return options.launcher == "local" and options.node_rank > 0

    def start(self, run_dir: Path, run: tracking.Run | None, spec: dict | None, echo: Callable[[str], None],
              progress: Progress | None) -> Outcome:
        """Wait for the first node's run folder, then run this node's launcher in it to the end."""
        deadline = time.monotonic() + SPEC_WAIT_S
        while not (run_dir / RUN_FILE).exists():
            if time.monotonic() > deadline:
                raise LaunchError(f"--node-rank {self.options.node_rank}: the first node made no run in {run_dir} "
                                  f"within {SPEC_WAIT_S} s")
            time.sleep(POLL_S)
        refuse_if_different(self.recipe, run_dir)
        job = Job(self.command(run_dir), run_dir / f"output-node{self.options.node_rank}.log", echo)
        return Outcome(job.run_to_end(), None, run_dir)
