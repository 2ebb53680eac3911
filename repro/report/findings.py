"""A verdict on each of the paper's findings, with the measured numbers behind it.

The paper's wording, what each finding needs the runs to show, and the thresholds live in
configs/findings.yaml. A check judges a finding only where the runs can show what it needs:
`holds` or `does not hold` with the numbers, else `not testable here` with the reason (four
processes on two cores measure contention, not frameworks; runs that train with different
optimizers measure the optimizers), or `not enough data` when cells are missing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from repro.hardware import cpu_cores
from repro.recipe import configs_dir
from repro.report import settings as run_settings
from repro.report.collect import METRIC, Result, not_separable

HOLDS, FAILS, NOT_TESTABLE, UNKNOWN = "holds", "does not hold", "not testable here", "not enough data"


@dataclass
class Finding:
    key: str
    paper: str
    verdict: str
    evidence: list[str]  # one line per comparison, with its numbers
    needs: list[str] = field(default_factory=list)


def thresholds_path() -> Path:
    return configs_dir() / "findings.yaml"


@dataclass
class Prediction:
    """A cost model's figures for one paper-scale cell (the modelling issue's model), with its error
    where checked against this machine's measurements at smoke scale."""
    memory_bytes: float | None  # per GPU
    comm_bytes: float | None  # sent per GPU per training step
    error: str  # e.g. "memory within 4% of the smoke measurements (reports/model_check.md)"


Predictor = Callable[[str, str, int], "Prediction | None"]  # (workload, matrix row, GPUs) at paper scale


class Results:
    """Index of the successful results, (workload, row, gpus) -> Result, and what they can show."""

    def __init__(self, results: list[Result], cores: int, parity: list[dict[str, Any]] | None = None,
                 predict: Predictor | None = None):
        self.ok = {(r.cell.workload, r.cell.row, r.cell.gpus): r for r in results if r.ok}
        self.workloads = sorted({w for w, _, _ in self.ok})
        self.cores = cores
        self.parity = parity or []
        self.predict = predict

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


def data_parallel_curves(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    """Two clauses: near-identical per-epoch curves (judged on runs with equal settings, else on the
    parity report's), and the best statistical efficiency against wall-clock (judged where timed)."""
    curves, timing, notes = [], [], []
    for w in res.workloads:
        counts = [g for g in sorted({g for (wl, _, g) in res.ok if wl == w})
                  if sum(1 for row in t["rows"] if res.get(w, row, g)) >= 2]
        if not counts:
            continue
        gpus = counts[-1]
        cells = res.at(w, gpus)
        names = sorted(row for row in t["rows"] if row in cells)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                gap = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(cells[a].val, cells[b].val))
                differ = run_settings.differences(cells[a].settings, cells[b].settings, run_settings.TRAINING)
                if differ:
                    curves.append(NOT_TESTABLE)
                    notes.append(f"{w} at {gpus} GPUs: {a} and {b} train differently ({', '.join(differ)}): their "
                                 f"per-epoch curves are {gap:.1%} apart, a gap of the settings, not the frameworks")
                    continue
                curves.append(HOLDS if gap <= t["max_relative_gap"] else FAILS)
                notes.append(f"{w} at {gpus} GPUs: per-epoch curves of {a} and {b} (equal settings) at most "
                             f"{gap:.1%} apart (limit {t['max_relative_gap']:.0%})")
        verdict, note = fewest_samples(cells, t["rows"])
        timing += [verdict] if verdict else []
        notes.append(f"{w} at {gpus} GPUs: {note}")
        why_not = res.timed(list(cells.values()))
        if why_not:
            notes.append(f"{w} at {gpus} GPUs: the wall-clock clause is not testable here: {why_not}")
        else:
            timed = {row: r.time_to_target() for row, r in cells.items() if r.time_to_target() is not None}
            if timed:
                best = min(timed, key=timed.get)
                timing.append(HOLDS if best in t["rows"] else FAILS)
                notes.append(f"{w} at {gpus} GPUs: first to the target: {best} ({timed[best]:.1f}s)")
    if HOLDS not in curves and FAILS not in curves:
        verdict, note = parity_curves(res, t)
        curves.append(verdict)
        notes.append(note)
    return combine(curves + timing), notes


def fewest_samples(cells: dict[str, Result], rows: list[str]) -> tuple[str | None, str]:
    """Statistical efficiency per sample: the rows that reach the target after the fewest training
    samples (hardware does not change it); a verdict on whether one of `rows` is among them."""
    reached = {row: r.samples_to_target() for row, r in cells.items() if r.samples_to_target() is not None}
    if not reached:
        return None, "no row reaches the target: samples to target undefined"
    fewest = min(reached.values())
    best = sorted(row for row, n in reached.items() if n == fewest)
    others = ", ".join(f"{row} {n:,}" for row, n in sorted(reached.items(), key=lambda item: item[1]) if row not in best)
    return (HOLDS if set(best) & set(rows) else FAILS), (
        f"fewest samples to the target: {', '.join(best)} ({fewest:,})" + (f"; then {others}" if others else ""))


def parity_curves(res: Results, t: dict[str, Any]) -> tuple[str, str]:
    """The parity report's data-parallel runs: the same global batch, seed, data order and optimizer
    as one plain process, step by step; near-identical curves there are the frameworks' own."""
    rows = [p for p in res.parity if p["framework"] in t["rows"] and p["max_abs_diff"] is not None]
    if len({p["framework"] for p in rows}) < 2:
        return NOT_TESTABLE, ("no two data-parallel frameworks at equal settings (the matrix's differ or are missing; "
                              f"the parity report has {', '.join(p['name'] for p in rows) or 'none'})")
    worst = max(rows, key=lambda p: p["max_abs_diff"])
    holds = worst["max_abs_diff"] <= t["parity_tolerance"]
    listing = ", ".join(f"{p['name']} {p['max_abs_diff']:.1e}" for p in rows)
    return (HOLDS if holds else FAILS), (
        f"parity report, equal settings ({rows[0]['settings']}): largest per-step loss difference against one "
        f"process over {rows[0]['steps']} steps: {listing} (limit {t['parity_tolerance']:.0e})")


def zero_memory(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    low, high = t["saving_range"]
    for w in res.workloads:
        counts = [g for g in res.gpus(w, "zero") if g >= t["from_gpus"] and res.get(w, "ddp", g)]
        savings = []
        for g in counts:
            zero, ddp = res.get(w, "zero", g), res.get(w, "ddp", g)
            if res.on_gpu(zero):
                (zm, kind), (dm, _) = res.memory(zero), res.memory(ddp)
            else:  # ZeRO partitions model state; activations are the same under both
                (zm, kind), (dm, _) = (zero.model_state_bytes, "model state"), (ddp.model_state_bytes, "")
            if zm is None or not dm:
                continue
            saving = 1 - zm / dm
            savings.append(saving)
            ok = low <= saving <= high
            note = f"{w} {g} GPUs: ZeRO {kind} memory {saving:.0%} below DDP"
            if not res.on_gpu(zero) and res.memory(zero)[0] and res.memory(ddp)[0]:
                note += f" (with activations, estimated peak: {1 - res.memory(zero)[0] / res.memory(ddp)[0]:.0%})"
            why_not = untimed(res, [zero, ddp])
            if why_not:
                note += f"; epoch-time clause {why_not}"
            else:
                ratio = zero.epoch_time / ddp.epoch_time
                ok = ok and ratio <= t["max_time_ratio"]
                note += f"; epoch time x{ratio:.2f} of DDP"
            differ = run_settings.differences(zero.settings, ddp.settings, run_settings.TRAINING)
            notes.append(note + (f"; they train differently ({', '.join(differ)})" if differ else ""))
            verdicts.append(HOLDS if ok else FAILS)
        if len(savings) >= 2:
            grows = all(b >= a - 1e-9 for a, b in zip(savings, savings[1:]))
            verdicts.append(HOLDS if grows else FAILS)
            notes.append(f"{w}: saving {'grows' if grows else 'does not grow'} with GPUs "
                         f"({' -> '.join(f'{s:.0%}' for s in savings)})")
    notes += zero_memory_predicted(res.workloads, t["from_gpus"], (low, high))
    return combine(verdicts), notes


def zero_memory_predicted(workloads: list[str], from_gpus: int, paper: tuple[float, float]) -> list[str]:
    """ZeRO's saving at the paper's scale and GPU counts, from the cost model: a prediction beside the
    paper's figure, not a verdict."""
    from repro.predictions import quoted, zero_saving
    from repro.table2 import load_matrix

    notes = []
    for w in workloads:
        values = []
        for g in (g for g in load_matrix().scales["paper"].gpus if g >= from_gpus):
            saving = zero_saving(w, g)
            if saving:
                state, peak = saving
                values.append(f"{g} GPUs {state:.0%}" + (f" ({peak:.0%} of model state + activations)" if peak is not None else ""))
        if values:
            notes.append(f"{w} at paper scale, ZeRO's model-state saving against DDP (paper: {paper[0]:.0%}-{paper[1]:.0%}), "
                         + quoted(values))
    return notes


def pipedream_slower(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    """Statistical efficiency per sample: epochs to the target, else the final metric."""
    verdicts, notes = [], []
    for w in res.workloads:
        gpus = res.most_gpus_beside_others(w, "pipedream")
        if gpus is None:
            continue
        cells = res.at(w, gpus)
        mine = cells.pop("pipedream")
        reached = {row: r.epochs_to_target() for row, r in cells.items() if r.epochs_to_target() is not None}
        if reached:
            best = min(reached, key=reached.get)
            own = mine.epochs_to_target()
            slower = own is None or own >= t["slower_factor"] * reached[best]
            own_text = "never" if own is None else f"after {own} epochs"
            note = f"{w} at {gpus} GPUs: PipeDream reaches the target {own_text}, best other {best} after {reached[best]}"
        else:
            best = max(cells, key=lambda row: cells[row].final_metric * (1 if METRIC[w][1] else -1))
            gap = abs(mine.final_metric - cells[best].final_metric) / abs(cells[best].final_metric)
            slower = better(w, cells[best].final_metric, mine.final_metric) and gap >= t["worse_metric"]
            note = (f"{w} at {gpus} GPUs: no run reached the target; PipeDream's final metric "
                    f"{mine.final_metric:.4g} vs best {best} {cells[best].final_metric:.4g}")
        differ = run_settings.differences(mine.settings, cells[best].settings)
        notes.append(note + (f"; PipeDream vs {best}: {', '.join(differ)}" if differ else ""))
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
            why_not = res.timed(list(cells.values()))
            if why_not:
                verdicts.append(NOT_TESTABLE)
                notes.append(f"{w} {g} GPUs: not testable here: {why_not}")
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


def memory_series(res: Results, w: str, row: str, label: str, verdicts: list[str],
                  notes: list[str]) -> tuple[list[int], list[Result]] | None:
    """A row's GPU counts and cells for a memory-shape finding (three counts at least), or None; a
    series whose activations these runs cannot show adds its not-testable verdict and note."""
    counts = res.gpus(w, row)
    if len(counts) < 3:
        return None
    cells = [res.get(w, row, g) for g in counts]
    why_not = res.activation_reason(cells)
    if why_not:
        verdicts.append(NOT_TESTABLE)
        notes.append(f"{label}: not testable here: {why_not}")
        return None
    return counts, cells


def megatron_u_shape(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    for w in res.workloads:
        series = memory_series(res, w, t["row"], w, verdicts, notes)
        if series is None:
            continue
        counts, cells = series
        memory = [res.memory(c)[0] for c in cells]
        lowest = memory.index(min(memory))
        u_shape = 0 < lowest < len(memory) - 1
        note = (f"{w}: {res.memory(cells[0])[1]} per GPU at {counts} GPUs: {', '.join(mib(m) for m in memory)} "
                f"(lowest at {counts[lowest]})")
        if not res.on_gpu(cells[0]):
            note += (f"; model state {', '.join(mib(c.model_state_bytes) for c in cells)}, activations "
                     f"{', '.join(mib(c.activation_bytes) for c in cells)}")
        why_not = untimed(res, cells[-2:])
        if why_not:
            note += f"; scaling clause {why_not}"
            verdicts.append(HOLDS if u_shape else FAILS)
        else:
            speedup = cells[-2].epoch_time / cells[-1].epoch_time
            note += f"; last doubling speeds an epoch up x{speedup:.2f} (flat below x{t['flat_speedup']})"
            verdicts.append(HOLDS if u_shape and speedup < t["flat_speedup"] else FAILS)
        notes.append(note)
    return combine(verdicts), notes


def pipeline_memory(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    verdicts, notes = [], []
    for w in res.workloads:
        for row in t["rows"]:
            series = memory_series(res, w, row, f"{w} {row}", verdicts, notes)
            if series is None:
                continue
            counts, cells = series
            memory = [res.memory(c)[0] for c in cells]
            fall, last = memory[0] / memory[-1], memory[-2] / memory[-1]
            verdicts.append(HOLDS if fall > t["min_fall"] and last < t["plateau_ratio"] else FAILS)
            note = (f"{w} {row}: {res.memory(cells[0])[1]} falls x{fall:.2f} from {counts[0]} to {counts[-1]} GPUs "
                    f"(needs > x{t['min_fall']}), last step x{last:.2f} (plateau below x{t['plateau_ratio']})")
            if not res.on_gpu(cells[0]):
                note += (f"; model state {', '.join(mib(c.model_state_bytes) for c in cells)}, activations "
                         f"{', '.join(mib(c.activation_bytes) for c in cells)}")
            notes.append(note)
    return combine(verdicts), notes


def per_epoch_gain(workload: str, a: Result, b: Result) -> float:
    """Mean over the epochs of a's validation metric's relative gain over b's (positive: a is better)."""
    sign = 1 if METRIC[workload][1] else -1
    gains = [sign * (x - y) / abs(y) for x, y in zip(a.val, b.val)]
    return sum(gains) / len(gains)


def curve(result: Result) -> str:
    return ", ".join(f"{v:.4g}" for v in result.val)


def parity_row(res: Results, framework: str) -> dict[str, Any] | None:
    """The parity report's exact row of `framework` that ran (equal settings to one process), if any."""
    rows = [p for p in res.parity if p["framework"] == framework and p["max_abs_diff"] is not None
            and p["status"] in ("pass", "FAIL")]
    return max(rows, key=lambda p: p["gpus"]) if rows else None


def megatron_statistical_efficiency(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    """Per epoch, Megatron-intra against DDP at the lowest and highest GPU counts both ran at."""
    verdicts, notes = [], []
    row, other = t["row"], t["against"]
    for w in res.workloads:
        counts = [g for g in res.gpus(w, row) if res.get(w, other, g)]
        if len(counts) < 2:
            continue
        gains = {}
        for g in (counts[0], counts[-1]):
            mine, theirs = res.get(w, row, g), res.get(w, other, g)
            gains[g] = per_epoch_gain(w, mine, theirs)
            notes.append(f"{w} {g} GPUs: {row} per epoch {curve(mine)} vs {other} {curve(theirs)}: mean per-epoch "
                         f"gain {gains[g]:+.1%}; epochs to target {mine.epochs_to_target() or 'never'} vs "
                         f"{theirs.epochs_to_target() or 'never'}; effective batch "
                         f"{mine.settings.get('global_batch', '?')} vs {theirs.settings.get('global_batch', '?')}")
        low, high = gains[counts[0]], gains[counts[-1]]
        verdicts.append(HOLDS if low >= t["min_gain"] and high < t["min_gain"] and high < low else FAILS)
        notes.append(f"{w}: gain {low:+.1%} at {counts[0]} GPUs, {high:+.1%} at {counts[-1]} (better per epoch: "
                     f"at least {t['min_gain']:+.0%})")
        notes.append(f"{w}: " + attribution(res, res.get(w, row, counts[0]), res.get(w, other, counts[0])))
    return combine(verdicts), notes


def attribution(res: Results, mine: Result, theirs: Result) -> str:
    """What a curve gap between two rows can be put down to: their settings, or the framework."""
    differ = run_settings.differences(mine.settings, theirs.settings, run_settings.TRAINING)
    if not differ:
        return "equal settings: the gap is the frameworks'"
    text = (f"they train differently ({', '.join(differ)}, the paper's per-framework policy): the gap cannot be "
            f"put on the framework alone")
    parity = parity_row(res, mine.cell.framework)
    if parity:
        text += (f"; at equal settings the parity report trains {parity['name']} like one process (largest "
                 f"per-step loss difference {parity['max_abs_diff']:.1e}, {parity['status']}), so the framework's "
                 f"arithmetic is the reference's and the gap is its settings'")
    return text


def hybrid_best_at_scale(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    """At the highest GPU count with a hybrid cell (tp x dp, dp > 1): epoch time where testable, memory
    per GPU measured here, communication per GPU and the paper scale from the cost model where given."""
    verdicts, notes = [], []
    for w in res.workloads:
        counts = [g for g in res.gpus(w, t["row"]) if res.get(w, t["row"], g).cell.recipe.options("megatron").tp < g]
        if not counts:
            continue
        g = counts[-1]
        hybrid = res.get(w, t["row"], g)
        others = {row: res.get(w, row, g) for row in t["against"] if res.get(w, row, g)}
        layout = f"tp={hybrid.cell.recipe.options('megatron').tp} x dp={g // hybrid.cell.recipe.options('megatron').tp}"
        memory = {row: res.memory(r)[0] for row, r in {t["row"]: hybrid, **others}.items() if res.memory(r)[0]}
        if t["row"] not in memory:
            verdicts.append(NOT_TESTABLE)
            notes.append(f"{w} {g} GPUs: memory clause not testable here: {res.activation_reason([hybrid])}")
            continue
        data_parallel = [row for row in t["data_parallel"] if row in memory]
        leaner = all(memory[t["row"]] < memory[row] for row in data_parallel)
        verdicts.append(HOLDS if leaner and data_parallel else FAILS)
        notes.append(f"{w} {g} GPUs: {t['row']} ({layout}) {res.memory(hybrid)[1]} per GPU "
                     f"{mib(memory[t['row']])}; " + ", ".join(f"{row} {mib(m)}" for row, m in memory.items() if row != t["row"])
                     + f" ({'below' if leaner else 'not below'} every data-parallel row)")
        why_not = untimed(res, [hybrid, *others.values()])
        if why_not:
            notes.append(f"{w} {g} GPUs: timing clause {why_not}; the verdict rests on memory and communication")
        else:
            fastest = min(others, key=lambda row: others[row].epoch_time)
            quicker = hybrid.epoch_time <= others[fastest].epoch_time
            verdicts.append(HOLDS if quicker else FAILS)
            notes.append(f"{w} {g} GPUs: epoch time {t['row']} {hybrid.epoch_time:.2f}s, fastest other {fastest} "
                         f"{others[fastest].epoch_time:.2f}s")
        verdicts += predicted_hybrid(res, w, t, notes)
    return combine(verdicts), notes


def predicted_hybrid(res: Results, w: str, t: dict[str, Any], notes: list[str]) -> list[str]:
    """The cost model's per-GPU communication and memory of the hybrid against Megatron-intra and DDP at
    the paper's GPU counts (marked as predictions), or why there are none."""
    if res.predict is None:
        notes.append(f"{w}: communication per GPU and the paper's GPU counts: no cost model connected "
                     "(predictions not available)")
        return []
    verdicts = []
    for g in t["paper_gpus"]:
        figures = {row: res.predict(w, row, g) for row in (t["row"], *t["against"])}
        figures = {row: p for row, p in figures.items() if p and p.comm_bytes is not None}
        if t["row"] not in figures or len(figures) < 2:
            continue
        mine = figures.pop(t["row"])
        less = all(mine.comm_bytes < p.comm_bytes for row, p in figures.items() if row in t["data_parallel"] or row == "megatron-intra")
        verdicts.append(HOLDS if less else FAILS)
        notes.append(f"{w} {g} GPUs (predicted, {mine.error}): {t['row']} sends {mib(mine.comm_bytes)} per GPU a step; "
                     + ", ".join(f"{row} {mib(p.comm_bytes)}" for row, p in figures.items()))
    return verdicts


CHECKS: dict[str, Callable[[Results, dict[str, Any]], tuple[str, list[str]]]] = {
    "data_parallel_curves": data_parallel_curves,
    "zero_memory": zero_memory,
    "pipedream_slower": pipedream_slower,
    "pipelines_slowest": pipelines_slowest,
    "megatron_u_shape": megatron_u_shape,
    "pipeline_memory": pipeline_memory,
    "megatron_statistical_efficiency": megatron_statistical_efficiency,
    "hybrid_best_at_scale": hybrid_best_at_scale,
}


def judge(results: list[Result], path: Path | None = None, parity: list[dict[str, Any]] | None = None,
          cores: int | None = None, predict: Predictor | None = None) -> list[Finding]:
    """Every finding's verdict; `parity`: the parity report's rows, `cores`: this machine's (default),
    `predict`: the cost model at paper scale (none: the findings say that predictions are not available)."""
    thresholds = yaml.safe_load((path or thresholds_path()).read_text())
    indexed = Results(results, cores or cpu_cores(), parity, predict)
    findings = []
    for key, check in CHECKS.items():
        verdict, notes = check(indexed, thresholds[key])
        findings.append(Finding(key, " ".join(thresholds[key]["paper"].split()), verdict,
                                notes or ["no cells with the frameworks this finding needs"],
                                thresholds[key].get("needs", [])))
    return findings


def markdown(findings: list[Finding]) -> str:
    lines = ["# The paper's findings on this machine: the evidence", "",
             "Each finding is judged only where the runs can show what it needs (configs/findings.yaml).", ""]
    for number, f in enumerate(findings, 1):
        lines += [f"## {number}. {f.key}: **{f.verdict}**", "", f"> {f.paper}", "",
                  f"Needs: {', '.join(f.needs) or '-'}.", ""]
        lines += [f"- {note}" for note in f.evidence] + [""]
    return "\n".join(lines)
