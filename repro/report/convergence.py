"""Findings on statistical efficiency: validation curves per epoch and samples to the target.

The data-parallel frameworks' curves against each other (or, where the matrix trains them differently,
the parity report's step-by-step runs at equal settings), PipeDream's weight staleness, and Megatron-intra
against DDP per epoch as the effective batch grows with the GPU count.
"""
from __future__ import annotations

from typing import Any

from repro.report import settings as run_settings
from repro.report.collect import METRIC, Result
from repro.report.evidence import FAILS, HOLDS, NOT_TESTABLE, Results, better, combine


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
                measured = (f"{w} at {gpus} GPUs: per-epoch curves of {a} and {b} (equal settings) at most "
                            f"{gap:.1%} apart (limit {t['max_relative_gap']:.0%})")
                control = rounding_control(res, w, gpus)
                if control and control["curve_gap"] >= t["max_relative_gap"]:
                    curves.append(NOT_TESTABLE)
                    notes.append(f"{measured}, but rounding alone moves a curve by {control['curve_gap']:.1%} here (the "
                                 f"parity report's rounding control, {control['framework']} against "
                                 f"{control['reference']}): beyond the limit, so these curves cannot tell the "
                                 "frameworks from rounding growth")
                    continue
                curves.append(HOLDS if gap <= t["max_relative_gap"] else FAILS)
                notes.append(measured + (f"; rounding alone: {control['curve_gap']:.1%}" if control else ""))
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


def rounding_control(res: Results, workload: str, gpus: int) -> dict[str, Any] | None:
    """The parity report's rounding control at `workload` and `gpus` (a run differing from the matrix's
    reference only in the order of its sums), if it ran."""
    return next((p for p in res.partings if p.get("control") and p["workload"] == workload and p["gpus"] == gpus
                 and p.get("curve_gap") is not None), None)


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
