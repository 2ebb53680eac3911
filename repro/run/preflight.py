"""The checks before anything starts, and all that --dry-run does: each fails in one line that says what to do.

Checks that hold for every launcher live here as functions; which of the launcher-specific ones
apply is each executor's `check` (repro.run.executors)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from repro import hardware, launch, registry
from repro.data import DataError, Verified
from repro.data.sets import dataset
from repro.recipe import Recipe, batch_too_big
from repro.run.extensions import check_extension_build, installed_prebuilt
from repro.run.options import Launch, LaunchError
from repro.schema import RecipeError

if TYPE_CHECKING:
    from repro.model.terms import Cell

CPU_PROCESSES_PER_CORE = 2  # stand-in GPUs per core before a run must ask for --oversubscribe


def verify_data(recipe: Recipe) -> Verified:
    """The verified data; refuses to run on missing or mismatching data unless allowed."""
    spec = dataset(recipe.data.dataset)
    try:
        return spec.verify()
    except DataError as error:
        if not recipe.run.allow_unverified:
            raise
        return Verified(spec.locate(), "unverified", f"none: --allow-unverified ({error})")


def check_data(recipe: Recipe) -> Verified:
    """The data verifies (unless allowed not to) and holds at least one global batch."""
    data = verify_data(recipe)
    check_data_size(recipe, data.root)
    return data


def check_data_size(recipe: Recipe, data_dir: Path) -> None:
    """The training split holds at least one global batch, so every epoch has a step."""
    samples = registry.workload_plan(recipe.workload).train_samples(recipe, data_dir)
    batch = registry.plan_class(recipe.run.framework).global_batch(recipe)
    if batch > samples:
        why = f"at most, in {recipe.data.dataset}"
        raise RecipeError(str(data_dir), "train.batch_per_gpu", batch_too_big(recipe, batch, samples, why))


def check_nodes(recipe: Recipe, options: Launch) -> None:
    """The processes spread evenly over the nodes, and --node-rank names one of them."""
    nodes = recipe.run.nodes
    processes = registry.plan_class(recipe.run.framework).processes(recipe)
    if processes % nodes:
        raise LaunchError(f"--nodes {nodes}: {processes} processes do not spread evenly over {nodes} nodes")
    if not 0 <= options.node_rank < nodes:
        raise LaunchError(f"--node-rank {options.node_rank}: must be between 0 and nodes - 1 = {nodes - 1}")


def check_local_options(recipe: Recipe, options: Launch) -> None:
    """A job of several nodes without Slurm: every node names the same rendezvous and run folder."""
    nodes = recipe.run.nodes
    if nodes > 1 and not (options.rdzv_endpoint and options.run_dir):
        raise LaunchError(
            f"--nodes {nodes} with the local launcher: start `repro run` on every node with the same "
            "--rdzv-endpoint HOST:PORT (the first node's) and --run-dir (a shared folder), and --node-rank 0.."
            f"{nodes - 1}; or use --launcher slurm"
        )
    if nodes == 1 and (options.rdzv_endpoint or options.node_rank):
        raise LaunchError("--rdzv-endpoint and --node-rank are for jobs of several nodes (--nodes N)")


def check_slurm_options(options: Launch) -> None:
    """Slurm starts every node itself, takes a time limit it can read, and is reachable by sbatch."""
    if options.node_rank or options.rdzv_endpoint:
        raise LaunchError("--launcher slurm starts every node itself; drop --node-rank and --rdzv-endpoint")
    if options.time:
        try:
            launch.time_limit_s(options.time)
        except ValueError as error:
            raise LaunchError(f"--time: {error}") from None
    if not options.dry_run and shutil.which("sbatch") is None:
        raise LaunchError("--launcher slurm: no sbatch on PATH; submit from a node of the cluster "
                          "(or load its Slurm module), or preview the script with --dry-run")


def check_devices(recipe: Recipe, options: Launch) -> None:
    """This node has the GPUs the run needs, or cores for the CPU processes standing in for them.

    Explicit `run.device: cuda` and paper-scale recipes need one GPU per GPU of the run; a smoke run
    on `auto` may share fewer GPUs."""
    run, gpus_here = recipe.run, hardware.gpu_count()
    needed = run.gpus // run.nodes
    strict = run.device == "cuda" or (run.device == "auto" and recipe.scale == "paper")
    if strict and gpus_here < needed:
        raise LaunchError(
            f"run.gpus: needs {needed} GPU{'s' if needed > 1 else ''}{' per node' if run.nodes > 1 else ''}, this machine has {gpus_here}: "
            "use --launcher slurm" + ("" if run.device == "cuda" else ", or --set run.device=cpu for CPU processes"))
    if run.device == "cuda" or (run.device == "auto" and gpus_here):
        return
    plan = registry.plan_class(run.framework)
    if plan.cpu_extension and not installed_prebuilt(plan.cpu_extension):
        check_extension_build(run.framework)
    check_cpu_precision(recipe)
    processes = plan.processes(recipe) // run.nodes
    cores = hardware.cpu_cores()
    if processes > CPU_PROCESSES_PER_CORE * cores and not options.oversubscribe:
        raise LaunchError(
            f"run.gpus: {processes} CPU processes stand in for GPUs here, but this machine has {cores} cores and no "
            f"GPU (at most {CPU_PROCESSES_PER_CORE} x {cores} = {CPU_PROCESSES_PER_CORE * cores} processes): "
            "use fewer --gpus, --launcher slurm, or --oversubscribe")


def check_cpu_precision(recipe: Recipe) -> None:
    """CPU stand-ins train the recipe's precision: fp16 under a framework that refuses it on a CPU that computes
    no fp16 is refused here, in one line, rather than by every rank as it starts."""
    framework = recipe.run.framework
    because = registry.plan_class(framework).cpu_fp16_refused_because
    if recipe.train.precision == "fp16" and because and not hardware.cpu_computes_fp16():
        raise LaunchError(f"train.precision: fp16 under {framework} on CPU stand-ins, and this CPU "
                          f"({hardware.cpu_model()}) computes no fp16: {because}; set train.precision to bf16 "
                          "or fp32, or run on GPUs")


def check_memory(recipe: Recipe, options: Launch) -> None:
    """The memory the cost model predicts per GPU fits this node's devices: a GPU's memory, or the RAM
    that the CPU processes standing in for its GPUs share."""
    if options.ignore_memory:
        return
    from repro.model import costs

    on_gpu = recipe.run.device == "cuda" or (recipe.run.device == "auto" and hardware.gpu_count())
    try:
        cell = costs.cell_of(recipe, capability=hardware.gpu_capability() if on_gpu else None)
        predicted = costs.predict(cell)
    except KeyError:  # no model for this framework or workload: nothing to check against
        return
    per_gpu = predicted.fit_bytes
    gpus = recipe.run.gpus // recipe.run.nodes
    need, have = (per_gpu, hardware.gpu_memory_bytes()) if on_gpu else (per_gpu * gpus, hardware.memory_gb() * 2**30)
    if need > have:
        standing_in = "" if on_gpu else f" x {gpus} CPU stand-in{'s' if gpus > 1 else ''} = {gib(need)}"
        raise LaunchError(
            f"memory: predicted {gib(per_gpu)} per GPU ({recipe.run.framework}, repro.model.costs){standing_in}, over "
            f"this machine's {'GPU memory' if on_gpu else 'RAM'}, {gib(have)}{what_fits(cell, have / (1 if on_gpu else gpus))}; "
            "--ignore-memory-check to launch anyway")


def what_fits(cell: Cell, capacity: float) -> str:
    """"; --set ... fits (X GiB per GPU)" where a memory setting the framework applies brings the predicted
    peak per GPU within `capacity` bytes (repro.model.predict.fit, as `repro predict --fit` chooses), else ""."""
    from repro.model.predict import fit

    chosen = fit(cell, capacity)
    return f"; {chosen.setting()} fits ({gib(chosen.peak)} per GPU)" if chosen.sets else ""


def gib(size: float) -> str:
    return f"{size / 2**30:,.1f} GiB"
