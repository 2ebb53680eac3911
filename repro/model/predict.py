"""Predictions of the cost model (repro.model.costs) for the Table 2 matrix, read from the recipe files
without torch: what `repro predict` prints and what findings quote.

A prediction is the model's, checked against the counters at smoke scale (reports/model_check.md,
tests/test_costmodel.py) to costs.BOUNDS, 16-bit runs under autocast and FSDP's bf16 parameters
included; at paper scale Megatron's own bf16 (Float16Module) and GPU-only paths are unchecked until a
GPU run (docs/memory.md, "16-bit activations": one H200 run's peaks against the model).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import yaml

from repro import registry
from repro.hardware import automatic_precision, capability_of
from repro.model import costs
from repro.recipe import fold_framework_train, recipe_path
from repro.shapes import shape_of


# A recipe's `train.precision: auto` is predicted as it trains on the GPU named (repro.hardware.automatic_precision
# by its capability), by default the paper's V100 (Lassen's, the smaller of its GPUs): fp16, whose 2-byte
# activations are bf16's too, and under ZeRO DeepSpeed's fp16 mode (costs.zero)
PREDICTED_GPU = "V100"


def recipe_cell(workload: str, framework: str, gpus: int, scale: str = "paper", sets: Sequence[str] = (),
                gpu: str = PREDICTED_GPU) -> costs.Cell:
    """The model's cell of a recipe file with `sets` ("section.field=value", YAML values) applied, and the
    file's train fields for `framework` (its train_by_framework entry) where `sets` leaves them; `gpu`: the
    device it trains on, which decides `train.precision: auto`."""
    path = recipe_path(workload, scale)
    raw = yaml.safe_load(path.read_text())
    kept = []
    for text in sets:
        key, _, value = text.partition("=")
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
        kept.append(key)
    fold_framework_train(raw, str(path), framework, kept)
    section = dict(raw.get(framework.replace("-", "_")) or {})
    train = raw["train"]
    optimizer = section.get("optimizer") or train["optimizer"]
    options = {**section, "grad_clip": train.get("grad_clip"), "momentum": optimizer.get("momentum", 0.9),
               "weight_decay": optimizer.get("weight_decay", 0.0)}
    shape = shape_of(workload, raw.get("model") or {}, raw["data"]["dataset"])
    recomputed = costs.Cell.recomputed_blocks(shape, train.get("recompute"), train.get("recompute_layers"))
    precision = train.get("precision", "fp32")
    if precision == "auto":
        precision = automatic_precision("cuda", capability_of(gpu))
    return costs.Cell(shape, framework, gpus, train["batch_per_gpu"], optimizer["name"], precision,
                          options, micro_batch=train.get("micro_batch"), recomputed=recomputed,
                          selective=train.get("recompute") == "selective")


def predict(workload: str, framework: str, gpus: int, scale: str = "paper", sets: Sequence[str] = ()) -> costs.Prediction | None:
    """The model's prediction for one cell of the matrix (None where the framework has no model)."""
    try:
        return costs.predict(recipe_cell(workload, framework, gpus, scale, sets))
    except KeyError:
        return None


def matrix_predictions(workload: str, scale: str = "paper", gpu: str = PREDICTED_GPU) -> list[dict[str, Any]]:
    """One row per modelled Table 2 cell of `workload` at `scale` on `gpu`: row name, framework, GPUs, the
    model's cell and its prediction."""
    from repro.matrix import load_matrix

    matrix = load_matrix()
    out = []
    for row in matrix.rows:
        for gpus in matrix.scales[scale].gpus:
            cell = row_cell(workload, row.name, gpus, scale, matrix, gpu)
            prediction = predict_row(workload, row.name, gpus, scale, matrix, cell)
            if prediction is not None:
                out.append({"row": row.name, "framework": row.framework, "gpus": gpus, "cell": cell,
                            "prediction": prediction})
    return out


def row_cell(workload: str, row_name: str, gpus: int, scale: str = "paper", matrix: Any = None,
             gpu: str = PREDICTED_GPU) -> costs.Cell | None:
    """The model's cell of a Table 2 row at `gpus` on `gpu` (None: no such row); `matrix`: table2.yaml,
    loaded if not given."""
    from repro.matrix import load_matrix

    matrix = matrix or load_matrix()
    plan = matrix.scales[scale]
    row = {row.name: row for row in matrix.rows}.get(row_name)
    if row is None:
        return None
    return recipe_cell(workload, row.framework, gpus, scale, row.overrides(gpus, plan.tp_per_node or plan.gpus_per_node), gpu)


def predict_row(workload: str, row_name: str, gpus: int, scale: str = "paper", matrix: Any = None,
                cell: costs.Cell | None = None) -> costs.Prediction | None:
    """The model's prediction for a Table 2 row's cell at `scale` (None: not modelled, or the row's
    settings do not split `gpus`, such as tp=4 on 2 GPUs); `matrix`: table2.yaml, loaded if not given;
    `cell`: the row's, where the caller has it."""
    cell = cell or row_cell(workload, row_name, gpus, scale, matrix)
    try:
        return None if cell is None else costs.predict(cell)
    except (KeyError, ValueError, ZeroDivisionError):
        return None


# The recompute modes the model can express (Cell.recomputed: whole blocks under torch.utils.checkpoint);
# a plan's other modes (megatron-core's selective) are not searched until the model has their terms.
MODELLED_RECOMPUTE = ("full",)


@dataclasses.dataclass(frozen=True)
class Fit:
    """How a cell fits a device's memory (`fit`): the --set overrides chosen (empty: as written) and the
    predicted bytes per GPU under them (Prediction.fit_bytes), or why nothing the framework applies fits."""

    sets: tuple[str, ...]
    peak: int | None  # None: nothing fits
    as_written: int
    why_not: str = ""

    def setting(self) -> str:
        """The chosen setting as command-line options, or "as written"."""
        return as_options(self.sets) or "as written"


def as_options(sets: Sequence[str]) -> str:
    return " ".join(f"--set {text}" for text in sets)


def fit(cell: costs.Cell, capacity: float) -> Fit:
    """The least recompute, then the largest micro-batch, under which `cell`'s predicted peak per GPU is at
    most `capacity` bytes, trying only what the cell's framework applies (its plan's recompute_modes and
    accumulates). Recompute runs each recomputed block's forward again, so no recompute with micro-batches
    comes first, then recompute of the fewest blocks (from the first), each with the largest micro-batch."""
    plan = registry.plan_class(cell.framework)
    as_written = costs.predict(cell).fit_bytes
    if as_written <= capacity:
        return Fit((), as_written, as_written)
    recomputes = bool(set(plan.recompute_modes) & set(MODELLED_RECOMPUTE))
    if not plan.accumulates and not recomputes:
        return Fit((), None, as_written, f"train.recompute and train.micro_batch refused: "
                                        f"{plan.memory_settings_refused_because}")
    # no setting lowers model state (micro-batches only add ZeRO-2's accumulated partition): checked first,
    # so a cell of 10^8 layers is neither listed nor searched block by block
    state = costs.predict(dataclasses.replace(cell, micro_batch=None, recomputed=0)).model_state
    if state > capacity:
        return Fit((), None, as_written, f"over even with every setting: model state alone is {state / 2**30:.2f} GiB")
    blocks = len(cell.shape.blocks()) if recomputes else 0
    micro = micro_batches(cell, plan)
    recomputed = least_recompute(cell, micro[-1], blocks, capacity)
    for size in micro if recomputed is not None else ():
        chosen = dataclasses.replace(cell, recomputed=recomputed, micro_batch=size)
        peak = costs.predict(chosen).fit_bytes
        if peak <= capacity:
            return Fit(overrides(cell, chosen), peak, as_written)
    smallest = dataclasses.replace(cell, recomputed=blocks, micro_batch=micro[-1])
    peak = costs.predict(smallest).fit_bytes
    return Fit((), None, as_written, f"over even with {as_options(overrides(cell, smallest))}: {peak / 2**30:.2f} GiB")


def micro_batches(cell: costs.Cell, plan: type) -> list[int | None]:
    """The micro-batch sizes `plan` can train `cell` with, largest first (None: the whole batch in one pass)."""
    batch = cell.batch_per_gpu
    if not plan.accumulates:
        return [cell.micro_batch]
    return [None if m == batch else m for m in range(batch, 0, -1) if batch % m == 0]


def least_recompute(cell: costs.Cell, micro_batch: int | None, blocks: int, capacity: float) -> int | None:
    """The fewest blocks recomputed (0 to `blocks`) under which `cell` at its smallest micro-batch fits
    `capacity` (None: not even all). Bisection: the peak falls as more blocks are recomputed, each keeping
    its input alone instead of its whole set, and the recomputed one's set once (docs/memory.md)."""
    def fits(recomputed: int) -> bool:
        candidate = dataclasses.replace(cell, recomputed=recomputed, micro_batch=micro_batch)
        return costs.predict(candidate).fit_bytes <= capacity

    if fits(0):
        return 0
    if not blocks or not fits(blocks):
        return None
    low, high = 0, blocks  # low does not fit, high does
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def overrides(start: costs.Cell, chosen: costs.Cell) -> tuple[str, ...]:
    """The --set overrides that turn the recipe of `start` into that of `chosen` (same cell otherwise)."""
    sets, blocks, batch = [], len(start.shape.blocks()), start.batch_per_gpu
    if chosen.recomputed != start.recomputed:
        if not chosen.recomputed:  # the recipe recomputes: undo it, with its recompute_layers if it has one
            sets += ["train.recompute=none", "train.recompute_layers=null"]
        else:
            sets.append("train.recompute=full")
            if chosen.recomputed < blocks or 0 < start.recomputed < blocks:
                sets.append(f"train.recompute_layers={chosen.recomputed}")
    if (chosen.micro_batch or batch) != (start.micro_batch or batch):
        sets.append(f"train.micro_batch={chosen.micro_batch or batch}")
    return tuple(sets)


def matrix_fits(workload: str, capacity: float, scale: str = "paper", gpu: str = PREDICTED_GPU) -> list[dict[str, Any]]:
    """`fit` for every modelled Table 2 cell of `workload` at `scale` on `gpu`: matrix_predictions' rows and the Fit."""
    return [{**entry, "fit": fit(entry["cell"], capacity)} for entry in matrix_predictions(workload, scale, gpu)]


def paper_devices(workload: str, scale: str = "paper") -> list[dict[str, Any]]:
    """matrix_fits against the smaller of the paper's GPUs (its Table 2, V100-16GB), each row with `device`:
    the smallest of the paper's GPUs its recipe fits as set (None: neither), and `why`: where that is not the
    smaller GPU, why nothing fits it (Fit.why_not), or which setting would, that the recipe lacks."""
    from repro.hardware import paper_gpu_memory

    sizes = sorted(paper_gpu_memory().items(), key=lambda item: item[1])
    out = []
    for entry in matrix_fits(workload, sizes[0][1] * 2**30, scale):
        fit = entry["fit"]
        device = next((name for name, size in sizes if fit.as_written <= size * 2**30), None)
        why = "" if device == sizes[0][0] else fit.why_not or f"the recipe does not set {fit.setting()}, which fits {sizes[0][0]}"
        out.append({**entry, "device": device, "why": why})
    return out


def memory_settings(workload: str, row: str, gpus: int, scale: str = "paper") -> str:
    """A Table 2 cell's memory settings as its recipe sets them, in words (what a paper-scale figure assumes)."""
    cell = row_cell(workload, row, gpus, scale)
    if cell is None:
        return "no such row"
    blocks = len(cell.shape.blocks())
    recompute = (f"{'every' if cell.recomputed == blocks else f'{cell.recomputed} of {blocks}'} block recomputed"
                 if cell.recomputed else "every activation kept")
    micro = cell.micro_batch or cell.batch_per_gpu
    return recompute + (f", micro-batches of {micro}" if micro < cell.batch_per_gpu else ", one pass a step")


def zero_saving(workload: str, gpus: int, scale: str = "paper") -> tuple[float, float | None] | None:
    """ZeRO's predicted saving per GPU against DDP, as the recipes set them: (of model state, of the
    estimated peak, model state + activations; None where activations are not modelled)."""
    zero, ddp = predict(workload, "zero", gpus, scale), predict(workload, "ddp", gpus, scale)
    if zero is None or ddp is None:
        return None
    peak = 1 - zero.estimated_peak / ddp.estimated_peak if zero.estimated_peak and ddp.estimated_peak else None
    return 1 - zero.model_state / ddp.model_state, peak


def memory_minimum(memory: dict[int, float]) -> tuple[int, str]:
    """The GPU count where memory per GPU is lowest and the curve's shape: a U where the minimum lies
    inside the counts (the paper's claim for Megatron-intra), else which way it runs."""
    gpus = sorted(memory)
    lowest = min(gpus, key=memory.__getitem__)
    if gpus[0] < lowest < gpus[-1]:
        return lowest, "a U"
    return lowest, f"no U: {'rises' if lowest == gpus[0] else 'falls'} from {gpus[0]} to {gpus[-1]} GPUs"


def over_paper_gpus(peak: float) -> list[str]:
    """The paper's GPUs (its Table 2: hardware.paper_gpu_memory) that a predicted memory per GPU exceeds."""
    from repro.hardware import paper_gpu_memory

    return [name for name, size in paper_gpu_memory().items() if peak > size * 2**30]


def paper_fit(peak: float, model_state: float) -> str:
    """Whether a predicted memory per GPU fits the paper's GPUs and, where it does not, that the paper's
    runs cannot have held it as the recipe is written and which of the model's terms (activations, model
    state) dominates it."""
    from repro.hardware import paper_gpu_memory

    over = over_paper_gpus(peak)
    if not over:
        return f"fits the paper's {' and '.join(paper_gpu_memory())}"
    activations = peak - model_state
    return (f"over the paper's {' and '.join(over)}: its runs there cannot have held this much; "
            f"{'activations' if activations >= model_state else 'model state'} dominate "
            f"({activations / peak:.1%} activations, {model_state / peak:.1%} model state)")


def quoted(values: list[str]) -> str:
    """How findings mark a predicted figure: a prediction of a model checked at smoke scale, not a measurement."""
    bounds = ", ".join(f"{q.replace('_', ' ')} {b:.0%}" for q, b in costs.BOUNDS.items())
    return (f"predicted by the cost model (checked against counted smoke runs to {bounds}; "
            f"Megatron's bf16 activations unchecked): {'; '.join(values)}")


def recipe_dataset(workload: str, scale: str) -> str:
    return yaml.safe_load(recipe_path(workload, scale).read_text())["data"]["dataset"]


def matrix_times(workload: str, platform: Any, scale: str = "paper") -> list[dict[str, Any]]:
    """matrix_predictions' rows with the step time on `platform` (repro.model.time.StepTime), steps an
    epoch and epoch time (None where the dataset's size is not known to the model)."""
    from repro.model import time

    dataset, out = recipe_dataset(workload, scale), []
    for entry in matrix_predictions(workload, scale, platform.device):
        step = time.step_time(entry["cell"], platform)
        steps = time.epoch_steps(entry["cell"], dataset)
        out.append({**entry, "step": step, "epoch_steps": steps, "epoch_s": None if steps is None else steps * step.total_s})
    return out


def epoch_seconds(workload: str, row_name: str, gpus: int, platform: Any, scale: str = "paper") -> float | None:
    """A Table 2 row's predicted epoch time on `platform` (None: not modelled, or the dataset's size unknown)."""
    from repro.model import time

    cell = row_cell(workload, row_name, gpus, scale, gpu=platform.device)
    if cell is None or predict_row(workload, row_name, gpus, scale, cell=cell) is None:
        return None
    steps = time.epoch_steps(cell, recipe_dataset(workload, scale))
    return None if steps is None else steps * time.step_time(cell, platform).total_s


def fastest_split(workload: str, gpus: int, platform: Any, scale: str = "paper") -> list[tuple[int, float]]:
    """Megatron's (tensor-parallel size, step time) at `gpus` for every tp dividing the heads and the GPUs
    (dp = gpus / tp), fastest first: which tensor x data split the model puts first on `platform`."""
    from repro.model import time

    cell = recipe_cell(workload, "megatron", gpus, scale, gpu=platform.device)
    splits = [tp for tp in range(1, gpus + 1) if gpus % tp == 0 and cell.shape.n_head % tp == 0]
    timed = [(tp, time.step_time(dataclasses.replace(cell, options={**cell.options, "tp": tp}), platform).total_s)
             for tp in splits]
    return sorted(timed, key=lambda pair: pair[1])
