"""`repro parity`: does every framework train exactly like one plain PyTorch process, here?

Each configuration below (a framework, a GPU count, its parallel layout) trains K steps at the same
global batch, seed, data order (the loop's GlobalBatches) and optimizer as a reference: one process
of plain PyTorch (DDP with one rank, which never communicates). The largest per-step difference
between its training loss and the reference's is compared with a tolerance: 1e-5 in fp32 on CPU,
where every framework's arithmetic is deterministic and differs from one process only in the order
of its reductions. PipeDream with one stage must be exact too; with S stages its weight staleness
changes the arithmetic by design, so its difference is measured and shown, not judged. The memory
settings (issue 39): gradients accumulated over micro-batches must stay within 1e-6 of one process at
the same global batch (only the order of the sums changes); recompute must not change a bit, dropout
included, so a recompute row is compared with the same configuration without it, at tolerance 0.

This is torchtitan's parity method (docs/converging.md: a control and a test with the same tokens
per step, the same seed, deterministic kernels) and the gradient-match tests of Megatron's CI, run
as a report on the user's machine and software stack. Runs are recorded in MLflow (experiment
`parity-SCALE`) and reused by recipe fingerprint, like the Table 2 matrix.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from repro import hardware, names, registry
from repro.cell import Cell
from repro.recipe import Recipe, load_file, recipe_path, section_key
from repro.schema import RecipeError

GLOBAL_BATCH = 8  # every configuration below can split it (torchgpipe: 8 micro-batches of 1 on 2 GPUs)
STEPS = 4
SMALL = {  # each workload's reduced model: still enough layers for 2 pipeline stages x 2 per rank
    "gpt2": ("model.n_layer=2",),  # embedding, 2 blocks, head
    "vgg16": ("model.width_div=16", "model.classifier_width=32"),  # all 16 layers, 4 to 32 channels
}
# VGG-16 has no transformer layers: Megatron does not apply, and the pipelines are compared through
# torchgpipe (the paper's synchronous pipeline); every data-parallel framework is compared, FSDP also at
# 4 GPUs, where the matrix's VGG-16 curves part (ZeRO at 4 is compared there step by step, by
# matrix_partings: 4 DeepSpeed ranks took about 100 s to start here under load, for 4 steps)
FOUR_GPUS = ("fsdp-4",)  # not in GPT-2's default set (its matrix compares no data-parallel curves at equal settings)
WORKLOAD_CONFIGS = {"vgg16": ("ddp-2", "ddp-4", "zero-1", "zero-2", "zero-3", "fsdp-2", "fsdp-4", "torchgpipe-2",
                              "ddp-2-recompute", "ddp-2-micro")}
ADAM = {"name": "adam", "lr": 0.001, "weight_decay": 0.0}  # PyTorch's Adam for all; LBANN's own differs (docs/lbann.md)
SGD = {"name": "sgd", "lr": 0.01, "weight_decay": 0.0, "momentum": 0.9}
# largest per-step training-loss difference accepted, by (device type, precision). The GPU bands
# allow for non-deterministic reductions (fp32) and bf16's 8-bit mantissa over a loss of about 5.
TOLERANCE = {("cpu", "fp32"): 1e-5, ("cuda", "fp32"): 1e-4, ("cuda", "bf16"): 5e-2}
PASS, FAIL, MEASURED = "pass", "FAIL", "measured"
# the settings that change what a rank holds (issue 39): the configurations that set one are the model check's
# runs with settings (reports/model_check.md), beside the matrix's cells
MEMORY_SETTINGS = ("train.recompute", "train.micro_batch", "torchgpipe.checkpoint")


@dataclass(frozen=True)
class Config:
    name: str
    framework: str
    gpus: int
    set: tuple[str, ...] = ()
    exact: bool = True  # False: a difference is expected by design, measured rather than judged
    optimizer: tuple[tuple[str, Any], ...] = tuple(ADAM.items())
    # settings of `set` that must not change the arithmetic (recompute): the row is compared bit for bit with
    # the same configuration without them, instead of with one process
    unchanged_by: tuple[str, ...] = ()
    cpu_tolerance: float | None = None  # a tighter bound on CPU in fp32, where every kernel is deterministic


CONFIGS = (
    Config("ddp-2", "ddp", 2),
    Config("ddp-4", "ddp", 4),
    *(Config(f"zero-{stage}", "zero", 2, (f"zero.stage={stage}",)) for stage in (1, 2, 3)),
    Config("fsdp-2", "fsdp", 2),
    Config("fsdp-4", "fsdp", 4),
    Config("megatron-tp2", "megatron", 2, ("megatron.tp=2",)),
    Config("megatron-tp2-dp2", "megatron", 4, ("megatron.tp=2",)),
    Config("torchgpipe-2", "torchgpipe", 2),
    *(Config(f"torch-{schedule}-2", "torch-pipeline", 2, (f"torch_pipeline.schedule={schedule}",))
      for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")),
    Config("pipedream-1", "pipedream", 1),
    Config("pipedream-2", "pipedream", 2, exact=False),  # weight staleness: S-1-s updates behind
    Config("lbann-2", "lbann", 2, exact=False, optimizer=tuple(SGD.items())),  # its reader orders data its own way
    Config("ddp-2-micro", "ddp", 2, ("train.micro_batch=2",), cpu_tolerance=1e-6),  # 2 micro-batches a rank
    Config("ddp-2-recompute", "ddp", 2, ("train.recompute=full",), unchanged_by=("train.recompute=full",)),
    Config("ddp-2-recompute-dropout", "ddp", 2, ("model.dropout=0.1", "train.recompute=full"),
           unchanged_by=("train.recompute=full",)),  # checkpoint restores the RNG state: the same masks
    Config("torchgpipe-2-always", "torchgpipe", 2, ("torchgpipe.checkpoint=always",),
           unchanged_by=("torchgpipe.checkpoint=always",)),  # against its default, except_last
    Config("zero-2-micro", "zero", 2, ("train.micro_batch=2",), cpu_tolerance=1e-6),  # DeepSpeed's gradient accumulation
    Config("zero-2-recompute", "zero", 2, ("train.recompute=full",), unchanged_by=("train.recompute=full",)),
    Config("megatron-tp2-micro", "megatron", 2, ("megatron.tp=2", "train.micro_batch=2"), cpu_tolerance=1e-6),  # its schedule
    *(Config(f"megatron-tp2-{mode}-dropout", "megatron", 2, ("megatron.tp=2", "model.dropout=0.1", f"train.recompute={mode}"),
             unchanged_by=(f"train.recompute={mode}",)) for mode in ("selective", "full")),  # its CheckpointFunction restores the RNG
    Config("fsdp-2-micro", "fsdp", 2, ("train.micro_batch=2",), cpu_tolerance=1e-6),  # gradient sync off but for the last
    Config("torch-1f1b-2-micro", "torch-pipeline", 2, ("torch_pipeline.schedule=1f1b", "train.micro_batch=1"),
           cpu_tolerance=1e-6),  # 8 micro-batches of 1 where its default is 2 x GPUs = 4 of 2
    Config("fsdp-2-recompute", "fsdp", 2, ("train.recompute=full",), unchanged_by=("train.recompute=full",)),
    Config("fsdp-2-recompute-dropout", "fsdp", 2, ("model.dropout=0.1", "train.recompute=full"),
           unchanged_by=("train.recompute=full",)),
)


@dataclass
class Row:
    name: str
    framework: str
    gpus: int
    status: str  # pass, FAIL, measured, or why it did not run
    settings: str = ""
    steps: int = 0
    max_abs_diff: float | None = None
    tolerance: float | None = None
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    workload: str = "gpt2"


def recipe_for(config: Config, workload: str, scale: str, steps: int, extra: list[str],
               global_batch: int = GLOBAL_BATCH) -> Recipe:
    """The configuration's recipe at `global_batch`: batch_per_gpu follows the framework's batch rule."""
    optimizer = dict(config.optimizer)
    fields = [f"run.framework={config.framework}", f"run.gpus={config.gpus}", "run.nodes=1", "train.epochs=1",
              f"train.max_steps={steps}", f"data.max_train_samples={steps * global_batch}",
              f"data.max_val_samples={global_batch}", *SMALL[workload], *config.set]
    for section in ("train", section_key(config.framework)):  # a framework section's optimizer wins
        fields += [f"{section}.optimizer.{key}={value}" for key, value in optimizer.items()]
    fields += list(extra)
    path = recipe_path(workload, scale)
    # probed at global_batch per GPU, which splits wherever global_batch does, on enough samples for it
    probe = load_file(path, [*fields, f"train.batch_per_gpu={global_batch}", f"data.max_train_samples={16 * global_batch**2}"])
    per_sample = registry.plan_class(config.framework).global_batch(probe) // global_batch
    if global_batch % per_sample:
        raise RecipeError(str(path), "train.batch_per_gpu",
                          f"{config.name}'s global batch is a multiple of {per_sample}; {global_batch} is not")
    return load_file(path, [*fields, f"train.batch_per_gpu={global_batch // per_sample}"])


def settings_text(recipe: Recipe) -> str:
    o = recipe.optimizer()
    return (f"{o.name} lr {o.lr:g} wd {o.weight_decay:g}, global batch {GLOBAL_BATCH}, {recipe.train.precision}, "
            f"seed {recipe.seed}")


def tolerance_for(recipe: Recipe, config: Config | None = None) -> float:
    """The largest loss difference `config`'s row accepts: 0 where it must equal its control bit for bit,
    else its device and precision's band (tightened on CPU in fp32 where the configuration asks)."""
    if config is not None and config.unchanged_by:
        return 0.0
    device = "cuda" if recipe.run.device != "cpu" and hardware.gpu_count() else "cpu"
    if config is not None and config.cpu_tolerance is not None and (device, recipe.train.precision) == ("cpu", "fp32"):
        return config.cpu_tolerance
    return TOLERANCE.get((device, recipe.train.precision), TOLERANCE[("cuda", "bf16")])


def control_for(config: Config) -> Config:
    """What `config` is compared with: the same configuration without the settings that must change no bit,
    or else one process of plain PyTorch (the reference)."""
    if config.unchanged_by:
        kept = tuple(value for value in config.set if value not in config.unchanged_by)
        return Config(f"{config.name} without {', '.join(config.unchanged_by)}", config.framework, config.gpus, kept,
                      optimizer=config.optimizer)
    return Config("reference", "ddp", 1, optimizer=config.optimizer)


def newest_runs(uri: str, experiment: str) -> dict[str, str]:
    """recipe fingerprint -> run id of its newest finished run."""
    from repro.report.collect import search_runs

    newest = {}
    for run in search_runs(uri, experiment):  # newest first
        if run.info.status == "FINISHED":
            newest.setdefault(run.data.tags.get(names.RECIPE_SHA256), run.info.run_id)
    return newest


def newest_losses(uri: str, experiment: str) -> Callable[[Recipe], list[float] | None]:
    """recipe -> training losses of the newest finished run of that fingerprint (None: none)."""
    from repro.report.collect import history
    from repro.tracking import client

    newest, mlflow_client = newest_runs(uri, experiment), client(uri)

    def losses(recipe: Recipe) -> list[float] | None:
        run_id = newest.get(recipe.fingerprint())
        return history(mlflow_client, run_id, names.TRAIN_LOSS) if run_id else None

    return losses


def train(recipes: list[Recipe], uri: str, experiment: str, out: Callable[[str], None],
          label: str = "parity") -> dict[str, str]:
    """Run the recipes MLflow holds no finished run of; fingerprint -> why one could not run. `label`: the
    progress lines' first word."""
    from repro.table2 import held_fingerprints, run_each

    held = held_fingerprints(uri, experiment, retry_failed=True)
    todo = {r.fingerprint(): r for r in recipes if r.fingerprint() not in held}
    runs = [(f"{label} {r.run.framework} {r.run.gpus}g", r, experiment) for r in todo.values()]
    return {key: refusal or f"run failed (exit {code})"
            for key, (code, refusal) in zip(todo, run_each(runs, uri, out)) if code}


def compare(config: Config, recipe: Recipe, losses: list[float] | None, reference: list[float] | None,
            steps: int) -> Row:
    against = f"; against {control_for(config).name}" if config.unchanged_by else ""
    row = Row(config.name, config.framework, config.gpus, "", settings_text(recipe) + against, steps, workload=recipe.workload)
    if not losses or not reference or len(losses) < steps or len(reference) < steps:
        row.status = "no losses recorded: run failed"
        return row
    row.losses, row.reference_losses = losses[:steps], reference[:steps]
    row.max_abs_diff = max(abs(a - b) for a, b in zip(row.losses, row.reference_losses))
    row.tolerance = tolerance_for(recipe, config)
    row.status = (PASS if row.max_abs_diff <= row.tolerance else FAIL) if config.exact else MEASURED
    return row


def selected(workload: str, names: list[str] | None = None) -> list[Config]:
    """The configurations named, else the workload's own set, else all but those of FOUR_GPUS."""
    names = names or WORKLOAD_CONFIGS.get(workload)
    return [c for c in CONFIGS if c.name in names] if names else [c for c in CONFIGS if c.name not in FOUR_GPUS]


def setting_cells(workload: str, scale: str, extra: list[str] = ()) -> list[Cell]:
    """The workload's configurations that train with a memory setting (MEMORY_SETTINGS), as cells of the
    recipes `run_parity` trains them with: reports/model_check.md checks their counted runs against the
    model (a framework not installed here: a skipped cell saying so)."""
    cells = []
    for config in selected(workload):
        if not any(value.startswith(MEMORY_SETTINGS) for value in config.set):
            continue
        absence = registry.framework(config.framework).absence()
        recipe, skip = None, f"unavailable here: {absence}" if absence else None
        if not absence:
            try:
                recipe = recipe_for(config, workload, scale, STEPS, list(extra))
            except RecipeError as error:
                skip = f"not applicable: {error.problem}"
        cells.append(Cell(workload, config.name, config.framework, config.gpus, recipe, skip))
    return cells


def run_parity(workload: str, scale: str, uri: str, experiment: str, steps: int = STEPS,
               names: list[str] | None = None, extra: list[str] = (), execute: bool = True,
               out: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> list[Row]:
    """Train (unless `execute` is False) and compare every configuration; one Row each."""
    rows, planned = [], []
    for config in selected(workload, names):
        absence = registry.framework(config.framework).absence()
        if absence:
            rows.append(Row(config.name, config.framework, config.gpus, f"unavailable here: {absence}",
                            workload=workload))
            continue
        try:
            test = recipe_for(config, workload, scale, steps, list(extra))
            reference = recipe_for(control_for(config), workload, scale, steps, list(extra))
        except RecipeError as error:
            rows.append(Row(config.name, config.framework, config.gpus, f"not applicable: {error.problem}",
                            workload=workload))
            continue
        planned.append((config, test, reference))
        rows.append(None)  # filled below, in CONFIGS order
    problems = {}
    if execute:
        unique = {r.fingerprint(): r for _, test, ref in planned for r in (ref, test)}
        problems = train(list(unique.values()), uri, experiment, out)
    losses = newest_losses(uri, experiment)
    compared = iter(planned)
    for index, row in enumerate(rows):
        if row is None:
            config, test, reference = next(compared)
            rows[index] = compare(config, test, losses(test), losses(reference), steps)
            why = problems.get(test.fingerprint()) or problems.get(reference.fingerprint())
            if why and rows[index].max_abs_diff is None:
                rows[index].status = why
    return rows


@dataclass
class Parting:
    """Where a matrix run parts from another at equal settings, step by step over the recipe's epochs."""
    workload: str
    gpus: int
    framework: str
    reference: str
    steps: int
    first_step: int | None  # first step whose training losses differ at all (1-based; None: never)
    first_diff: float | None  # their difference there
    beyond_step: int | None  # first step where they differ by more than the tolerance
    tolerance: float
    max_diff: float
    final_gap: float | None  # relative gap of the final validation metric
    cause: str
    curve_gap: float | None = None  # largest gap of the validation metric over the epochs, relative to the reference's
    control: bool = False  # the rounding control: differs from the reference only by rounding


def relative_gaps(val: list[float], reference_val: list[float]) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(val, reference_val)]


def parting(name: str, reference_name: str, losses: list[float], reference: list[float], val: list[float],
            reference_val: list[float], tolerance: float, where: tuple[str, int], control: bool = False) -> Parting:
    """The first step where two loss curves part and how: runs of equal settings whose first
    difference is of rounding size (within the tolerance that one process and the framework share
    in the parity table) and then grows have parted by rounding growth; a first difference already
    above it is the frameworks' own arithmetic. `val`: each run's validation metric per epoch."""
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    first = next((i for i, d in enumerate(diffs) if d > 0), None)
    beyond = next((i for i, d in enumerate(diffs) if d > tolerance), None)
    gaps = relative_gaps(val, reference_val)
    if first is None:
        cause = "identical at every step: no gap to explain"
    elif diffs[first] <= tolerance:
        cause = (f"rounding growth: equal through step {first}, then {diffs[first]:.1e} (rounding size, "
                 f"within {tolerance:.0e}), past {tolerance:.0e} at step "
                 f"{'-' if beyond is None else beyond + 1}, largest {max(diffs):.1e}")
    else:
        cause = f"the frameworks: their first difference, at step {first + 1}, is already {diffs[first]:.1e}"
    return Parting(where[0], where[1], name, reference_name, len(diffs), None if first is None else first + 1,
                   None if first is None else diffs[first], None if beyond is None else beyond + 1, tolerance,
                   max(diffs, default=0.0), gaps[-1] if val and len(val) == len(reference_val) else None, cause,
                   max(gaps, default=None), control)


CONTROL = "one process"  # the rounding control's name in the partings


def rounding_control(cell: Cell) -> Recipe:
    """The cell's recipe as one process at the cell's global batch: the same seed, data order (the
    loop's GlobalBatches), optimizer and epochs, so it differs from the cell only in the order of its
    sums (the batch's mean in one process, against per-rank means all-reduced), that is, by rounding."""
    recipe = cell.recipe
    batch = registry.adapter_class(recipe.run.framework).global_batch(recipe)
    return load_file(recipe_path(recipe.workload, recipe.scale),
                     ["run.framework=ddp", "run.gpus=1", "run.nodes=1", *cell.overrides, f"train.batch_per_gpu={batch}"])


def matrix_partings(uri: str, experiment: str, scale: str, parity_experiment: str, workload: str = "vgg16",
                    gpus: tuple[int, ...] = (2, 4), rows: tuple[str, ...] = ("zero", "fsdp"), reference: str = "ddp",
                    extra: list[str] = (), execute: bool = True,
                    out: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> list[Parting]:
    """The Table 2 matrix's runs of `rows` against `reference` at each of `gpus`, step by step over the
    recipe's epochs (`extra`: the matrix's own overrides), where they train with equal settings (VGG-16:
    the same Adam, lr and batch for all three); and, at the most GPUs, the rounding control against
    `reference` (trained in `parity_experiment` unless MLflow holds it or `execute` is False): how far
    rounding alone moves the curves there."""
    from repro.matrix import expand, load_matrix
    from repro.report import settings as run_settings
    from repro.report.collect import METRIC, collect, history
    from repro.tracking import client

    matrix = load_matrix(rows=[reference, *rows])
    cells = [c for c in expand(matrix, scale, list(extra)) if c.workload == workload and c.gpus in gpus]
    found = {(r.cell.row, r.cell.gpus): r for r in collect(cells, uri, experiment) if r.ok}
    mlflow_client, tolerance, out_rows = client(uri), TOLERANCE[("cpu", "fp32")], []
    for count in gpus:
        base = found.get((reference, count))
        if base is None:
            continue
        base_losses = history(mlflow_client, base.run_id, names.TRAIN_LOSS)
        for row in rows:
            mine = found.get((row, count))
            if mine is None or run_settings.differences(mine.settings, base.settings, run_settings.TRAINING):
                continue
            out_rows.append(parting(row, reference, history(mlflow_client, mine.run_id, names.TRAIN_LOSS),
                                    base_losses, mine.val, base.val, tolerance, (workload, count)))
        if count == max(gpus) and count > 1:
            control = rounding_control(base.cell)
            for why in (train([control], uri, parity_experiment, out) if execute else {}).values():
                out(f"parity: the rounding control did not run ({why}); the partings go without it")
            run_id = newest_runs(uri, parity_experiment).get(control.fingerprint())
            if run_id:
                out_rows.append(parting(f"{CONTROL} (batch {control.train.batch_per_gpu})", reference,
                                        history(mlflow_client, run_id, names.TRAIN_LOSS), base_losses,
                                        history(mlflow_client, run_id, METRIC[workload][0]), base.val, tolerance,
                                        (workload, count), control=True))
    return out_rows


def explanation(partings: list[Parting]) -> list[str]:
    """One sentence per workload and GPU count: the frameworks' curve gaps against the rounding control's."""
    lines = []
    for where in dict.fromkeys((p.workload, p.gpus) for p in partings):
        here = [p for p in partings if (p.workload, p.gpus) == where]
        control = next((p for p in here if p.control), None)
        frameworks = [p for p in here if not p.control and p.curve_gap is not None]
        if not frameworks:
            continue
        gaps = ", ".join(f"{p.framework} {p.curve_gap:.1%}" for p in frameworks)
        text = f"{where[0]} at {where[1]} GPUs: largest per-epoch gap from {frameworks[0].reference}'s curve: {gaps}"
        if all(p.first_step is None for p in frameworks):
            text += (" (identical at every step: the frameworks' sums over the ranks agree bit for bit here, "
                     "so there is no rounding difference to grow"
                     + ("; over two ranks each gradient element is one addition, which rounds alike in either order)"
                        if where[1] == 2 else ")"))
        if control and control.curve_gap is not None:
            worst = max(p.curve_gap for p in frameworks)
            own = [p.framework for p in frameworks if p.first_diff is not None and p.first_diff > p.tolerance]
            if worst > control.curve_gap:
                verdict = f"{worst / max(control.curve_gap, 1e-12):.1f}x the gap rounding alone makes"
            elif own:
                verdict = (f"within the gap rounding alone makes, though {', '.join(own)} differ(s) by more than "
                           "rounding from the first differing step")
            else:
                verdict = "within the gap rounding alone makes: rounding growth, not the frameworks"
            text += (f"; {control.framework}, which differs from {control.reference} only in the order of its sums "
                     f"(first loss difference {control.first_diff or 0:.1e} at step {control.first_step or '-'}), "
                     f"{control.curve_gap:.1%}: {verdict}")
        lines.append(text + ".")
    return lines


def markdown(rows: list[Row], steps: int, partings: list[Parting] = ()) -> str:
    workloads = ", ".join(dict.fromkeys(r.workload for r in rows))
    lines = [
        "# Parity: every framework against one plain PyTorch process", "",
        f"{workloads}: {steps} steps, global batch {GLOBAL_BATCH}, the same seed, data order and optimizer as the "
        "reference (one process), on each workload's reduced model (`SMALL` in repro/parity.py). "
        "`max |loss diff|` is the largest per-step training-loss difference; "
        "`measured` rows differ by design (PipeDream's weight staleness across stages). A row whose settings say "
        "`against` is compared with that configuration instead, bit for bit (recompute must change nothing).", "",
        "| workload | configuration | framework | GPUs | settings | max \\|loss diff\\| | tolerance | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}"
        tolerance = "-" if r.tolerance is None else f"{r.tolerance:.0e}"
        lines.append(f"| {r.workload} | {r.name} | {r.framework} | {r.gpus} | {r.settings or '-'} | {diff} | {tolerance} "
                     f"| {r.status} |")
    if partings:
        lines += ["", "## The matrix's runs at equal settings, step by step over the recipe's epochs", "",
                  "Where the Table 2 runs of two frameworks train alike (same optimizer, lr, batch, seed and data "
                  "order), the step where their training losses first differ, and by how much; a first difference "
                  "of rounding size that then grows is rounding growth, not the frameworks. The rounding control "
                  f"(`{CONTROL}`) is the reference's recipe as one process at the same global batch: it differs "
                  "from the reference only in the order of its sums, so its gap is what rounding alone makes. "
                  "`curve gap` is the largest gap of the validation metric over the epochs, relative to the "
                  "reference's (the findings judge near-identical curves by such a gap).", "",
                  "| workload | GPUs | framework | against | steps | first differing step | difference there | "
                  "past tolerance at | largest | final metric gap | curve gap | cause |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in partings:
            show = lambda v, f: "-" if v is None else format(v, f)
            lines.append(f"| {p.workload} | {p.gpus} | {p.framework} | {p.reference} | {p.steps} | {show(p.first_step, 'd')} "
                         f"| {show(p.first_diff, '.1e')} | {show(p.beyond_step, 'd')} | {p.max_diff:.1e} "
                         f"| {show(p.final_gap, '.1%')} | {show(p.curve_gap, '.1%')} | {p.cause} |")
        lines += ["", *(f"- {line}" for line in explanation(partings))]
    return "\n".join(lines) + "\n"


def write(rows: list[Row], folder: Path, steps: int, partings: list[Parting] = ()) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    md, js = folder / "parity.md", folder / "parity.json"
    md.write_text(markdown(rows, steps, partings))
    js.write_text(json.dumps({"workloads": list(dict.fromkeys(r.workload for r in rows)), "steps": steps,
                              "global_batch": GLOBAL_BATCH,
                              "tolerances": {f"{d}/{p}": t for (d, p), t in TOLERANCE.items()},
                              "rows": [asdict(r) for r in rows], "partings": [asdict(p) for p in partings]}, indent=2))
    return [md, js]


def failed(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status == FAIL]
