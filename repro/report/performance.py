"""Findings on speed and memory per GPU: ZeRO's saving, the slowest frameworks per epoch, the shape of
memory against the GPU count (Megatron-intra's U, the pipelines' fall and plateau) and the hybrid at the
highest GPU count. Their paper-scale predictions are quoted from repro.report.predicted.
"""
from __future__ import annotations

from typing import Any

from repro.report import settings as run_settings
from repro.report.collect import Result, not_separable
from repro.report.evidence import FAILS, HOLDS, NOT_TESTABLE, Results, combine, mib, untimed
from repro.report.predicted import (hybrid_time_predicted, megatron_memory_predicted, pipeline_memory_predicted,
                                    pipelines_slowest_predicted, predicted_hybrid, zero_memory_predicted,
                                    zero_time_predicted)


def zero_memory(res: Results, t: dict[str, Any]) -> tuple[str, list[str]]:
    """ZeRO's saving against DDP and its epoch time; where no epoch time is testable here, the time clause
    at the paper's scale as the step-time model predicts it."""
    verdicts, notes, timed = [], [], False
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
                timed = True
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
    notes += zero_memory_predicted(res, t["from_gpus"], (low, high))
    predicted = zero_time_predicted(res, t["from_gpus"], t["max_time_ratio"], notes)
    return combine(verdicts + (predicted if not timed else [])), notes


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
    predicted = pipelines_slowest_predicted(res, t, notes)  # the verdict where nothing here is timed
    return combine(verdicts if {HOLDS, FAILS} & set(verdicts) else verdicts + predicted), notes


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
    return combine(verdicts), notes + megatron_memory_predicted(res, t)


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
    return combine(verdicts), notes + pipeline_memory_predicted(res, t)


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
        timed_verdicts, timed_notes = hybrid_time_predicted(res, w, t)
        if why_not:
            notes.append(f"{w} {g} GPUs: timing clause {why_not}; the verdict rests on memory"
                         + (", communication and the predicted epoch times" if timed_verdicts else " and communication"))
            verdicts += timed_verdicts
        else:
            fastest = min(others, key=lambda row: others[row].epoch_time)
            quicker = hybrid.epoch_time <= others[fastest].epoch_time
            verdicts.append(HOLDS if quicker else FAILS)
            notes.append(f"{w} {g} GPUs: epoch time {t['row']} {hybrid.epoch_time:.2f}s, fastest other {fastest} "
                         f"{others[fastest].epoch_time:.2f}s")
        verdicts += predicted_hybrid(res, w, t, notes)
        notes += timed_notes
    return combine(verdicts), notes
