"""Findings on statistical efficiency: validation curves per epoch and samples to the target.

Where the convergence study ran (repro.convergence: equal settings, several seeds, paired effects with 95%
intervals), the three findings rest on it: the data-parallel frameworks' equivalence, PipeDream's
staleness against a synchronous pipeline, and Megatron-intra against DDP at equal batch and at its own.
The matrix's comparisons (the data-parallel frameworks' curves against each other, or the parity report's
step-by-step runs; PipeDream against the other rows; Megatron-intra against DDP per epoch as the effective
batch grows) then stay as context, labelled, since the matrix trains each framework with its own settings;
without the study they are the verdict, as before.
"""
from __future__ import annotations

from typing import Any, Callable

from repro.report import settings as run_settings
from repro.report.collect import METRIC, Result
from repro.report.evidence import FAILS, HOLDS, INCONCLUSIVE, NOT_TESTABLE, Results, better, combine
from repro.report.statistics import (AGAINST_SYNC, CONTROL, DIFFERENT, EFFECT, EQUIVALENCE, EQUIVALENT, IDENTITY, MEGATRON,
                                     NEGATIVE, STALENESS, Interval)

Check = Callable[[Results, dict[str, Any]], tuple[str, list[str]]]
CONTEXT = "context (the matrix's runs, each framework with its own settings: not judged): "


def outcomes(res: Results, group: str) -> list[dict[str, Any]]:
    """The convergence study's comparisons of `group` (repro.convergence), with their intervals."""
    found = [dict(o) for o in (res.study or {}).get("outcomes", []) if o["group"] == group]
    for o in found:
        o["at_target"], o["at_end"] = (Interval(**o[k]) if o[k] else None for k in ("at_target", "at_end"))
    return found


def effect_text(o: dict[str, Any]) -> str:
    """One comparison's effects, as the study reports them."""
    target = f"samples to the target {o['at_target'].text()}" if o["at_target"] else "target not reached on every seed"
    end = f"final perplexity {o['at_end'].text()}" if o["at_end"] else "no final interval"
    margin = f", margin {o['margin']:.1%}" if o["margin"] is not None else ""
    note = f" ({o['note']})" if o["note"] else ""
    return (f"{o['treatment']} against {o['control']} ({o['seeds']} seeds, paired, 95% t interval): {target}, "
            f"{end}{margin}: {o['verdict']}{note}")


def study_plan(res: Results) -> str:
    plan = res.study["plan"]
    return (f"the convergence study (reports/convergence.md): {res.study['workload']}'s reduced model, equal "
            f"optimizer, lr, global batch, data order and initial weights, {plan['evals'] * plan['steps_per_eval']} "
            f"steps validated every {plan['steps_per_eval']}, {len(res.study['seeds'])} seeds")


def with_context(study_check: Callable[[Results, dict[str, Any]], tuple[str, list[str]] | None],
                 matrix_check: Check) -> Check:
    """The study's verdict where it ran, with the matrix's check as labelled context; else the matrix's."""
    def check(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
        judged = study_check(res, t) if res.study else None
        verdict, notes = matrix_check(res, t)
        if judged is None:
            return verdict, notes
        return judged[0], [*judged[1], *(CONTEXT + note for note in notes)]

    check.__doc__ = matrix_check.__doc__
    return check


def identity_verdict(res: Results, t: dict[str, Any]) -> tuple[str, list[str]] | None:
    """The data-parallel frameworks against DDP by the equivalence test; the negative control (a changed
    learning rate) must come out different, else the test cannot tell frameworks apart here."""
    found, controls = outcomes(res, IDENTITY), outcomes(res, CONTROL)
    if not found:
        return None
    notes = [f"At equal settings, {study_plan(res)}:", *(effect_text(o) for o in found + controls)]
    negative = next((o for o in controls if o["role"] == NEGATIVE), None)
    verdicts = {o["verdict"] for o in found}
    if negative is None or negative["verdict"] != DIFFERENT:
        notes.append("the negative control (a changed learning rate) is not flagged as different: the test has no "
                     "power here, so equivalence cannot be claimed")
        return (FAILS if DIFFERENT in verdicts else INCONCLUSIVE), notes
    if DIFFERENT in verdicts:
        return FAILS, notes
    return (HOLDS if verdicts == {EQUIVALENT} else INCONCLUSIVE), notes


def study_data_parallel_curves(res: Results, t: dict[str, Any]) -> tuple[str, list[str]] | None:
    judged = identity_verdict(res, t)
    if judged:
        absent = [line for line in res.study.get("unavailable", []) if line.startswith("lbann")]
        judged[1].append(f"LBANN is no arm: it cannot share the data order or the optimizer (docs/lbann.md)"
                         f"{'; ' + absent[0] if absent else ''}; the wall-clock clause is left to the matrix's timed "
                         "runs (context below)")
    return judged


def data_parallel_curves_in_matrix(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
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


def slower_by(o: dict[str, Any], t: dict[str, Any]) -> str:
    """Whether PipeDream is markedly slower in one comparison: samples to the target at least `slower_factor`
    times the synchronous pipeline's, else (target not reached on every seed) a final metric at least
    `worse_metric` worse; holds or fails only where the 95% interval lies on one side."""
    effect, bar = (o["at_target"], t["slower_factor"] - 1) if o["at_target"] else (o["at_end"], t["worse_metric"])
    if effect is None:
        return INCONCLUSIVE
    if effect.low > 0 and effect.mean >= bar:
        return HOLDS
    return FAILS if effect.high < bar else INCONCLUSIVE


def study_pipedream_slower(res: Results, t: dict[str, Any]) -> tuple[str, list[str]] | None:
    found = outcomes(res, STALENESS)
    against_sync = [o for o in found if o["role"] == AGAINST_SYNC]
    if not against_sync:
        return None
    per_rate = [(o, slower_by(o, t)) for o in against_sync]
    verdicts = {v for _, v in per_rate}
    verdict = next(iter(verdicts)) if len(verdicts) == 1 else INCONCLUSIVE
    notes = [f"At equal settings, {study_plan(res)}; markedly slower: samples to the target at least "
             f"{t['slower_factor']:g}x the synchronous pipeline's with 95% confidence:",
             *(f"{effect_text(o)}; markedly slower: {v}" for o, v in per_rate),
             *(effect_text(o) for o in found if o not in against_sync)]
    if len(verdicts) > 1:
        notes.append(f"the rates and stage counts disagree ({', '.join(v for _, v in per_rate)}): inconclusive")
    notes.append("PipeDream here always stashes weights (repro/adapters/pipedream.py): its staleness is measured "
                 "with stashing, so a slowdown is one that stashing does not cure; a run without stashing is not "
                 "possible with this adapter")
    return verdict, notes


def pipedream_in_matrix(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
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


def study_megatron(res: Results, t: dict[str, Any]) -> tuple[str, list[str]] | None:
    """Better per epoch needs Megatron-intra to beat DDP at equal batch (a lower final perplexity, interval
    below zero); equivalence there puts any gap seen in the matrix on the settings and the batch."""
    found = outcomes(res, MEGATRON)
    equal = next((o for o in found if o["test"] == EQUIVALENCE), None)
    if equal is None:
        return None
    batch = next((o for o in found if o["test"] == EFFECT), None)
    notes = [f"At equal settings, {study_plan(res)}:", *(effect_text(o) for o in found)]
    better_at_equal = equal["verdict"] == DIFFERENT and equal["at_end"].high < 0
    costs = batch is not None and batch["at_end"] is not None and batch["at_end"].low > 0
    if equal["verdict"] == EQUIVALENT:
        verdict = FAILS
        notes.append("at equal global batch Megatron-intra trains like DDP: it does not converge better per epoch "
                     "as a framework; a gap between them is their settings' or their batch's")
    else:
        verdict = HOLDS if better_at_equal and costs else INCONCLUSIVE
    if batch is not None and batch["at_end"] is not None:
        notes.append(f"the effective batch alone ({batch['treatment']} against {batch['control']}): final perplexity "
                     f"{batch['at_end'].text()}{' worse' if costs else ''}, the mechanism by which a batch that grows "
                     "with the GPU count loses per-epoch efficiency")
    return verdict, notes


def megatron_in_matrix(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
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


data_parallel_curves = with_context(study_data_parallel_curves, data_parallel_curves_in_matrix)
pipedream_slower = with_context(study_pipedream_slower, pipedream_in_matrix)
megatron_statistical_efficiency = with_context(study_megatron, megatron_in_matrix)
