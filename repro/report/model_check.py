"""reports/model_check.{md,json}: every finished cell's counted figures against the cost model.

For each cell, model state (memory/model_state_bytes), activation peak (memory/activation_peak_bytes),
payload per step (comm/bytes_per_step) and one step's FLOPs by phase (flops/*), busiest rank, against
the cost model's figures for the cell's recipe, with the relative error and the bound it is held to
(costs.BOUNDS, costs.FLOP_BOUNDS). A cell whose framework has no model, or a quantity the model
leaves open, says so instead of a verdict. Each run logged the same check on its own MLflow run when it
ended (names.MODEL_CHECK: repro.model.check).

Step time: each CPU cell of no more processes than the machine has cores, the framework's measured
median step against repro.model.time's on this machine's calibrated profile (repro.calibrate), held to
time.BOUND a cell and time.MEDIAN_BOUND over the cells' median; logged on each cell's run as
names.STEP_TIME_PREDICTED and names.STEP_TIME_ERROR (`log_step_times`).
"""
from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from typing import Any

from repro import names, registry
from repro.model import check as model_check, costs, time
from repro.model.platforms import Platform
from repro.report.collect import Result
from repro.report.evidence import Prediction, Predictor

QUANTITY_METRIC = {"model_state": "model_state_bytes", "activations": "activation_bytes", "comm": "comm_bytes"}


def check(result: Result, platform: Platform | None = None, cores: int = 0,
          retimed: dict[tuple[str, object], list[float]] | None = None) -> dict[str, Any]:
    """One cell's comparison: {"cell", "run_id", "rows"} or {"cell", "why"} where there is none; with this
    machine's `platform`, a step-time row for a CPU cell of at most `cores` processes (`step_time_row`),
    measured at the median of the run's own step and those `retimed` holds for the cell's framework settings
    and shape (repro.framework_overhead.retimed: the same recipe timed again beside its calibration runs)."""
    out: dict[str, Any] = {"cell": result.cell.label, "row": result.cell.row, "run_id": result.run_id}
    measured = {quantity: getattr(result, name) for quantity, name in QUANTITY_METRIC.items()}
    measured.update({f"flops_{phase}": count for phase, count in result.flops.items()})
    checked = {**out, **model_check.check(result.cell.recipe, result.facts, measured)}
    processes = registry.plan_class(result.cell.recipe.run.framework).processes(result.cell.recipe)
    if "rows" in checked and platform is not None and processes <= cores:
        cell = costs.cell_of(result.cell.recipe, result.facts)
        if cell.device == "cpu":
            step = time.step_time(cell, platform)
            again = (retimed or {}).get((time.framework_key(cell), cell.shape), [])
            checked["rows"].append(step_time_row(result.framework_step_time(), step.total_s, step.framework_s, again))
    return checked


def step_time_row(measured: float | None, modelled: float, own: float = 0.0, again: list[float] = ()) -> dict[str, Any]:
    """A row like costs.compare's for the step time: the framework's measured median step (seconds, the
    loop's time between steps left out: Result.framework_step_time), the median of the run's and the
    timings `again` of the same recipe, as the framework's own time is the median of its passes', against
    the model's on this machine, `own` of it the framework's own time as calibrated at two other sizes
    (repro.framework_overhead). "timings": every one read."""
    timings = [t for t in (measured, *again) if t]
    typical = statistics.median(timings) if measured else None  # a run that timed nothing has no row, whatever was retimed
    error = None if not typical else abs(typical - modelled) / typical
    return {"quantity": "step_time", "unit": "seconds", "measured": typical, "modelled": modelled, "error": error,
            "bound": time.BOUND, "within": None if error is None else error <= time.BOUND, "framework_own": own,
            "timings": timings}


def checks(results: list[Result], platform: Platform | None = None, cores: int = 0,
           retimed: dict[tuple[str, object], list[float]] | None = None) -> list[dict[str, Any]]:
    return [check(r, platform, cores, retimed) for r in results if r.ok and r.cell.recipe]


def step_time_errors(checked: list[dict[str, Any]]) -> list[float]:
    return [row["error"] for cell in checked for row in cell.get("rows", [])
            if row["quantity"] == "step_time" and row["error"] is not None]


def median_step_time_error(checked: list[dict[str, Any]]) -> float | None:
    """The median of the step-time rows' errors: the model's checked error that timing predictions quote."""
    errors = step_time_errors(checked)
    return statistics.median(errors) if errors else None


def step_time_verdict(checked: list[dict[str, Any]]) -> str:
    """"median error 6.3% over 31 cells, 24 within 20%: **does not hold**": both bounds, each named."""
    errors, median = step_time_errors(checked), median_step_time_error(checked)
    within = sum(error <= time.BOUND for error in errors)
    holds = median <= time.MEDIAN_BOUND and within == len(errors)
    return (f"median error {median:.1%} over {len(errors)} cells, {within} within {time.BOUND:.0%}: "
            f"{'holds' if holds else '**does not hold**'}")


def setting_checks(results: list[Result]) -> list[dict[str, Any]]:
    """The runs with memory settings (repro.parity.setting_cells), each with its settings named: its check,
    or why there is none (no finished run, a framework not installed here)."""
    checked = []
    for result in results:
        named = {"settings": settings_named(result) if result.cell.recipe else ""}
        if result.ok:
            checked.append({**check(result), **named})
            continue
        why = result.error if result.status == "skipped" else f"no finished run ({result.status}) {result.error}".strip()
        checked.append({"cell": result.cell.label, "row": result.cell.row, "run_id": result.run_id, **named, "why": why})
    return checked


def settings_named(result: Result) -> str:
    """'recompute full of 1 blocks, 2 micro-batches of 2': the memory settings a run trained with (its
    `effective.*`: the framework's own names, torchgpipe's checkpoint mode say; the recipe's sizes)."""
    train, settings = result.cell.recipe.train, result.settings
    layers = f" of {train.recompute_layers} blocks" if train.recompute_layers else ""
    micro = f" of {train.micro_batch}" if train.micro_batch else ""
    count = settings.get("micro_batches", "1")
    return f"recompute {settings.get('recompute', 'none')}{layers}, {count} micro-batch{'' if count == '1' else 'es'}{micro}"


def markdown(checked: list[dict[str, Any]], with_settings: list[dict[str, Any]] = ()) -> str:
    lines = ["# Counted against modelled, per cell (busiest rank)", "",
             "Bounds: " + ", ".join(f"{q.replace('_', ' ')} {b:.0%}" for q, b in {**costs.BOUNDS, **costs.FLOP_BOUNDS}.items()) +
             ". The model: repro/model/costs.py; what it says at paper scale: `repro predict`.", "",
             "| cell | quantity | measured | modelled | error | within |", "|---|---|---|---|---|---|"]
    median = median_step_time_error(checked)
    if median is not None:
        lines[2:2] = [f"Step time (seconds; cells of no more processes than cores, on this machine's calibrated profile, "
                      f"the measured median less the loop's own time between steps, the median of the matrix's run and the same "
                      f"recipe's runs beside its calibration, as the own times are the median of theirs): each within {time.BOUND:.0%}, "
                      f"their median error at most {time.MEDIAN_BOUND:.0%}; {step_time_verdict(checked)}. "
                      "The model: repro/model/time.py, "
                      "docs/time.md; at paper scale: `repro predict --platform lassen|thetagpu`. A modelled step time "
                      "names in brackets the framework's own time within it: measured at two model sizes the check does "
                      "not use and read on the line between them (repro/framework_overhead.py), "
                      "not counted.", ""]
    lines += table_lines(checked)
    if with_settings:
        lines += ["", "## Runs with memory settings: recompute and micro-batches", "",
                  "The parity section's configurations that recompute or accumulate gradients over micro-batches "
                  "(repro/parity.py: `MEMORY_SETTINGS`; 4 steps at global batch 8 on each workload's reduced model), "
                  "their counted runs against the model for their recipes, held to the same bounds.", "",
                  "| run | settings | quantity | measured | modelled | error | within |", "|---|---|---|---|---|---|---|"]
        lines += table_lines(with_settings)
    return "\n".join(lines) + "\n"


def table_lines(checked: list[dict[str, Any]]) -> list[str]:
    """One line per checked quantity (or one saying why a cell has no check); a settings column where named."""
    lines = []
    for cell in checked:
        label = cell["cell"] + (f" | {cell['settings']}" if "settings" in cell else "")
        if "why" in cell:
            lines.append(f"| {label} | | | | | {cell['why']} |")
            continue
        for row in cell["rows"]:
            verdict = {True: "yes", False: "**no**", None: "not counted" if row["measured"] is None else "not modelled"}
            error = "" if row["error"] is None else f"{row['error']:.2%}"
            own = f" (own {fmt(row['framework_own'], 'seconds')})" if row.get("framework_own") else ""
            timings = row.get("timings", [])
            spread = (f" (median of {len(timings)}: {fmt(min(timings), 'seconds')} to {fmt(max(timings), 'seconds')})"
                      if len(timings) > 1 else "")
            lines.append(f"| {label} | {row['quantity']} | {fmt(row['measured'], row['unit'])}{spread} | {fmt(row['modelled'], row['unit'])}{own} | "
                         f"{error} | {verdict[row['within']]} |")
    return lines


def paper_predictor(checked: list[dict[str, Any]]) -> Predictor:
    """The cost model at paper scale for the findings and answers: each cell's predicted memory per GPU
    (model state + activations, where both are modelled) and payload per step, with the largest error
    that the same framework's cells showed here against the counters; and its epoch time on each
    shipped platform profile (repro.model.time), with the median step-time error of this job's check."""
    from repro.model import platforms
    from repro.model.predict import epoch_seconds, predict_row

    profiles = {name: platforms.load(name) for name in platforms.SHIPPED}
    time_error, time_cells = median_step_time_error(checked), len(step_time_errors(checked))

    @functools.lru_cache(maxsize=None)  # findings and answers ask for the same cells again
    def predicted(workload: str, row: str, gpus: int) -> Prediction | None:
        prediction = predict_row(workload, row, gpus)
        if prediction is None:
            return None
        epochs = {name: epoch_seconds(workload, row, gpus, profile) for name, profile in profiles.items()}
        return Prediction(prediction.estimated_peak, prediction.comm_bytes, *checked_errors(checked, row),
                          model_state_bytes=prediction.model_state,
                          epoch_s={name: s for name, s in epochs.items() if s is not None},
                          time_error=time_error, time_cells=time_cells)

    return predicted


def checked_errors(checked: list[dict[str, Any]], row: str) -> tuple[dict[str, float], int]:
    """The largest error per quantity over this row's checked cells here, and how many cells were checked."""
    worst: dict[str, float] = {}
    cells = [cell for cell in checked if cell["row"] == row and "rows" in cell]
    for cell in cells:
        for entry in cell["rows"]:
            if entry["error"] is not None:
                worst[entry["quantity"]] = max(worst.get(entry["quantity"], 0.0), entry["error"])
    return worst, len(cells) if worst else 0


def fmt(value: float | None, unit: str = "bytes") -> str:
    """Bytes and FLOPs as integers, seconds to 4 significant digits."""
    if value is None:
        return ""
    return f"{value:.4g}" if unit == "seconds" else f"{int(value):,}"


def write(folder: Path, checked: list[dict[str, Any]], with_settings: list[dict[str, Any]] = ()) -> list[Path]:
    """The report of the matrix's cells and of the runs with memory settings (those carry "settings")."""
    (folder / "model_check.md").write_text(markdown(checked, with_settings))
    (folder / "model_check.json").write_text(json.dumps([*checked, *with_settings], indent=2))
    return [folder / "model_check.md", folder / "model_check.json"]


def log_step_times(uri: str, checked: list[dict[str, Any]]) -> None:
    """Each cell's step-time row on its own MLflow run (the rest of its check the run logged when it ended)."""
    from repro import tracking

    for cell in checked:
        for row in cell.get("rows", []):
            if row["quantity"] == "step_time":
                values = {names.STEP_TIME_PREDICTED: row["modelled"]}
                if row["error"] is not None:
                    values[names.STEP_TIME_ERROR] = row["error"]
                tracking.Run.connect(uri, cell["run_id"]).log_values(values)


def check_run(recipe: Any, uri: str, experiment: str) -> str | None:
    """A single `repro run`'s step-time check, logged on its MLflow run (`log_step_times`): on a CPU with
    no more processes than cores, its step time against this machine's profile (calibrated on first use
    and kept beside the store and in the user's cache: repro.calibrate.shared_folder). One line with the
    verdict, or None."""
    from repro import calibrate
    from repro.cell import Cell
    from repro.hardware import cpu_cores
    from repro.report.collect import collect

    processes = registry.plan_class(recipe.run.framework).processes(recipe)
    if costs.cell_of(recipe).device != "cpu" or processes > cpu_cores():
        return None
    cell = Cell(recipe.workload, recipe.run.framework, recipe.run.framework, recipe.run.gpus, recipe)
    results = [result for result in collect([cell], uri, experiment) if result.ok]
    if not results:
        return None
    platform = calibrate.calibrated(calibrate.store_folder(uri), shared=True)
    checked = checks(results, platform, cpu_cores())
    log_step_times(uri, checked)
    row = next((row for row in checked[0].get("rows", []) if row["quantity"] == "step_time"), None)
    if row is None or row["error"] is None:
        return None
    own = time.framework_key(costs.cell_of(recipe, results[0].facts)) in platform.frameworks
    return (f"step-time check: measured {row['measured'] * 1e3:.1f} ms, modelled {row['modelled'] * 1e3:.1f} ms "
            f"(error {row['error']:.1%}, bound {row['bound']:.0%}; repro/model/time.py)" + ("" if own else
            f"; the model's terms only: {platform.path} holds no own time of {recipe.run.framework} at "
            f"{processes} process{'es' * (processes > 1)} with these settings (`repro calibrate` measures the matrix's cells)"))
