"""Slurm: the run's job as a batch script in its run folder, handed to sbatch.

The script's batch step runs the follower (`repro attach`), which marks the run RUNNING and follows
the job's steps into it; until then the run stays SCHEDULED, and `repro settle` ends it if the job
goes without starting. Every job of the run (the first and each resume) is kept, in order, in
RUN_DIR/run.json and the tag repro.slurm_job_ids; repro.slurm_job_id names the latest.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

from repro import delivery, launch, registry, slurm, tracking
from repro.run import preflight, record
from repro.run.executors.base import DRY_RUN_DIR, Executor
from repro.recipe import Recipe
from repro.run.options import Launch, LaunchError, Result
from repro.run.progress import Progress
from repro.runfiles import Outcome, RunFolder


class SlurmExecutor(Executor):
    created_status = "SCHEDULED"  # the job waits in Slurm's queue; its follower marks the run RUNNING

    @classmethod
    def fits(cls, recipe: Recipe, options: Launch) -> bool:
        return options.launcher == "slurm"

    def check(self) -> None:
        """Slurm allocates the devices: only the options are checked here."""
        preflight.check_slurm_options(self.options)

    def job(self, run_dir: Path, data_dir: Path, tracking_uri: str) -> launch.SlurmJob:
        recipe, options = self.recipe, self.options
        processes = registry.plan_class(recipe.run.framework).processes(recipe)
        nodes = recipe.run.nodes
        gpus_per_node = recipe.run.gpus // nodes if cluster_has_gpus(options.partition, options.dry_run) else 0
        return launch.SlurmJob(
            name=recipe.run_name(), nodes=nodes, gpus_per_node=gpus_per_node,
            processes_per_node=processes // nodes, run_dir=run_dir, data_root=data_dir.parent,
            tracking_uri=tracking_uri, python=sys.executable, image=options.image, time=options.time,
            partition=options.partition,
        )

    def command(self, run_dir: Path) -> list[str]:
        return ["sbatch", "--parsable", str(RunFolder(run_dir).job_script)]

    def dry_run(self, data_dir: Path, tracking_uri: str) -> str:
        return launch.sbatch_script(self.job(DRY_RUN_DIR, data_dir, tracking_uri))

    def start(self, folder: RunFolder, run: tracking.Run | None, echo: Callable[[str], None],
              progress: Progress | None) -> Result:
        """Write the batch script into the run folder and submit it; the job's follower logs the run."""
        spec, script = folder.read_spec(), folder.job_script
        script.write_text(launch.sbatch_script(self.job(folder.path, Path(spec.data_dir), spec.tracking_uri)))
        run.log_artifact(script)
        submitted = subprocess.run(self.command(folder.path), capture_output=True, text=True)
        if submitted.returncode:
            folder.write_outcome(Outcome("FAILED", f"sbatch failed: {submitted.stderr.strip()}"))
            delivery.Delivery(folder.path).deliver()
            raise LaunchError(f"sbatch {script} failed: {submitted.stderr.strip()}")
        job_id = submitted.stdout.strip().split(";")[0]  # --parsable: "JOBID" or "JOBID;CLUSTER"
        spec.slurm_job_ids.append(job_id)  # the last is the job `repro settle` asks Slurm about
        folder.write_spec(spec)
        record.mark_submitted(run, spec.slurm_job_ids)
        echo(f"submitted SLURM job {job_id}; output in {folder.path}/slurm-{job_id}.out")
        return Result(0, run.run_id, folder.path)


def cluster_has_gpus(partition: str | None, dry_run: bool) -> bool:
    """Whether the job's nodes have GPUs; a --dry-run away from a cluster shows the GPU form."""
    try:
        return slurm.partition_has_gpus(partition)
    except slurm.SlurmUnreachable as error:
        if dry_run:
            return True
        raise LaunchError(f"--launcher slurm: {error}") from None
