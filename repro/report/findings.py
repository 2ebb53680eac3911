"""A verdict on each of the paper's findings, with the measured numbers behind it.

Thresholds and the paper's wording live in configs/findings.yaml; each check here turns the
collected results into `holds`, `does not hold` or `not enough data`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from repro.recipe import configs_dir
from repro.report.collect import METRIC, Result, not_separable

HOLDS, FAILS, UNKNOWN = "holds", "does not hold", "not enough data"
DATA_PARALLEL = ("ddp", "zero", "lbann")


@dataclass
class Finding:
    key: str
    paper: str
    verdict: str
    evidence: str


def thresholds_path() -> Path:
    return configs_dir() / "findings.yaml"


class Results:
    """Index of the successful results: (workload, row, gpus) -> Result."""

    def __init__(self, results: list[Result]):
        self.ok = {(r.cell.workload, r.cell.row, r.cell.gpus): r for r in results if r.ok}
        self.workloads = sorted({w for w, _, _ in self.ok})

    def get(self, workload: str, row: str, gpus: int) -> Result | None:
        return self.ok.get((workload, row, gpus))

    def gpus(self, workload: str, row: str) -> list[int]:
        return sorted(g for w, r, g in self.ok if w == workload and r == row)

    def at(self, workload: str, gpus: int) -> dict[str, Result]:
        return {r: res for (w, r, g), res in self.ok.items() if w == workload and g == gpus}

    def memory(self, result: Result) -> tuple[float | None, str]:
        """Memory per GPU to compare: allocator peak on GPU, model state on CPU stand-ins."""
        if result.memory_method == "cpu_peak_rss":
            return result.model_state_bytes, "model state"
        return result.peak_bytes, "peak"


def combine(verdicts: list[str]) -> str:
    if not verdicts or all(v == UNKNOWN for v in verdicts):
        return UNKNOWN
    return FAILS if FAILS in verdicts else HOLDS


def better(workload: str, a: float, b: float) -> bool:
    return a > b if METRIC[workload][1] else a < b


def data_parallel_curves(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    for w in res.workloads:
        counts = [g for g in sorted({g for (wl, _, g) in res.ok if wl == w}) if sum(
            1 for row in t["rows"] if res.get(w, row, g)) >= 2]
        if not counts:
            continue
        gpus = counts[-1]
        cells = res.at(w, gpus)
        dp = {row: cells[row] for row in t["rows"] if row in cells}
        names = sorted(dp)
        gap = max(
            abs(x - y) / max(abs(y), 1e-12)
            for i, a in enumerate(names) for b in names[i + 1:] for x, y in zip(dp[a].val, dp[b].val)
        )
        timed = {row: r.time_to_target() for row, r in cells.items() if r.time_to_target() is not None}
        if timed:
            best = min(timed, key=timed.get)
            converge = best in t["rows"]
            how = f"first to the target: {best} ({timed[best]:.1f}s)"
        else:
            best = max(cells, key=lambda row: cells[row].final_metric * (1 if METRIC[w][1] else -1))
            converge = best in t["rows"]
            how = f"no run reached the target; best final metric: {best} ({cells[best].final_metric:.4g})"
        verdicts.append(HOLDS if gap <= t["max_relative_gap"] and converge else FAILS)
        notes.append(f"{w} at {gpus} GPUs: largest gap between {', '.join(names)} curves {gap:.1%} "
                     f"(limit {t['max_relative_gap']:.0%}); {how}")
    return combine(verdicts), notes


def zero_memory(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    low, high = t["saving_range"]
    for w in res.workloads:
        counts = [g for g in res.gpus(w, "zero") if g >= t["from_gpus"] and res.get(w, "ddp", g)]
        savings = []
        for g in counts:
            (zm, kind), (dm, _) = res.memory(res.get(w, "zero", g)), res.memory(res.get(w, "ddp", g))
            if zm is None or not dm:
                continue
            saving = 1 - zm / dm
            ratio = res.get(w, "zero", g).epoch_time / res.get(w, "ddp", g).epoch_time
            savings.append(saving)
            in_range = low <= saving <= high
            verdicts.append(HOLDS if in_range and ratio <= t["max_time_ratio"] else FAILS)
            notes.append(f"{w} {g} GPUs: ZeRO {kind} memory {saving:.0%} below DDP; epoch time x{ratio:.2f} of DDP")
        if len(savings) >= 2:
            grows = all(b >= a - 1e-9 for a, b in zip(savings, savings[1:]))
            verdicts.append(HOLDS if grows else FAILS)
            notes.append(f"{w}: saving {'grows' if grows else 'does not grow'} with GPUs "
                         f"({' -> '.join(f'{s:.0%}' for s in savings)})")
    return combine(verdicts), notes


def pipedream_slower(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    for w in res.workloads:
        counts = [g for g in res.gpus(w, "pipedream") if len(res.at(w, g)) >= 2]
        if not counts:
            continue
        gpus = counts[-1]
        cells = res.at(w, gpus)
        mine = cells.pop("pipedream")
        timed = {row: r.time_to_target() for row, r in cells.items() if r.time_to_target() is not None}
        if timed:
            best = min(timed, key=timed.get)
            own = mine.time_to_target()
            slower = own is None or own >= t["slower_factor"] * timed[best]
            own_text = "never" if own is None else f"{own:.1f}s"
            notes.append(f"{w} at {gpus} GPUs: PipeDream reaches the target {own_text}, best other {best} {timed[best]:.1f}s")
        else:
            best = max(cells, key=lambda row: cells[row].final_metric * (1 if METRIC[w][1] else -1))
            gap = abs(mine.final_metric - cells[best].final_metric) / abs(cells[best].final_metric)
            slower = better(w, cells[best].final_metric, mine.final_metric) and gap >= t["worse_metric"]
            notes.append(f"{w} at {gpus} GPUs: no run reached the target; PipeDream's final metric "
                         f"{mine.final_metric:.4g} vs best {best} {cells[best].final_metric:.4g}")
        verdicts.append(HOLDS if slower else FAILS)
    return combine(verdicts), notes


def pipelines_slowest(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    for w in res.workloads:
        for g in sorted({g for (wl, _, g) in res.ok if wl == w}):
            cells = res.at(w, g)
            present = [row for row in t["rows"] if row in cells]
            if len(cells) < t["min_rows"] or not present:
                continue
            ranking = sorted(cells, key=lambda row: cells[row].epoch_time, reverse=True)
            blurred = {not_separable(cells[p], cells[q]) for p in ranking[: len(present)] for q in ranking[len(present):]} - {None}
            if blurred:  # repeated cells whose epoch-time intervals overlap: no ranking to judge
                notes.append(f"{w} {g} GPUs: {min(blurred)} between the slowest rows and the others")
                continue
            slowest = set(ranking[: len(present)]) == set(present)
            verdicts.append(HOLDS if slowest else FAILS)
            notes.append(f"{w} {g} GPUs, slowest first: " + ", ".join(f"{row} {cells[row].epoch_time:.2f}s" for row in ranking))
    return combine(verdicts), notes


def megatron_u_shape(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    for w in res.workloads:
        counts = res.gpus(w, t["row"])
        if len(counts) < 3:
            continue
        cells = [res.get(w, t["row"], g) for g in counts]
        memory = [res.memory(c)[0] for c in cells]
        lowest = memory.index(min(memory))
        u_shape = 0 < lowest < len(memory) - 1
        last_speedup = cells[-2].epoch_time / cells[-1].epoch_time
        flat = last_speedup < t["flat_speedup"]
        verdicts.append(HOLDS if u_shape and flat else FAILS)
        notes.append(f"{w}: {res.memory(cells[0])[1]} memory per GPU at {counts} GPUs: "
                     f"{[round(m / 2**20, 2) for m in memory]} MiB (lowest at {counts[lowest]}); "
                     f"last doubling speeds an epoch up x{last_speedup:.2f} (flat below x{t['flat_speedup']})")
    return combine(verdicts), notes


def pipeline_memory(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    for w in res.workloads:
        for row in t["rows"]:
            counts = res.gpus(w, row)
            if len(counts) < 3:
                continue
            memory = [res.memory(res.get(w, row, g))[0] for g in counts]
            fall, last = memory[0] / memory[-1], memory[-2] / memory[-1]
            holds = fall > t["min_fall"] and last < t["plateau_ratio"]
            verdicts.append(HOLDS if holds else FAILS)
            notes.append(f"{w} {row}: memory falls x{fall:.2f} from {counts[0]} to {counts[-1]} GPUs "
                         f"(needs > x{t['min_fall']}), last step x{last:.2f} (plateau below x{t['plateau_ratio']})")
    return combine(verdicts), notes


CHECKS: dict[str, Callable[[Results, dict[str, Any]], tuple[str, list[str]]]] = {
    "data_parallel_curves": data_parallel_curves,
    "zero_memory": zero_memory,
    "pipedream_slower": pipedream_slower,
    "pipelines_slowest": pipelines_slowest,
    "megatron_u_shape": megatron_u_shape,
    "pipeline_memory": pipeline_memory,
}


def judge(results: list[Result], path: Path | None = None) -> list[Finding]:
    thresholds = yaml.safe_load((path or thresholds_path()).read_text())
    indexed = Results(results)
    findings = []
    for key, check in CHECKS.items():
        verdict, notes = check(indexed, thresholds[key])
        findings.append(Finding(key, " ".join(thresholds[key]["paper"].split()), verdict,
                                "; ".join(notes) or "no cells with the frameworks this finding needs"))
    return findings


def markdown(findings: list[Finding]) -> str:
    lines = ["# The paper's findings on this machine", ""]
    for number, f in enumerate(findings, 1):
        lines += [f"## {number}. {f.key}: **{f.verdict}**", "", f"> {f.paper}", "", f.evidence, ""]
    return "\n".join(lines)

