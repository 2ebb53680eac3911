"""From MLflow runs to one result per matrix cell (missing and failed cells included)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from repro import events
from repro.table2 import Cell

METRIC = {"gpt2": (events.VAL_PERPLEXITY, False), "vgg16": (events.VAL_ACCURACY, True)}  # (key, higher is better)


@dataclass
class Result:
    cell: Cell
    status: str  # FINISHED, FAILED, KILLED, RUNNING, missing, skipped
    error: str = ""
    run_id: str = ""
    target: float | None = None
    epoch_s: list[float] = field(default_factory=list)
    elapsed_s: list[float] = field(default_factory=list)
    val: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    peak_bytes: float | None = None
    model_state_bytes: float | None = None
    memory_method: str = ""
    resumed_from_step: str = ""  # set when the run was stopped and continued from a checkpoint

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED" and bool(self.epoch_s)

    @property
    def epoch_time(self) -> float | None:
        """Median epoch time: robust to a slow first epoch."""
        return statistics.median(self.epoch_s) if self.epoch_s else None

    @property
    def mean_throughput(self) -> float | None:
        return statistics.median(self.throughput) if self.throughput else None

    @property
    def final_metric(self) -> float | None:
        return self.val[-1] if self.val else None

    def time_to_target(self) -> float | None:
        """Training wall-clock (validation excluded) until the validation metric first reaches the target."""
        if self.target is None:
            return None
        higher = METRIC[self.cell.workload][1]
        for value, elapsed in zip(self.val, self.elapsed_s):
            if (value >= self.target) if higher else (value <= self.target):
                return elapsed
        return None


def search_runs(uri: str, experiment: str) -> list[Any]:
    from repro.tracking import client

    mlflow_client = client(uri)
    found = mlflow_client.get_experiment_by_name(experiment)
    if not found:
        return []
    return list(mlflow_client.search_runs([found.experiment_id], max_results=5000, order_by=["attributes.start_time DESC"]))


def history(mlflow_client: Any, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(mlflow_client.get_metric_history(run_id, key), key=lambda m: m.step)]


def collect(cells: list[Cell], uri: str, experiment: str) -> list[Result]:
    """The newest run of each cell (by recipe fingerprint), or why there is none."""
    from repro.tracking import client

    mlflow_client = client(uri)
    newest: dict[str, Any] = {}
    for run in search_runs(uri, experiment):  # newest first
        newest.setdefault(run.data.tags.get("repro.recipe_sha256"), run)
    results = []
    for cell in cells:
        if not cell.recipe:
            results.append(Result(cell, "skipped", error=cell.skip or ""))
            continue
        run = newest.get(cell.recipe.fingerprint())
        if run is None:
            results.append(Result(cell, "missing", error=cell.skip or "no run in MLflow for this recipe"))
            continue
        key, _ = METRIC[cell.workload]
        run_id = run.info.run_id
        results.append(Result(
            cell, run.info.status, error=run.data.tags.get("repro.error", ""), run_id=run_id,
            target=cell.recipe.train.target_metric,
            epoch_s=history(mlflow_client, run_id, events.EPOCH_TIME),
            elapsed_s=history(mlflow_client, run_id, events.ELAPSED),
            val=history(mlflow_client, run_id, key),
            throughput=history(mlflow_client, run_id, events.THROUGHPUT),
            peak_bytes=run.data.metrics.get(events.PEAK_MEMORY),
            model_state_bytes=run.data.metrics.get(events.MODEL_STATE),
            memory_method=run.data.tags.get("repro.memory_method", ""),
            resumed_from_step=run.data.tags.get("repro.resumed_from_step", ""),
        ))
    return results
