"""A run's counted figures against the cost model: the check every run makes of itself when it ends
(repro.run.follower) and each row of reports/model_check.md (repro.report.model_check).

A check is {"rows": costs.compare's rows} or, where the model has nothing to say of the run's recipe,
{"why": "not modelled: ..."}. The same check becomes the run's MLflow metrics (names.MODEL_CHECK) and
the line `repro run` ends with.
"""
from __future__ import annotations

from typing import Any

from repro import names
from repro.model import costs, flops

QUANTITY_NAMES = {"model_state": "model state", "activations": "activations", "comm": "communication",
                  "flops_forward": "forward FLOPs", "flops_backward": "backward FLOPs", "flops_recompute": "recompute FLOPs"}


def check(recipe: Any, facts: dict[str, Any] | None, measured: dict[str, Any]) -> dict[str, Any]:
    """`recipe`'s modelled figures against `measured` (quantity -> counted bytes or FLOPs, None: not
    counted); `facts`: the adapter's setup decisions (costs.cell_of)."""
    try:
        cell = costs.cell_of(recipe, facts)
        prediction, counted = costs.predict(cell), flops.process_flops(cell)
    except (KeyError, ValueError) as error:
        return {"why": f"not modelled: {error.args[0]}"}
    return {"rows": costs.compare(prediction, measured, counted)}


def of_events(recipe: Any, start: dict[str, Any] | None, epoch: dict[str, Any] | None) -> dict[str, Any]:
    """The check of a run from its events: the adapter's facts of its (last) start event, the counters of
    its last epoch event (they keep their high-water marks from epoch to epoch)."""
    if epoch is None:
        return {"why": "not counted: the run finished no epoch"}
    facts = (start or {}).get("adapter")
    return check(recipe, facts, costs.measured_of(epoch["ranks"]))


def metrics(checked: dict[str, Any]) -> dict[str, float]:
    """The check as MLflow metrics: each quantity's modelled bytes (FLOPs: count) and relative error, where
    there is one."""
    values = {}
    for row in checked.get("rows", []):
        if row["modelled"] is not None:
            values[names.MODEL_CHECK.format(row["quantity"], row["unit"])] = row["modelled"]
        if row["error"] is not None:
            values[names.MODEL_CHECK.format(row["quantity"], "error")] = row["error"]
    return values


def summary(checked: dict[str, Any]) -> str:
    """One line: 'model check: model state 0.00% (bound 1%), activations 0.31% (bound 5%), ...', an error
    past its bound marked OUT OF BOUND, or why there is no check."""
    if "why" in checked:
        return f"model check: {checked['why']}"
    parts = []
    for row in checked["rows"]:
        name = QUANTITY_NAMES[row["quantity"]]
        if row["error"] is None:
            parts.append(f"{name} {'not counted' if row['measured'] is None else 'not modelled'}")
            continue
        verdict = "" if row["within"] else ": OUT OF BOUND"
        parts.append(f"{name} {row['error']:.2%} (bound {row['bound']:.0%}{verdict})")
    return "model check: " + ", ".join(parts)
