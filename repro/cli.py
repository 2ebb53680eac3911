"""`repro`: re-run the paper's comparison of parallel deep-learning frameworks.

This module imports neither torch nor any framework at import time, so `repro --help` is instant.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from repro import registry

MODELS = tuple(registry.WORKLOADS)
SCALES = ("smoke", "paper")


def fail(message: str, code: int = 2) -> None:
    click.echo(f"repro: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option("--time", "time_limit", help="SLURM time limit, e.g. 04:00:00 (ranks save and stop 2 minutes before).")
@click.option("--partition", help="SLURM partition.")
@click.option("--node-rank", type=int, default=0, show_default=True,
              help="Without SLURM, this machine's place in a job of --nodes N; only node 0 records the run.")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Without SLURM, the first node's rendezvous address.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Run folder (default: a new one under runs/); a job of several nodes needs one they share.")
def run(model: str, framework: str, gpus: int, nodes: int, scale: str, recipe_file: Path | None, seed: int | None,
        epochs: int | None, max_steps: int | None, tracking_uri: str | None, experiment: str,
        overrides: tuple[str, ...], allow_unverified: bool, dry_run: bool, launcher: str, resume: str | None,
        image: str | None, time_limit: str | None, partition: str | None, node_rank: int,
        rdzv_endpoint: str | None, run_dir: Path | None) -> None:
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
    from repro.schema import RecipeError

    try:
        registry.framework(framework)
        cli_fields = [f"run.framework={framework}", f"run.gpus={gpus}", f"run.nodes={nodes}"]
        cli_fields += [f"seed={seed}"] * (seed is not None) + [f"train.epochs={epochs}"] * (epochs is not None)
        cli_fields += [f"train.max_steps={max_steps}"] * (max_steps is not None)
        cli_fields += ["run.allow_unverified=true"] * allow_unverified
        path = recipe_file or recipes.recipe_path(model, scale)
        resolved = recipes.load_file(path, [*cli_fields, *overrides])
        if resolved.workload != model:
            fail(f"{path}: workload: the recipe is for {resolved.workload!r}, not {model!r}")
        options = runner.Launch(launcher, node_rank, rdzv_endpoint, run_dir, resume, image, time_limit, partition, dry_run)
        outcome = runner.execute(resolved, tracking.tracking_uri(tracking_uri), experiment, options)
    except (RecipeError, DataError, registry.UnknownName, registry.Unavailable, runner.LaunchError) as error:
        fail(str(error))
    if outcome.status == "KILLED":
        fail(f"run stopped; output kept in {outcome.run_dir}; continue it with --resume {outcome.run_dir}",
             outcome.returncode or 1)
    if outcome.returncode:
        fail(f"run ended with exit code {outcome.returncode}; output kept in {outcome.run_dir}", outcome.returncode)
    if outcome.run_id and launcher == "local":
        click.echo(f"run {outcome.run_id} finished; files in {outcome.run_dir}", err=True)


@main.command(hidden=True, context_settings={"ignore_unknown_options": True})
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def attach(run_dir: Path, command: tuple[str, ...]) -> None:
    """Run COMMAND (a job's steps) and record it in RUN_DIR's MLflow run: the SLURM batch script's follower."""
    from repro import runner

    sys.exit(runner.attach(run_dir, list(command)))


@main.command()
@click.option("--scale", type=click.Choice(SCALES), default="smoke", show_default=True)
@click.option("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
@click.option("--experiment", help="MLflow experiment (default: table2-SCALE).")
@click.option("--reports", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"), show_default=True)
@click.option("--gpus-per-node", type=int, help="GPUs per node when spreading the paper's GPU counts over nodes.")
@click.option("--retry-failed", is_flag=True, help="Run again the cells whose last run failed.")
@click.option("--reports-only", is_flag=True, help="Write the reports from MLflow without running anything.")
@click.option("--rows", help="Comma-separated framework rows to keep (default: all rows of the matrix).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a field in every cell's recipe.")
def table2(scale: str, tracking_uri: str | None, experiment: str | None, reports: Path, gpus_per_node: int | None,
           retry_failed: bool, reports_only: bool, rows: str | None, overrides: tuple[str, ...]) -> None:
    """Re-run the paper's comparison matrix and write Table 2, figures and findings.

    \b
    Runs every cell (workload x framework x GPU count, configs/table2.yaml) that MLflow does not
    already hold for the same recipe fingerprint, so an interrupted matrix resumes and a second
    call only rebuilds reports/: table2_platforms.*, results.{md,csv,tex}, *.png, findings.md.
    """
    from repro import tracking
    from repro import table2 as matrix_module
    from repro.report.build import write_reports

    uri = tracking.tracking_uri(tracking_uri)
    experiment = experiment or f"table2-{scale}"
    try:
        matrix = matrix_module.load_matrix(rows=rows.split(",") if rows else None)
    except KeyError as error:
        fail(error.args[0])
    cells = matrix_module.expand(matrix, scale, list(overrides), gpus_per_node)
    if not reports_only:
        counts = matrix_module.run_matrix(cells, uri, experiment, retry_failed)
        click.echo(f"matrix: {counts['ran']} ran, {counts['failed']} failed, {counts['held']} already held, "
                   f"{counts['skipped']} skipped", err=True)
    for path in write_reports(cells, uri, experiment, reports, scale):
        click.echo(str(path))


@main.command("list")
def list_() -> None:
    """Models, frameworks (and whether each can run here) and recipes."""
    from repro.recipe import configs_dir

    click.echo("models:     " + ", ".join(MODELS))
    click.echo("frameworks:")
    width = max(map(len, registry.FRAMEWORKS))
    for name, entry in registry.FRAMEWORKS.items():
        missing = entry.missing()
        state = "available" if not missing else f"unavailable (missing {', '.join(missing)}: {entry.hint()})"
        click.echo(f"  {name:<{width}} {entry.parallelism:<32} {state}")
    click.echo("recipes:")
    for path in sorted(configs_dir().glob("*.yaml")):
        click.echo(f"  {path}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool) -> None:
    """Versions of torch, CUDA, NCCL and each framework; devices; data presence."""
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
@click.option("--deep", is_flag=True, help="Rehash every file, ignoring the (size, mtime) cache.")
def verify(name: str, deep: bool) -> None:
    """Check dataset NAME against its manifest; exit 1 naming the first bad file."""
    from repro.data import DataError
    from repro.data.sets import dataset

    try:
        path, digest = dataset(name).verify(deep=deep)
    except DataError as error:
        fail(str(error), 1)
    click.echo(f"{name}: ok ({path}, sha256 {digest})")


if __name__ == "__main__":
    main()
