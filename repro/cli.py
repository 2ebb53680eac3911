"""`repro`: re-run the paper's comparison of parallel deep-learning frameworks.

This module imports neither torch nor any framework at import time, so `repro --help` is instant.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from repro import registry
from repro.cli_base import MODELS, SCALES, OneLineErrors, fail
from repro.cli_matrix import calibrate, convergence, parity, predict, table2

if TYPE_CHECKING:
    from repro.recipe import Recipe


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Re-run the experiments of "A Survey and Empirical Evaluation of Parallel Deep
    Learning Frameworks" (Nichols et al., 2021) with checksummed data, fixed seeds and
    every run recorded in MLflow.

    \b
    Start here:
      repro data prepare digits            make the smoke image set
      repro run vgg16 --framework ddp --gpus 2 --max-steps 20
      repro list                           models, frameworks, recipes
      repro doctor                         versions, devices, data
    """


@main.command()
@click.argument("model", type=click.Choice(MODELS))
@click.option("--framework", "-f", default="ddp", show_default=True, help="Framework; `repro list` shows them.")
@click.option("--gpus", type=int, default=1, show_default=True,
              help="Total GPUs of the run (the paper's GPU count); on a CPU-only machine each is one process.")
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes; GPUs are spread evenly over them.")
@click.option("--scale", type=click.Choice(SCALES), default="smoke", show_default=True,
              help="smoke: tiny models and data on a laptop CPU; paper: the paper's models and data.")
@click.option("--recipe", "recipe_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Recipe file to use instead of configs/MODEL-SCALE.yaml.")
@click.option("--seed", type=int, help="Master seed (default: the recipe's).")
@click.option("--epochs", type=int, help="Epochs (default: the recipe's).")
@click.option("--max-steps", type=int, help="Stop after this many optimizer steps in total.")
@click.option("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
@click.option("--experiment", default="repro", show_default=True, help="MLflow experiment name.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe field, e.g. --set train.batch_per_gpu=8 --set zero.stage=3.")
@click.option("--allow-unverified", is_flag=True, help="Run on data that fails verification (recorded on the run).")
@click.option("--dry-run", is_flag=True,
              help="Resolve and check everything, print the launch command (or batch script), run nothing.")
@click.option("--launcher", type=click.Choice(("local", "slurm")), default="local", show_default=True,
              help="local: torchrun on this machine (one node of the job); slurm: write and submit an sbatch script.")
@click.option("--resume", is_flag=False, flag_value="latest", metavar="[RUN_DIR]",
              help="Continue a stopped run from its last checkpoint, in the same MLflow run "
                   "(alone: the newest run folder of this recipe).")
@click.option("--image", help="Apptainer image the SLURM job's workers run in (apptainer exec --nv IMAGE).")
@click.option("--time", "time_limit",
              help="SLURM time limit, e.g. 04:00:00 (ranks save and stop 2 minutes before; half a limit under 4 minutes).")
@click.option("--partition", help="SLURM partition.")
@click.option("--node-rank", type=int, default=0, show_default=True,
              help="Without SLURM, this machine's place in a job of --nodes N; only node 0 records the run.")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Without SLURM, the first node's rendezvous address.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Run folder (default: a new one under runs/); a job of several nodes needs one they share.")
@click.option("--ignore-memory-check", "ignore_memory", is_flag=True,
              help="Launch even where the cost model predicts more memory per GPU than the devices have "
                   "(recorded on the run as the tag repro.ignored_memory_check).")
@click.option("--oversubscribe", is_flag=True,
              help="Start more CPU processes than 2 per core on a machine without GPUs (refused otherwise).")
def run(model: str, framework: str, gpus: int, nodes: int, scale: str, recipe_file: Path | None, seed: int | None,
        epochs: int | None, max_steps: int | None, tracking_uri: str | None, experiment: str,
        overrides: tuple[str, ...], allow_unverified: bool, dry_run: bool, launcher: str, resume: str | None,
        image: str | None, time_limit: str | None, partition: str | None, node_rank: int,
        rdzv_endpoint: str | None, run_dir: Path | None, oversubscribe: bool, ignore_memory: bool) -> None:
    """Train MODEL (vgg16 or gpt2) with one framework and record the run in MLflow.

    \b
    Examples:
      repro run gpt2 --framework ddp --gpus 2 --max-steps 20
      repro run gpt2 --framework zero --gpus 8 --scale paper --set zero.stage=3
      repro run vgg16 --framework torchgpipe --gpus 4 --dry-run
      repro run gpt2 --framework zero --gpus 64 --nodes 16 --scale paper --launcher slurm --image repro.sif
      repro run gpt2 --framework ddp --gpus 2 --max-steps 20 --resume
    """
    from repro import recipe as recipes
    from repro import runner, tracking
    from repro.data import DataError
    from repro.run.options import Launch, LaunchError
    from repro.schema import RecipeError

    try:
        registry.framework(framework)
        flags = {f"run.framework={framework}": f"--framework {framework}", f"run.gpus={gpus}": f"--gpus {gpus}",
                 f"run.nodes={nodes}": f"--nodes {nodes}"}  # recipe fields the options set, for error messages
        given = {"seed": seed, "train.epochs": epochs, "train.max_steps": max_steps}
        flags |= {f"{key}={value}": f"--{key.split('.')[-1].replace('_', '-')} {value}"
                  for key, value in given.items() if value is not None}
        flags |= {"run.allow_unverified=true": "--allow-unverified"} if allow_unverified else {}
        path = recipe_file or recipes.recipe_path(model, scale)
        resolved = recipes.load_file(path, [*flags, *overrides], flags)
        if resolved.workload != model:
            fail(f"{path}: workload: the recipe is for {resolved.workload!r}, not {model!r}")
        options = Launch(launcher, node_rank, rdzv_endpoint, run_dir, resume, image, time_limit, partition,
                         dry_run, oversubscribe, ignore_memory)
        outcome = runner.execute(resolved, tracking.tracking_uri(tracking_uri), experiment, options)
    except (RecipeError, DataError, registry.UnknownName, registry.Unavailable, LaunchError) as error:
        fail(str(error))
    if outcome.status == "KILLED":
        fail(f"run stopped; output kept in {outcome.run_dir}; continue it with --resume {outcome.run_dir}",
             outcome.returncode or 1)
    if outcome.returncode:
        fail(f"run ended with exit code {outcome.returncode}; output kept in {outcome.run_dir}", outcome.returncode)
    if launcher == "local" and outcome.run_id:
        click.echo(f"run {outcome.run_id} finished; files in {outcome.run_dir}", err=True)
        if not dry_run:
            check_step_time(resolved, outcome.run_dir, tracking.tracking_uri(tracking_uri), experiment)
    elif launcher == "local" and outcome.status:  # it trained while MLflow did not answer (repro.deferred)
        click.echo(f"run finished, not in MLflow yet (repro sync {outcome.run_dir}); files in {outcome.run_dir}", err=True)


def check_step_time(recipe: Recipe, run_dir: Path, uri: str, experiment: str) -> None:
    """The finished run's step-time check, once MLflow holds all of it: a run left for `repro sync`, or a
    server gone since, skips it (one line) and keeps its exit status."""
    from repro import tracking
    from repro.delivery import State
    from repro.report.model_check import check_run

    if State.load(run_dir).undelivered is not None:
        click.echo(f"step-time check skipped: MLflow does not hold the whole run yet (repro sync {run_dir})", err=True)
        return
    try:
        verdict = check_run(recipe, uri, experiment)
    except Exception as error:
        if not tracking.server_unanswered(error):
            raise
        click.echo(f"step-time check skipped: MLflow did not answer ({type(error).__name__})", err=True)
        return
    if verdict:
        click.echo(verdict, err=True)


@main.command(hidden=True, context_settings={"ignore_unknown_options": True})
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def attach(run_dir: Path, command: tuple[str, ...]) -> None:
    """Run COMMAND (a job's steps) and record it in RUN_DIR's MLflow run: the SLURM batch script's follower."""
    from repro import runner

    sys.exit(runner.attach(run_dir, list(command)))


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True, path_type=Path))
def sync(run_dirs: tuple[Path, ...]) -> None:
    """Deliver to MLflow what RUN_DIRS hold and their MLflow runs miss (after a server outage, say).

    \b
    Each run folder remembers how far delivery got (RUN_DIR/delivery.json); sync resumes there,
    and running it twice logs nothing twice. A run whose job has ended is ended in MLflow too.
      repro sync runs/gpt2-ddp-1gpu-*
    """
    from repro.delivery import Delivery

    failed = 0
    for run_dir in run_dirs:
        delivery = Delivery(run_dir)
        try:
            ended = delivery.deliver()
        except Exception as error:  # the server is away again: say what is left, the next sync resumes
            delivery.record_undelivered(error)
            click.echo(f"{run_dir}: {delivery.state.undelivered}", err=True)
            failed += 1
            continue
        state = delivery.state
        end = f"ended {state.ended}" if ended else "no end recorded yet (the job runs, or see `repro settle`)"
        click.echo(f"{run_dir}: {state.events_delivered} events ({state.points_delivered} metric points), "
                   f"{len(state.files)} files delivered; {end}")
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("run_dirs", nargs=-1, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
@click.option("--stale-after", type=float, default=120, show_default=True, metavar="SECONDS",
              help="A run folder whose heartbeat is this old, with no live follower or Slurm job, has lost its job.")
def settle(run_dirs: tuple[Path, ...], tracking_uri: str | None, stale_after: float) -> None:
    """End the RUNNING and SCHEDULED MLflow runs whose job is gone, from their run folders' events.

    \b
    Without RUN_DIRS: every such run of the store (its folder is the tag repro.run_dir). A job is
    gone when its heartbeat is stale, its follower no longer runs and Slurm no longer has it; the
    events then say FINISHED, KILLED or FAILED, and the reason is the tag repro.settled.
      repro settle --tracking-uri http://127.0.0.1:5000
    """
    from repro import settle as settling
    from repro import tracking

    lines = settling.settle(tracking.tracking_uri(tracking_uri), list(run_dirs), stale_after)
    click.echo("\n".join(lines) or "no RUNNING or SCHEDULED run to settle")


@main.command("list")
def list_() -> None:
    """Models, frameworks (and whether each can run here) and recipes."""
    from repro.recipe import SCALES, recipe_path

    click.echo("models:     " + ", ".join(MODELS))
    click.echo("frameworks:")
    width = max(map(len, registry.FRAMEWORKS))
    for name, entry in registry.FRAMEWORKS.items():
        absence = entry.absence()
        state = f"unavailable ({absence}: {entry.hint()})" if absence else "available"
        click.echo(f"  {name:<{width}} {entry.parallelism:<32} {state}")
    click.echo("recipes:")
    for path in (recipe_path(model, scale) for model in MODELS for scale in SCALES):
        if path.is_file():
            click.echo(f"  {path}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--build-ops", is_flag=True,
              help="Instead, build now what a framework's first CPU run would build as it starts (DeepSpeed's "
                   "shared-memory op, once per Python environment); `make setup` runs this.")
def doctor(as_json: bool, build_ops: bool) -> None:
    """Versions of torch, CUDA, NCCL and each framework; devices; data presence."""
    if build_ops:
        from repro.run.extensions import build_cpu_extensions

        build_cpu_extensions(click.echo)
        return
    from repro import doctor as doc

    report = doc.report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if isinstance(value, dict):
            click.echo(f"{key}:")
            for sub, item in value.items():
                click.echo(f"  {sub:<14} {item}")
        else:
            click.echo(f"{key:<16} {value}")


@main.group()
def data() -> None:
    """Prepare and verify the checksummed datasets (digits, wikitext-2, wikitext-103, imagenet)."""


@data.command()
@click.argument("name")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write it (default: $REPRO_DATA, else ./data).")
def prepare(name: str, root: Path | None) -> None:
    """Make or fetch dataset NAME and check it against its manifest."""
    from repro.data import DataError, data_root
    from repro.data.sets import prepare as prepare_dataset

    try:
        path = prepare_dataset(name, root or data_root())
    except DataError as error:
        fail(str(error))
    click.echo(f"{name}: ready at {path}")


@data.command()
@click.argument("name")
@click.option("--deep", is_flag=True,
              help="Rehash every file, ignoring the cache of hashes (kept per size, mtime, ctime, inode and device).")
def verify(name: str, deep: bool) -> None:
    """Check dataset NAME against its manifest; exit 1 naming the first bad file."""
    from repro.data import DataError
    from repro.data.sets import dataset

    try:
        verified = dataset(name).verify(deep=deep)
    except DataError as error:
        fail(str(error), 1)
    click.echo(f"{name}: ok ({verified.root}, sha256 {verified.sha256}; {verified.check})")


for command in (table2, parity, convergence, predict, calibrate):
    main.add_command(command)


if __name__ == "__main__":
    main()
