"""reports/model_check.{md,json}: every finished cell's counted figures against the cost model.

For each cell, model state (memory/model_state_bytes), activation peak (memory/activation_peak_bytes),
payload per step (comm/bytes_per_step) and one step's FLOPs by phase (flops/*), busiest rank, against
repro.model.costs's and repro.model.flops's figures for the cell's recipe, with the relative error and the bound it is held to (costs.BOUNDS). A cell whose
framework has no model, or a quantity the model leaves open, says so instead of a verdict. The model's
figure and error are also logged on the cell's own MLflow run (names.MODEL_CHECK).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from repro import names
from repro.model import costs, flops
from repro.report.collect import Result
from repro.report.evidence import Prediction, Predictor

QUANTITY_METRIC = {"model_state": "model_state_bytes", "activations": "activation_bytes", "comm": "comm_bytes"}


def check(result: Result) -> dict[str, Any]:
    """One cell's comparison: {"cell", "run_id", "rows"} or {"cell", "why"} where there is none."""
    out: dict[str, Any] = {"cell": result.cell.label, "row": result.cell.row, "run_id": result.run_id}
    try:
        cell = costs.cell_of(result.cell.recipe, result.facts)
        prediction, counted = costs.predict(cell), flops.process_flops(cell)
    except (KeyError, ValueError) as error:
        return {**out, "why": f"not modelled: {error.args[0]}"}
    measured = {quantity: getattr(result, name) for quantity, name in QUANTITY_METRIC.items()}
    measured.update({f"flops_{phase}": count for phase, count in result.flops.items()})
    return {**out, "rows": costs.compare(prediction, measured, counted)}


def checks(results: list[Result]) -> list[dict[str, Any]]:
    return [check(r) for r in results if r.ok and r.cell.recipe]


def markdown(checked: list[dict[str, Any]]) -> str:
    lines = ["# Counted against modelled, per cell (busiest rank)", "",
             "Bounds: " + ", ".join(f"{q.replace('_', ' ')} {b:.0%}" for q, b in {**costs.BOUNDS, **costs.FLOP_BOUNDS}.items()) +
             ". The model: repro/model/costs.py; what it says at paper scale: `repro predict`.", "",
             "| cell | quantity | measured | modelled | error | within |", "|---|---|---|---|---|---|"]
    for cell in checked:
        if "why" in cell:
            lines.append(f"| {cell['cell']} | | | | | {cell['why']} |")
            continue
        for row in cell["rows"]:
            verdict = {True: "yes", False: "**no**", None: "not counted" if row["measured"] is None else "not modelled"}
            error = "" if row["error"] is None else f"{row['error']:.2%}"
            lines.append(f"| {cell['cell']} | {row['quantity']} | {fmt(row['measured'])} | {fmt(row['modelled'])} | "
                         f"{error} | {verdict[row['within']]} |")
    return "\n".join(lines) + "\n"


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


def write(folder: Path, checked: list[dict[str, Any]], uri: str | None = None) -> list[Path]:
    """Write the report of `checks` and, with `uri`, log each cell's modelled figures and errors on its run."""
    (folder / "model_check.md").write_text(markdown(checked))
    (folder / "model_check.json").write_text(json.dumps(checked, indent=2))
    if uri:
        log(uri, checked)
    return [folder / "model_check.md", folder / "model_check.json"]


def log(uri: str, checked: list[dict[str, Any]]) -> None:
    from repro import tracking

    for cell in checked:
        values = {}
        for row in cell.get("rows", []):
            if row["modelled"] is not None:
                values[names.MODEL_CHECK.format(row["quantity"], row["unit"])] = row["modelled"]
            if row["error"] is not None:
                values[names.MODEL_CHECK.format(row["quantity"], "error")] = row["error"]
        if values:
            tracking.Run.connect(uri, cell["run_id"]).log_values(values)
