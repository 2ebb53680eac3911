"""From MLflow runs to one result per matrix cell (missing and failed cells included); the repeats
of a cell are folded into one result with their median and a 95% interval."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from repro import names
from repro.cell import Cell
from repro.report import settings as run_settings

METRIC = {"gpt2": (names.VAL_PERPLEXITY, False), "vgg16": (names.VAL_ACCURACY, True)}  # (key, higher is better)


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
    activation_bytes: float | None = None  # tensors saved for backward, peak (repro.activation)
    estimated_peak_bytes: float | None = None  # model state + activations: a GPU's peak, estimated on CPU
    comm_bytes: float | None = None  # payload handed to communication per step, busiest rank (repro.communication)
    flops: dict[str, float | None] = field(default_factory=dict)  # one step's counted FLOPs by phase, busiest rank (repro.flops)
    facts: dict[str, Any] = field(default_factory=dict)  # the adapter's setup decisions (params adapter.*)
    settings: dict[str, str] = field(default_factory=dict)  # what the framework trains with (report.settings)
    memory_method: str = ""
    resumed_from_step: str = ""  # set when the run was stopped and continued from a checkpoint
    step_s: dict[str, list[float]] = field(default_factory=dict)  # median, p10, p90, framework_median -> per-epoch values
    seeds: list[int] = field(default_factory=list)  # master seed of each finished repeat
    repeat_epoch_s: list[float] = field(default_factory=list)  # each finished repeat's median epoch time

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED" and bool(self.epoch_s)

    @property
    def epoch_time(self) -> float | None:
        """Median epoch time (robust to a slow first epoch); over repeats, the median of theirs."""
        if self.repeat_epoch_s:
            return statistics.median(self.repeat_epoch_s)
        return statistics.median(self.epoch_s) if self.epoch_s else None

    def step_time(self, key: str = "median") -> float | None:
        """The median over epochs of the epochs' step-time `key` (median, p10, p90 or framework_median)."""
        values = self.step_s.get(key)
        return statistics.median(values) if values else None

    def framework_step_time(self) -> float | None:
        """The framework's step, what the step-time model predicts (repro.model.time): the median of each
        step less the loop's own time in it (repro.metrics.framework_median; None for runs logged before
        2026-12-06, which kept the loop's mean alone)."""
        return self.step_time("framework_median")

    def epoch_interval(self) -> tuple[float, float, float] | None:
        """(low, high, coverage) of the median epoch time over the repeats (None with fewer than 2)."""
        return median_interval(self.repeat_epoch_s) if len(self.repeat_epoch_s) >= 2 else None

    def separated_from(self, other: "Result") -> bool:
        """Whether the two cells' epoch-time intervals do not overlap (False without repeats)."""
        mine, theirs = self.epoch_interval(), other.epoch_interval()
        return bool(mine and theirs and (mine[1] < theirs[0] or theirs[1] < mine[0]))

    @property
    def mean_throughput(self) -> float | None:
        return statistics.median(self.throughput) if self.throughput else None

    @property
    def final_metric(self) -> float | None:
        return self.val[-1] if self.val else None

    @property
    def last_epoch_change(self) -> float | None:
        """Relative change of the validation metric over the last epoch: a curve changing by less than
        3% there is on its plateau (issue 28's definition; None: fewer than two epochs)."""
        return (self.val[-1] - self.val[-2]) / abs(self.val[-2]) if len(self.val) >= 2 and self.val[-2] else None

    @property
    def samples_per_epoch(self) -> int | None:
        """Training samples in one epoch (an epoch's throughput is its samples over its time)."""
        return round(self.throughput[0] * self.epoch_s[0]) if self.throughput and self.epoch_s else None

    def epochs_to_target(self) -> int | None:
        """Epochs until the validation metric first reaches the target: statistical efficiency per
        sample, which the hardware does not change."""
        if self.target is None:
            return None
        higher = METRIC[self.cell.workload][1]
        for epoch, value in enumerate(self.val, 1):
            if (value >= self.target) if higher else (value <= self.target):
                return epoch
        return None

    def samples_to_target(self) -> int | None:
        epochs = self.epochs_to_target()
        return None if epochs is None or self.samples_per_epoch is None else epochs * self.samples_per_epoch

    def time_to_target(self) -> float | None:
        """Training wall-clock (validation excluded) until the validation metric first reaches the target."""
        if self.target is None:
            return None
        higher = METRIC[self.cell.workload][1]
        for value, elapsed in zip(self.val, self.elapsed_s):
            if (value >= self.target) if higher else (value <= self.target):
                return elapsed
        return None


def not_separable(a: Result, b: Result) -> str | None:
    """"not separable at N repeats" when both cells were repeated and their intervals overlap, else None."""
    if a.epoch_interval() and b.epoch_interval() and not a.separated_from(b):
        return f"not separable at {min(len(a.repeat_epoch_s), len(b.repeat_epoch_s))} repeats"
    return None


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free interval for the median from order statistics (the sign test), with its
    coverage: the narrowest [x_(k), x_(n+1-k)] covering at least `level`. Below 6 values no pair of
    order statistics reaches 95%; then it is [min, max] and the coverage says what it is (75% at 3)."""
    ordered, n = sorted(values), len(values)
    below = lambda k: sum(math.comb(n, i) for i in range(k)) / 2**n  # P(fewer than k values below the median)
    k = 1
    while k + 1 <= n // 2 and 1 - 2 * below(k + 1) >= level:
        k += 1
    return ordered[k - 1], ordered[n - k], 1 - 2 * below(k)


def fold_repeats(results: list[Result]) -> list[Result]:
    """One result per cell: the first repeat's, carrying every finished repeat's epoch time and seed."""
    folded: dict[tuple[str, str, int], Result] = {}
    for r in results:
        key = (r.cell.workload, r.cell.row, r.cell.gpus)
        first = folded.setdefault(key, r)
        if r.ok and r.cell.recipe:
            first.repeat_epoch_s.append(statistics.median(r.epoch_s))
            first.seeds.append(r.cell.recipe.seed)
    return list(folded.values())


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
    """The newest finished run of each cell (by recipe fingerprint), else its newest run, or why there is
    none: a later duplicate that failed or was stopped does not hide a finished result."""
    from repro.tracking import client

    mlflow_client = client(uri)
    newest: dict[str, Any] = {}
    for run in search_runs(uri, experiment):  # newest first
        key = run.data.tags.get(names.RECIPE_SHA256)
        if key not in newest or (run.info.status == "FINISHED" and newest[key].info.status != "FINISHED"):
            newest[key] = run
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
            cell, run.info.status, error=run.data.tags.get(names.ERROR, ""), run_id=run_id,
            target=cell.recipe.train.target_metric,
            epoch_s=history(mlflow_client, run_id, names.EPOCH_TIME),
            elapsed_s=history(mlflow_client, run_id, names.ELAPSED),
            val=history(mlflow_client, run_id, key),
            throughput=history(mlflow_client, run_id, names.THROUGHPUT),
            peak_bytes=run.data.metrics.get(names.PEAK_MEMORY),
            model_state_bytes=run.data.metrics.get(names.MODEL_STATE),
            activation_bytes=run.data.metrics.get(names.ACTIVATION_PEAK),
            estimated_peak_bytes=run.data.metrics.get(names.ESTIMATED_PEAK),
            comm_bytes=run.data.metrics.get(names.COMM_BYTES),
            flops={phase: run.data.metrics.get(names.FLOPS.format(phase)) for phase in names.FLOP_PHASES},
            facts={k.removeprefix("adapter."): json.loads(v) for k, v in run.data.params.items() if k.startswith("adapter.")},
            settings=run_settings.from_params(run.data.params, cell.recipe),
            memory_method=run.data.tags.get(names.MEMORY_METHOD, ""),
            resumed_from_step=run.data.tags.get(names.RESUMED_FROM_STEP, ""),
            step_s={k: history(mlflow_client, run_id, names.STEP_TIME.format(k))
                    for k in ("median", "p10", "p90", "framework_median")},
        ))
    return fold_repeats(results)
