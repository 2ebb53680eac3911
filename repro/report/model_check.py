"""reports/model_check.{md,json}: every finished cell's counted figures against the cost model.

For each cell, model state (memory/model_state_bytes), activation peak (memory/activation_peak_bytes),
payload per step (comm/bytes_per_step) and one step's FLOPs by phase (flops/*), busiest rank, against
the cost model's figures for the cell's recipe, with the relative error and the bound it is held to
(costs.BOUNDS, costs.FLOP_BOUNDS). A cell whose framework has no model, or a quantity the model leaves
open, says so instead of a verdict. Each run logged the same check on its own MLflow run when it ended
(names.MODEL_CHECK: repro.model.check).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from repro.model import check as model_check, costs
from repro.report.collect import Result
from repro.report.evidence import Prediction, Predictor

QUANTITY_METRIC = {"model_state": "model_state_bytes", "activations": "activation_bytes", "comm": "comm_bytes"}


def check(result: Result) -> dict[str, Any]:
    """One cell's comparison: {"cell", "run_id", "rows"} or {"cell", "why"} where there is none."""
    out: dict[str, Any] = {"cell": result.cell.label, "row": result.cell.row, "run_id": result.run_id}
    measured = {quantity: getattr(result, name) for quantity, name in QUANTITY_METRIC.items()}
    measured.update({f"flops_{phase}": count for phase, count in result.flops.items()})
    return {**out, **model_check.check(result.cell.recipe, result.facts, measured)}


def checks(results: list[Result]) -> list[dict[str, Any]]:
    return [check(r) for r in results if r.ok and r.cell.recipe]


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
            lines.append(f"| {label} | {row['quantity']} | {fmt(row['measured'])} | {fmt(row['modelled'])} | "
                         f"{error} | {verdict[row['within']]} |")
    return lines


def paper_predictor(checked: list[dict[str, Any]]) -> Predictor:
    """The cost model at paper scale for the findings and answers: each cell's predicted memory per GPU
    (model state + activations, where both are modelled) and payload per step, with the largest error
    that the same framework's cells showed here against the counters."""
    from repro.model.predict import predict_row

    def predicted(workload: str, row: str, gpus: int) -> Prediction | None:
        prediction = predict_row(workload, row, gpus)
        if prediction is None:
            return None
        return Prediction(prediction.estimated_peak, prediction.comm_bytes, *checked_errors(checked, row),
                          model_state_bytes=prediction.model_state)

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


def fmt(value: float | None) -> str:
    return "" if value is None else f"{int(value):,}"


def write(folder: Path, checked: list[dict[str, Any]], with_settings: list[dict[str, Any]] = ()) -> list[Path]:
    """The report of the matrix's cells and of the runs with memory settings (those carry "settings")."""
    (folder / "model_check.md").write_text(markdown(checked, with_settings))
    (folder / "model_check.json").write_text(json.dumps([*checked, *with_settings], indent=2))
    return [folder / "model_check.md", folder / "model_check.json"]
