"""What the findings and the research-question answers judge from: the index of a matrix's results,
what its cells can show on this machine, and the cost model's paper-scale figures.

A verdict is `holds` or `does not hold` with the numbers, else `not testable here` with the reason
(four processes on two cores measure contention, not frameworks; runs that train with different
optimizers measure the optimizers), or `not enough data` when cells are missing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from repro.recipe import configs_dir
from repro.report.collect import METRIC, Result, not_separable

HOLDS, FAILS, NOT_TESTABLE, UNKNOWN = "holds", "does not hold", "not testable here", "not enough data"
INCONCLUSIVE = "inconclusive"  # the convergence study's intervals decide neither way (repro.convergence)


def thresholds_path() -> Path:
    return configs_dir() / "findings.yaml"


@dataclass
class Prediction:
    """A cost model's figures for one paper-scale cell (the modelling issue's model), with the model's
    errors against this machine's counters in the same matrix row's smoke cells."""
    memory_bytes: float | None  # per GPU
    comm_bytes: float | None  # sent per GPU per training step
    errors: dict[str, float] = field(default_factory=dict)  # quantity -> largest relative error of the row's cells
    checked_cells: int = 0  # how many of the row's smoke cells were counted against the model
    model_state_bytes: float | None = None  # per GPU, the part of memory_bytes that is not activations
    epoch_s: dict[str, float] = field(default_factory=dict)  # platform profile -> predicted epoch time (repro.model.time)
    time_error: float | None = None  # the step-time model's median error in this job's check (reports/model_check.md)
    time_cells: int = 0  # the cells that check held it against


# what each predicted figure is checked by: repro.model.costs.compare's quantities
MEMORY_CHECKS, COMM_CHECKS = ("model_state", "activations"), ("comm",)


Predictor = Callable[[str, str, int], "Prediction | None"]  # (workload, matrix row, GPUs) at paper scale


class Results:
    """Index of the successful results, (workload, row, gpus) -> Result, and what they can show."""

    def __init__(self, results: list[Result], cores: int, parity: list[dict[str, Any]] | None = None,
                 predict: Predictor | None = None, partings: list[dict[str, Any]] | None = None,
                 study: dict[str, Any] | None = None):
        self.ok = {(r.cell.workload, r.cell.row, r.cell.gpus): r for r in results if r.ok}
        self.workloads = sorted({w for w, _, _ in self.ok})
        self.cores = cores
        self.parity = parity or []
        self.partings = partings or []  # the parity report's matrix runs step by step, with its rounding control
        self.predict = predict
        self.study = study  # the convergence study's report (repro.convergence.to_json), if it ran

    def get(self, workload: str, row: str, gpus: int) -> Result | None:
        return self.ok.get((workload, row, gpus))

    def gpus(self, workload: str, row: str) -> list[int]:
        return sorted(g for w, r, g in self.ok if w == workload and r == row)

    def at(self, workload: str, gpus: int) -> dict[str, Result]:
        return {r: res for (w, r, g), res in self.ok.items() if w == workload and g == gpus}

    def most_gpus_beside_others(self, workload: str, row: str) -> int | None:
        """The highest GPU count at which `row` ran beside at least one other row (None: nowhere)."""
        return max((g for g in self.gpus(workload, row) if len(self.at(workload, g)) >= 2), default=None)

    @staticmethod
    def on_gpu(result: Result) -> bool:
        return result.memory_method.startswith("cuda")

    def timed(self, results: list[Result]) -> str:
        """Why the epoch times of `results` cannot be compared here ('' when they can)."""
        crowded = max((r.cell.gpus for r in results if not self.on_gpu(r)), default=0)
        if crowded > self.cores:
            return f"{crowded} processes on {self.cores} cores: epoch times measure contention"
        return ""

    def memory(self, result: Result) -> tuple[float | None, str]:
        """Memory per GPU: the allocator's peak on GPU; on CPU stand-ins model state + activations."""
        if self.on_gpu(result):
            return result.peak_bytes, "peak"
        if result.activation_bytes is None or result.model_state_bytes is None:
            return None, "estimated peak"
        return result.model_state_bytes + result.activation_bytes, "estimated peak (model state + activations)"

    def activation_reason(self, results: list[Result]) -> str:
        lacking = [r.cell.label for r in results if not self.on_gpu(r) and r.activation_bytes is None]
        return f"no activation count in {', '.join(lacking)} (runs recorded before the counter)" if lacking else ""


def combine(verdicts: list[str]) -> str:
    for verdict in (FAILS, HOLDS, NOT_TESTABLE):
        if verdict in verdicts:
            return verdict
    return UNKNOWN


def better(workload: str, a: float, b: float) -> bool:
    return a > b if METRIC[workload][1] else a < b


def untimed(res: Results, cells: list[Result]) -> str | None:
    """Why the epoch times of these cells cannot be compared: not testable on this machine, or (two
    repeated cells) their intervals overlap; None when they can."""
    why_not = res.timed(cells)
    if why_not:
        return f"not testable here: {why_not}"
    return not_separable(*cells) if len(cells) == 2 else None


def mib(value: float) -> str:
    return f"{value / 2**20:.2f} MiB"
