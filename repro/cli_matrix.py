"""`repro table2`, `repro parity`, `repro convergence` and `repro predict`: the comparison matrix, its parity
section and convergence study, and the cost model's predictions, as commands (the work is in repro.table2,
repro.parity, repro.convergence, repro.model.predict)."""
from __future__ import annotations

from pathlib import Path

import click

from repro.cli_base import MODELS, SCALES, fail
from repro.hardware import GPU_MEMORY_GIB  # torch-free: the device table names --fit's choices


@click.command()
@click.option("--scale", type=click.Choice(SCALES), default="smoke", show_default=True)
@click.option("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
@click.option("--experiment", help="MLflow experiment (default: table2-SCALE).")
@click.option("--reports", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"), show_default=True)
@click.option("--gpus-per-node", type=int, help="GPUs per node when spreading the paper's GPU counts over nodes.")
@click.option("--retry-failed", is_flag=True, help="Run again the cells whose last run failed.")
@click.option("--reports-only", is_flag=True, help="Write the reports from MLflow without running anything.")
@click.option("--rows", help="Comma-separated framework rows to keep (default: all rows of the matrix).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a field in every cell's recipe.")
@click.option("--dry-run", is_flag=True,
              help="Check every cell and print the plan (held, to run, cannot run here and why); run and write nothing.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs per cell, each with its own seed (the recipe's, then +1000, +2000, ...); the reports "
                   "give each cell's median and 95% interval and compare times only where intervals separate.")
def table2(scale: str, tracking_uri: str | None, experiment: str | None, reports: Path, gpus_per_node: int | None,
           retry_failed: bool, reports_only: bool, rows: str | None, overrides: tuple[str, ...], dry_run: bool,
           repeats: int) -> None:
    """Re-run the paper's comparison matrix and write Table 2, figures and findings.

    \b
    Runs every cell (workload x framework x GPU count, configs/table2.yaml) that MLflow does not
    already hold for the same recipe fingerprint, so an interrupted matrix resumes and a second
    call only rebuilds reports/: table2_platforms.*, results.{md,csv,tex}, *.png, findings.md; at
    smoke scale also the parity report and the convergence study (parity.*, convergence.*), on which
    the findings draw.
    While cells run, reports/ is rewritten every few minutes (an early report says so in its
    first line), and each cell's progress line gives the time left from the finished cells' times.
    Every cell is checked first (recipe, data present and verified, devices or a launcher that
    provides them); a cell that cannot run here gets one line with the reason and the fixing command,
    and the reports carry that reason.
    """
    from repro import tracking
    from repro import table2 as matrix_module
    from repro.matrix import expand, load_matrix
    from repro.report.build import EarlyReports, machine_profile, write_reports

    uri = tracking.tracking_uri(tracking_uri)
    experiment = experiment or f"table2-{scale}"
    try:
        matrix = load_matrix(rows=rows.split(",") if rows else None)
    except KeyError as error:
        fail(error.args[0])
    cells = expand(matrix, scale, list(overrides), gpus_per_node, repeats)
    if dry_run:
        todo, _ = matrix_module.plan(cells, uri, experiment, retry_failed)
        for cell in todo:
            click.echo(f"{cell.label:<28} to run")
        return
    calibration = None  # this machine's profile for the step-time check, measured around the matrix's own runs
    if scale == "smoke" and not rows and not reports_only:
        from repro.framework_overhead import Calibration
        from repro.hardware import cpu_cores

        calibration = Calibration(uri, cpu_cores())
    if not reports_only:
        early = EarlyReports(cells, uri, experiment, reports, scale, out=lambda line: click.echo(line, err=True))
        counts = matrix_module.run_matrix(cells, uri, experiment, retry_failed, after_each=early,
                                          beside=calibration.beside if calibration else lambda cell: [])
        click.echo(f"matrix: {counts['ran']} ran, {counts['failed']} failed, {counts['held']} already held, "
                   f"{counts['blocked']} cannot run here, {counts['skipped']} skipped", err=True)
    with_settings = None
    if scale == "smoke" and not rows:  # the parity section and the convergence study: the findings read both
        from repro import convergence as study_module
        from repro import parity as parity_module

        found = [row for model in ("gpt2", "vgg16")
                 for row in parity_module.run_parity(model, scale, uri, f"parity-{scale}", execute=not reports_only)]
        partings = parity_module.matrix_partings(uri, experiment, scale, f"parity-{scale}", extra=list(overrides),
                                                 execute=not reports_only)
        for path in parity_module.write(found, reports, parity_module.STEPS, partings):
            click.echo(str(path))
        # its runs with memory settings, checked against the cost model beside the matrix's cells
        with_settings = ([cell for model in ("gpt2", "vgg16") for cell in parity_module.setting_cells(model, scale)],
                         f"parity-{scale}")
        # not the matrix's overrides, like the parity configurations: the study fixes its own settings
        study = study_module.run_study(scale, uri, f"convergence-{scale}", execute=not reports_only)
        for path in study_module.write(study, reports):
            click.echo(str(path))
    # this machine's profile for the step-time check: the one kept beside the store, or measured now (before the
    # matrix), with the frameworks' own times for the whole matrix, their first pass made beside the matrix's
    # cells (not for --reports-only, which starts no process: without a kept profile, step times go unchecked)
    platform, retimed = None, None
    if scale == "smoke" and not rows:
        from repro import framework_overhead
        from repro.hardware import cpu_cores

        platform = calibration.finished(lambda line: click.echo(line, err=True)) if calibration else \
            machine_profile(uri, measure=False)
        retimed = framework_overhead.retimed(framework_overhead.calibration_cells(scale, cpu_cores()), uri)
    elif scale == "smoke":
        platform = machine_profile(uri, measure=not reports_only)
    for path in write_reports(cells, uri, experiment, reports, scale, with_settings=with_settings, platform=platform,
                              retimed=retimed):
        click.echo(str(path))


@click.command()
@click.option("--model", type=click.Choice(MODELS), default="gpt2", show_default=True)
@click.option("--scale", type=click.Choice(SCALES), default="smoke", show_default=True)
@click.option("--steps", type=int, default=4, show_default=True, help="Training steps compared per configuration.")
@click.option("--configs", help="Comma-separated configurations to keep (default: all; see the report's first column).")
@click.option("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
@click.option("--experiment", help="MLflow experiment (default: parity-SCALE).")
@click.option("--reports", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"), show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a field in every recipe.")
def parity(model: str, scale: str, steps: int, configs: str | None, tracking_uri: str | None, experiment: str | None,
           reports: Path, overrides: tuple[str, ...]) -> None:
    """Train every framework that runs here for a few steps against one plain PyTorch process.

    \b
    Same global batch, seed, data order and optimizer (Adam; SGD for LBANN) for all: DDP on 2 and
    4 GPUs, ZeRO 1/2/3, FSDP, Megatron tp=2 and tp=2 x dp=2, torchgpipe, PyTorch's pipeline
    schedules, PipeDream with 1 stage (exact) and 2 (staleness, measured); for vgg16 the
    data-parallel frameworks and torchgpipe (Megatron targets transformers). Writes
    reports/parity.{md,json}: the largest per-step loss difference of each, the tolerance
    (fp32 on CPU: 1e-5) and pass or FAIL. Exit code 1 when any configuration fails.

    \b
    Examples:
      repro parity
      repro parity --configs ddp-2,zero-3 --steps 8
    """
    from repro import parity as parity_module
    from repro import tracking

    names = configs.split(",") if configs else None
    valid = [c.name for c in parity_module.CONFIGS]
    unknown = [name for name in names or [] if name not in valid]
    if unknown:
        fail(f"unknown configuration {unknown[0]!r}; valid: {', '.join(valid)}")
    found = parity_module.run_parity(model, scale, tracking.tracking_uri(tracking_uri), experiment or f"parity-{scale}",
                                     steps, names, list(overrides))
    for path in parity_module.write(found, reports, steps):
        click.echo(str(path))
    broken = parity_module.failed(found)
    if broken:
        fail(f"parity fails for {', '.join(r.name for r in broken)} (see {reports / 'parity.md'})", 1)


@click.command()
@click.option("--scale", type=click.Choice(SCALES), default="smoke", show_default=True)
@click.option("--seeds", type=click.IntRange(min=2), default=3, show_default=True, help="Seeds per arm (the recipe's, +1, ...).")
@click.option("--evals", type=click.IntRange(min=1), default=8, show_default=True, help="Validations per run.")
@click.option("--steps-per-eval", type=click.IntRange(min=1), default=20, show_default=True,
              help="Training steps between validations (at global batch 8).")
@click.option("--only", help="Comma-separated words: keep the comparisons whose question or treatment contains one "
                             "(e.g. staleness,control,zero).")
@click.option("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
@click.option("--experiment", help="MLflow experiment (default: convergence-SCALE).")
@click.option("--reports", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"), show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a field in every recipe.")
def convergence(scale: str, seeds: int, evals: int, steps_per_eval: int, only: str | None, tracking_uri: str | None,
                experiment: str | None, reports: Path, overrides: tuple[str, ...]) -> None:
    """Staleness, data-parallel identity and Megatron's effective batch, at equal settings over seeds.

    \b
    Each comparison trains a control and a treatment with the same optimizer, learning rate, global
    batch, data order and initial weights on GPT-2's reduced model, validated every few tens of steps,
    on several seeds; the effects are paired by seed, with 95% t intervals, at the target and at the
    end. Writes reports/convergence.{md,json,png}; `repro table2` runs it at smoke scale and its
    findings rest on it. Runs are reused by recipe fingerprint.

    \b
    Examples:
      repro convergence
      repro convergence --only control --seeds 2 --evals 2 --steps-per-eval 2
    """
    from repro import convergence as study_module
    from repro import tracking

    chosen = study_module.by_name(only)
    if not chosen:
        fail(f"--only {only!r} matches no comparison; groups: {', '.join(dict.fromkeys(c.group for c in study_module.COMPARISONS))}")
    plan = study_module.Plan(seeds, evals, steps_per_eval)
    study = study_module.run_study(scale, tracking.tracking_uri(tracking_uri), experiment or f"convergence-{scale}",
                                   plan, chosen, list(overrides))
    for path in study_module.write(study, reports):
        click.echo(str(path))


@click.command()
@click.option("--scale", type=click.Choice(SCALES), default="paper", show_default=True, help="The matrix's scale.")
@click.option("--model", "models", type=click.Choice(MODELS), multiple=True, help="Only this workload (repeatable).")
@click.option("--gpu-memory", "gpu_memory", multiple=True, metavar="[NAME=]SIZE",
              help="A device to check fits against, e.g. 16GiB or V100=16GiB (repeatable; default: "
                   "V100-16GB, A100-40GB, H100-80GB, H200-141GB).")
@click.option("--fit", "fit_device", metavar="DEVICE",
              help="For each cell, the least recompute and then the largest micro-batch (a divisor of "
                   "train.batch_per_gpu) under which the predicted peak fits DEVICE: "
                   f"{', '.join(GPU_MEMORY_GIB)} or [NAME=]SIZE as for --gpu-memory. Recompute runs each recomputed "
                   "block's forward again, so micro-batches come first; only what the cell's framework applies is tried.")
@click.option("--platform", "platform_name", metavar="lassen|thetagpu|FILE",
              help="Step and epoch time of every cell on this platform profile (configs/platforms/, or a file "
                   "`repro calibrate` wrote), instead of memory.")
def predict(scale: str, models: tuple[str, ...], gpu_memory: tuple[str, ...], fit_device: str | None,
            platform_name: str | None) -> None:
    """Memory per GPU and communication per step of every Table 2 cell, predicted by the cost model.

    \b
    Model state, activations, what the loss's backward holds beside them and their sum (the estimated
    peak, without the allocator's cache and communication scratch) per GPU, the payload each GPU hands
    to communication per step, and on which devices the estimated peak fits; then at how many GPUs
    Megatron-intra's peak is lowest (the paper's U). The model is checked against counted runs at smoke
    scale (reports/model_check.md), 16-bit runs under autocast and FSDP's bf16 parameters included;
    Megatron's own bf16 and GPU-only paths are unchecked. Imports no torch.

    \b
    Examples:
      repro predict
      repro predict --model gpt2 --gpu-memory 24GiB
      repro predict --model gpt2 --fit V100-16GB
      repro predict --platform thetagpu
    """
    from repro.hardware import paper_gpu_memory
    from repro.model.flops import step_flops
    from repro.model.predict import matrix_predictions, memory_minimum, paper_devices, paper_fit

    if platform_name:
        return print_times(models or MODELS, scale, platform_name)
    if fit_device:
        known = fit_device in GPU_MEMORY_GIB
        name, size = (fit_device, GPU_MEMORY_GIB[fit_device]) if known else device("--fit", fit_device)
        return print_fits(models or MODELS, scale, name, size)
    devices = dict(device("--gpu-memory", text) for text in gpu_memory) or dict(GPU_MEMORY_GIB)

    def gib(size: float | None) -> str:
        return "-" if size is None else f"{size / 2**30:.2f}"

    for workload in models or MODELS:
        click.echo(f"{workload}, {scale} scale: per GPU, GiB; communication MiB per step (payload handed); "
                   "GFLOP per step (busiest GPU, the optimizer's included)")
        click.echo(f"  {'row':<16}{'gpus':>5}{'state':>9}{'activ.':>9}{'loss bwd':>9}{'peak':>9}{'comm':>10}{'GFLOP':>11}  fits")
        intra: dict[int, float] = {}  # the paper's U: where Megatron-intra's memory per GPU is lowest
        over: dict[str, list] = {}  # row -> its (gpus, prediction) above the smaller of the paper's GPUs
        for entry in matrix_predictions(workload, scale):
            p = entry["prediction"]
            if p.estimated_peak is not None and p.estimated_peak > min(paper_gpu_memory().values()) * 2**30:
                over.setdefault(entry["row"], []).append((entry["gpus"], p))
            if entry["row"] == "megatron-intra" and p.estimated_peak is not None:
                intra[entry["gpus"]] = p.estimated_peak
            fits = [name for name, size in devices.items() if p.fit_bytes <= size * 2**30]
            note = "" if p.estimated_peak is not None else " (by model state: activations not predicted on this device)"
            click.echo(f"  {entry['row']:<16}{entry['gpus']:>5}{gib(p.model_state):>9}{gib(p.activations):>9}{gib(p.transient):>9}"
                       f"{gib(p.estimated_peak):>9}{p.comm_bytes / 2**20:>10.1f}{step_flops(entry['cell']).total / 1e9:>11.0f}  "
                       f"{', '.join(fits) or 'none'}{note}")
        if len(intra) >= 3:
            lowest, shape = memory_minimum(intra)
            click.echo(f"  megatron-intra's peak per GPU is lowest at {lowest} GPU{'s' if lowest > 1 else ''} ({shape})")
        if over and scale == "paper":
            click.echo(f"  against the paper's GPUs (its Table 2), under configs/{workload}-paper.yaml's settings "
                       "(each framework's own recompute and micro-batches, train_by_framework):")
        why = {(e["row"], e["gpus"]): e["why"] for e in paper_devices(workload)} if over and scale == "paper" else {}
        for row, points in over.items() if scale == "paper" else ():
            gpus, worst = max(points, key=lambda point: point[1].estimated_peak)
            counts = [g for g, _ in points]
            click.echo(f"    {row} at {counts[0]}{f'-{counts[-1]} GPUs' if len(counts) > 1 else ' GPU'}, most at {gpus} "
                       f"({gib(worst.estimated_peak)} GiB): {paper_fit(worst.estimated_peak, worst.model_state)}; "
                       f"why: {why[row, gpus]}")


def device(option: str, text: str) -> tuple[str, float]:
    """A device given as [NAME=]SIZE in GiB: (its name, or the size as written; GiB)."""
    name, _, size = text.rpartition("=")
    if not size.lower().endswith("gib") or not size[:-3].replace(".", "", 1).isdigit():
        fail(f"{option}: {text!r} is not [NAME=]SIZE in GiB, e.g. 16GiB or V100=16GiB"
             + (f", or one of {', '.join(GPU_MEMORY_GIB)}" if option == "--fit" else ""))
    return name or size, float(size[:-3])


def print_fits(workloads: tuple[str, ...], scale: str, name: str, size: float) -> None:
    """`repro predict --fit`: per cell, the setting chosen (repro.model.predict.fit) and its predicted peak."""
    from repro.model.predict import matrix_fits

    label = name if name.lower().endswith("gib") else f"{name} ({size:g} GiB)"
    for workload in workloads:
        click.echo(f"{workload}, {scale} scale, fitted to {label}: peak per GPU, GiB, as written and under the least "
                   "recompute, then the largest micro-batch, that fits")
        click.echo(f"  {'row':<16}{'gpus':>5}{'written':>9}{'fitted':>9}  setting")
        fits = matrix_fits(workload, size * 2**30, scale, name)
        for entry in fits:
            fit = entry["fit"]
            peak = "-" if fit.peak is None else f"{fit.peak / 2**30:.2f}"
            note = "" if entry["prediction"].estimated_peak is not None else " (by model state: activations not predicted)"
            click.echo(f"  {entry['row']:<16}{entry['gpus']:>5}{fit.as_written / 2**30:>9.2f}{peak:>9}  "
                       f"{fit.why_not or fit.setting()}{note}")
        fitted = [entry for entry in fits if entry["fit"].peak is not None]
        written = sum(1 for entry in fitted if not entry["fit"].sets)
        by_state = sum(1 for entry in fitted if entry["prediction"].estimated_peak is None)
        click.echo(f"  {len(fitted)} of {len(fits)} cells fit {name}: {written} as written, {len(fitted) - written} "
                   f"with a setting{f'; {by_state} of them by model state alone' if by_state else ''}")


def print_times(workloads: tuple[str, ...], scale: str, name: str) -> None:
    """`repro predict --platform`: per cell the predicted step time, its terms, and the epoch's time; then
    the ranking at the largest GPU count and Megatron's fastest tensor x data split at 8 GPUs and more."""
    from repro.model import platforms
    from repro.model.predict import fastest_split, matrix_times
    from repro.schema import RecipeError

    try:
        platform = platforms.load(name)
    except RecipeError as error:
        fail(str(error))
    note = "published figures with a stated efficiency: an assumption" if platform.assumption else "measured"
    for workload in workloads:
        click.echo(f"{workload}, {scale} scale, on {platform.name} ({note}; {platform.ranks_per_node} GPUs a node): "
                   "seconds a step (compute + exposed communication + pipeline bubble), seconds an epoch")
        click.echo(f"  {'row':<16}{'gpus':>5}{'step':>9}{'compute':>9}{'comm':>9}{'bubble':>9}{'steps':>9}{'epoch s':>9}")
        rows = matrix_times(workload, platform, scale)
        for entry in rows:
            step, epoch = entry["step"], "-" if entry["epoch_s"] is None else f"{entry['epoch_s']:.0f}"
            click.echo(f"  {entry['row']:<16}{entry['gpus']:>5}{step.total_s:>9.3f}{step.compute_s:>9.3f}{step.exposed_s:>9.3f}"
                       f"{step.bubble_s:>9.3f}{entry['epoch_steps'] or '-':>9}{epoch:>9}")
        most = max(entry["gpus"] for entry in rows)
        timed = sorted((entry for entry in rows if entry["gpus"] == most and entry["epoch_s"]), key=lambda e: e["epoch_s"])
        click.echo(f"  at {most} GPUs, fastest epoch first: " + ", ".join(f"{e['row']} {e['epoch_s']:.0f} s" for e in timed))
        if workload == "gpt2":
            for gpus in (g for g in sorted({entry["gpus"] for entry in rows}) if g >= 8):
                splits = fastest_split(workload, gpus, platform, scale)
                click.echo(f"  megatron at {gpus} GPUs, tensor x data, fastest first: " +
                           ", ".join(f"{tp}x{gpus // tp} {seconds:.3f} s" for tp, seconds in splits[:4]))


@click.command()
@click.option("--tracking-uri", help="The MLflow store whose folder keeps the profile (default: $MLFLOW_TRACKING_URI, "
                                     "else sqlite:///mlflow.db).")
@click.option("--again", is_flag=True, help="Measure even where a profile of this CPU model is kept (the frameworks' "
                                          "runs are reused from MLflow by recipe fingerprint).")
@click.option("--machine-only", is_flag=True, help="Leave out the frameworks' own times (their runs take minutes).")
def calibrate(tracking_uri: str | None, again: bool, machine_only: bool) -> None:
    """Measure this machine and keep its platform profile for the step-time model.

    \b
    Matrix-multiply rate by size, memory bandwidth, the host's cost per dispatched operation of each
    workload, each workload's own operations timed at sizes other than the smoke recipe's, and each
    collective's latency and bandwidth between 2 gloo processes (repro/calibrate.py), one thread a
    process as the CPU stand-ins train; under a minute. Then each framework's own time a step beyond
    the model's terms: the matrix's cells of no more processes than cores, 20 steps each at two model
    sizes that the check does not use, three times, the fastest kept, and between them at the recipe's own
    size, which `repro table2`'s check reads beside the matrix's run (repro/framework_overhead.py;
    15 to 25 minutes on 2 cores, recorded in MLflow as experiment calibration-smoke). A machine
    measured now is measured again after each pass, each figure kept at its fastest. Kept beside the
    MLflow store, one file per CPU model, and reused; `repro predict --platform FILE` reads it.

    \b
    Examples:
      repro calibrate
      repro calibrate --again
      repro calibrate --machine-only
    """
    from repro import calibrate as calibration
    from repro.tracking import tracking_uri as resolve

    uri = resolve(tracking_uri)
    if machine_only:
        platform = calibration.calibrated(calibration.store_folder(uri), again)
    else:
        from repro import framework_overhead
        from repro.hardware import cpu_cores

        platform = framework_overhead.Calibration(uri, cpu_cores(), again).finished(lambda line: click.echo(line, err=True))
    click.echo(platform.path)
    click.echo(f"  matrix multiply: {platform.matmul.peak['fp32'] / 1e9:.1f} GFLOP/s at the largest size; "
               f"memory {platform.memory.bandwidth / 1e9:.1f} GB/s; dispatch " +
               ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in platform.dispatch_s.items()))
    for kind, link in platform.collectives["intra"].items():
        click.echo(f"  {kind}: {link.latency_s * 1e6:.0f} us + {link.bandwidth / 1e9:.2f} GB/s on the wire")
    if platform.frameworks:
        click.echo("  each framework's own time a step at its two sizes, at: model state bytes a rank (ZeRO-1/2: "
                   "bucket flushes a step; repro/model/time.py, own_time_scale)")
    for key, points in platform.frameworks.items():
        click.echo(f"  {key}: " + ", ".join(f"{seconds * 1e3:.1f} ms at {where:,.0f}" for where, seconds in points))
