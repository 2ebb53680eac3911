"""The paper's five research questions (RQ1-RQ5), answered from the runs in two to four sentences each.

Every sentence is built from the results and carries its evidence: measured here (the cells and their
numbers), predicted at the paper's scale by the cost model checked at smoke scale (with the model's
error; "not available" where no model is connected), or not testable here (the reason). Only the
wording is fixed: which rows lead, the numbers and the comparisons come from the runs, so other runs
give other answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import yaml

from repro.report import settings as run_settings
from repro.report.collect import Result
from repro.report.convergence import effect_text, outcomes
from repro.report.statistics import STALENESS
from repro.report.evidence import COMM_CHECKS, MEMORY_CHECKS, Results, mib, thresholds_path
from repro.report.predicted import first_prediction, model_error, paper_gpus_note, timing_error

MEASURED, PREDICTED, NOT_TESTABLE = "measured here", "predicted at paper scale", "not testable here"
FAMILIES = {  # the paper's three kinds of parallelism, and its hybrid, by matrix row
    "data": ("ddp", "zero", "fsdp", "lbann", "megatron-data"),
    "intra-layer": ("megatron-intra",),
    "inter-layer": ("torchgpipe", "pipedream", "torch-1f1b"),
}
QUESTIONS = {
    "RQ1": "How do data, intra-layer and inter-layer parallelism compare in speed, memory and statistical efficiency?",
    "RQ2": "How do each framework's performance and memory change with the GPU count?",
    "RQ3": "How do weight staleness and gradient synchronisation in the pipeline frameworks affect convergence?",
    "RQ4": "How much memory does ZeRO save, and does it slow training?",
    "RQ5": "Which hybrid of intra-layer and data parallelism is best for large models at high GPU counts?",
}


@dataclass
class Sentence:
    text: str
    evidence: str  # MEASURED, PREDICTED or NOT_TESTABLE


@dataclass
class Answer:
    key: str
    question: str
    sentences: list[Sentence]


def family_of(row: str) -> str | None:
    return next((name for name, rows in FAMILIES.items() if row in rows), None)


def widest(res: Results) -> tuple[str, int] | None:
    """The workload and GPU count with the most parallelism families present (most GPUs on a tie)."""
    options = [(len({family_of(r) for r in res.at(w, g)} - {None}), g, w)
               for w, _, g in res.ok]
    if not options:
        return None
    _, gpus, workload = max(options)
    return workload, gpus


def best_per_family(cells: dict[str, Result], value: Callable[[Result], float | None]) -> dict[str, tuple[str, float]]:
    """family -> (row, value) of its row with the smallest value."""
    best: dict[str, tuple[str, float]] = {}
    for row, r in cells.items():
        family, v = family_of(row), value(r)
        if family and v is not None and (family not in best or v < best[family][1]):
            best[family] = (row, v)
    return best


def ranked(best: dict[str, tuple[str, float]], show: Callable[[float], str]) -> str:
    return ", ".join(f"{family} {show(v)} ({row})" for family, (row, v) in sorted(best.items(), key=lambda i: i[1][1]))


def timed_count(res: Results, w: str, rows: list[str]) -> int | None:
    """The highest GPU count at which every present row's epoch times can be compared here."""
    counts = [g for g in sorted({g for (wl, _, g) in res.ok if wl == w})
              if not res.timed([r for row, r in res.at(w, g).items() if row in rows])]
    return counts[-1] if counts else None


def per_sample(r: Result) -> str:
    n = r.samples_to_target()
    if n is None:
        return f"not within {len(r.val)} epochs"
    epochs = r.epochs_to_target()
    return f"after {n:,} samples ({epochs} epoch{'s' * (epochs != 1)})"


def rq1(res: Results) -> list[Sentence]:
    found = widest(res)
    if not found:
        return [Sentence("No run finished, so the three kinds of parallelism cannot be compared.", NOT_TESTABLE)]
    w, g = found
    cells = res.at(w, g)
    memory = best_per_family(cells, lambda r: res.memory(r)[0])
    kind = res.memory(next(iter(cells.values())))[1]
    out = [Sentence(f"On {w} at {g} GPUs, memory per GPU ({kind}) from the leanest: {ranked(memory, mib)}.", MEASURED)]
    why_not = res.timed(list(cells.values()))
    at = g if not why_not else timed_count(res, w, list(cells))
    if why_not:
        out.append(Sentence(f"Speed at {g} GPUs: {why_not}.", NOT_TESTABLE))
    if at:
        speed = best_per_family(res.at(w, at), lambda r: r.epoch_time)
        out.append(Sentence(f"Per epoch on {w} at {at} GPUs, the fastest is {ranked(speed, lambda s: f'{s:.2f}s')}.",
                            MEASURED))
    reached = best_per_family(cells, lambda r: r.samples_to_target())
    never = sorted({family_of(row) for row in cells} - set(reached) - {None})
    text = (f"Per sample (hardware-independent), the first to {w}'s target at {g} GPUs is "
            f"{ranked(reached, lambda n: f'{n:,.0f} samples')}" if reached else
            f"No row reaches {w}'s target at {g} GPUs")
    out.append(Sentence(text + (f"; {', '.join(never)} never within the recipe's epochs." if never else "."), MEASURED))
    return out


def rq1_at_scale(res: Results, paper_gpus: list[int]) -> list[Sentence]:
    """RQ1's measured sentences and the predicted epoch time of each kind's fastest row at the paper's most GPUs."""
    timed = time_sentence(res, f"the predicted epoch time of each kind's fastest row at {paper_gpus[-1]} GPUs",
                          fastest_of_each_family(res, paper_gpus[-1]))
    return rq1(res) + ([timed] if timed else [])


def rq2(res: Results, paper_gpus: list[int]) -> list[Sentence]:
    out = []
    for w in res.workloads:
        counts = sorted({g for (wl, _, g) in res.ok if wl == w})
        rows = sorted({row for (wl, row, _) in res.ok if wl == w and len(res.gpus(w, row)) >= 2})
        falls = {}
        for row in rows:
            gs = res.gpus(w, row)
            first, last = res.memory(res.get(w, row, gs[0]))[0], res.memory(res.get(w, row, gs[-1]))[0]
            if first and last:
                falls[row] = (first / last, gs[0], gs[-1])
        if falls:
            order = sorted(falls, key=lambda row: falls[row][0], reverse=True)
            show = lambda row: f"{row} x{falls[row][0]:.2f} ({falls[row][1]}->{falls[row][2]} GPUs)"
            least = f" and least for {show(order[-1])}" if len(order) > 1 else ""
            out.append(Sentence(f"On {w}, memory per GPU falls most for {show(order[0])}{least}.", MEASURED))
        top = timed_count(res, w, rows)
        speedups = {row: res.get(w, row, counts[0]).epoch_time / res.get(w, row, top).epoch_time
                    for row in rows if top and top > counts[0] and res.get(w, row, counts[0]) and res.get(w, row, top)}
        if speedups:
            order = sorted(speedups, key=speedups.get, reverse=True)
            least = f" and least for {order[-1]} (x{speedups[order[-1]]:.2f})" if len(order) > 1 else ""
            out.append(Sentence(f"On {w} from {counts[0]} to {top} GPUs, an epoch speeds up most for {order[0]} "
                                f"(x{speedups[order[0]]:.2f}){least}.", MEASURED))
        beyond = [g for g in counts if top is None or g > top]
        if beyond and w == res.workloads[-1]:
            reason = res.timed([r for row, r in res.at(w, beyond[-1]).items()])
            out.append(Sentence(f"Speed-up to {beyond[-1]} GPUs: {reason}.", NOT_TESTABLE))
    return with_time(out[:3] + [prediction_sentence(res, "memory per GPU", paper_gpus,  # the prediction keeps its place
                                                    ("ddp", "zero", "megatron-intra", "torchgpipe"), lambda p: p.memory_bytes,
                                                    MEMORY_CHECKS)],
                     time_sentence(res, f"an epoch's predicted speed-up from {paper_gpus[0]} to {paper_gpus[-1]} GPUs",
                                   predicted_speedups(res, ("ddp", "zero", "megatron-intra", "pipedream"), paper_gpus[0], paper_gpus[-1])))


def prediction_sentence(res: Results, what: str, paper_gpus: list[int], rows: tuple[str, ...],
                        value: Callable, checks: tuple[str, ...]) -> Sentence:
    """The cost model's `what` at the paper's GPU counts for `rows`, with the model's error on every row
    quoted (`checks`: the counted quantities that check `what`), or that it is not available."""
    w = "gpt2" if "gpt2" in res.workloads or not res.workloads else res.workloads[0]
    if res.predict is None:
        return Sentence(f"At the paper's {paper_gpus[0]}-{paper_gpus[-1]} GPUs, {what}: prediction not available "
                        "(no cost model connected to this report).", PREDICTED)
    parts, quoted, figures = [], {}, {}
    for row in rows:
        points = [(g, res.predict(w, row, g)) for g in (paper_gpus[0], paper_gpus[-1])]
        points = [(g, p) for g, p in points if p and value(p) is not None]
        if points:
            quoted[row] = points[0][1]
            figures.update({f"{row} at {g}": p for g, p in points})
            parts.append(f"{row} " + " -> ".join(f"{mib(value(p))} at {g}" for g, p in points))
    if not parts:
        return Sentence(f"At the paper's GPU counts, {what}: the cost model gives no figure for these rows.", PREDICTED)
    fits = paper_gpus_note(w, figures) if checks == MEMORY_CHECKS else ""  # memory against the paper's GPUs
    return Sentence(f"At the paper's scale ({w}), {what}: {'; '.join(parts)} ({model_error(quoted, checks)})"
                    + (f"; {fits}." if fits else "."), PREDICTED)


def time_sentence(res: Results, what: str, per_platform: Callable[[str, str], str | None]) -> Sentence | None:
    """`what` at the paper's scale as the step-time model predicts it on each shipped platform
    (`per_platform(workload, platform)`: the figures, or None), with the model's checked error."""
    from repro.model.platforms import SHIPPED

    w = "gpt2" if "gpt2" in res.workloads or not res.workloads else res.workloads[0]
    sample = first_prediction(res, w, ["ddp"], [1]) if res.predict else None
    parts = [f"on {name} {text}" for name in SHIPPED if sample and (text := per_platform(w, name))]
    if not parts:
        return None
    return Sentence(f"At the paper's scale ({w}), {what}: {'; '.join(parts)} ({timing_error(sample)}; the platforms' "
                    "figures are published ones with a stated efficiency, configs/platforms/).", PREDICTED)


def epoch_on(res: Results, w: str, row: str, gpus: int, platform: str) -> float | None:
    p = res.predict(w, row, gpus) if res.predict else None
    return p.epoch_s.get(platform) if p else None


def fastest_of_each_family(res: Results, gpus: int) -> Callable[[str, str], str | None]:
    def figures(w: str, platform: str) -> str | None:
        best = {}
        for family, rows in FAMILIES.items():
            timed = {row: s for row in rows if (s := epoch_on(res, w, row, gpus, platform))}
            if timed:
                row = min(timed, key=timed.get)
                best[family] = f"{family} {row} {timed[row]:.0f} s"
        return ", ".join(best.values()) or None
    return figures


def predicted_speedups(res: Results, rows: tuple[str, ...], first: int, last: int) -> Callable[[str, str], str | None]:
    def figures(w: str, platform: str) -> str | None:
        pairs = {row: (epoch_on(res, w, row, first, platform), epoch_on(res, w, row, last, platform)) for row in rows}
        return ", ".join(f"{row} x{a / b:.2f}" for row, (a, b) in pairs.items() if a and b) or None
    return figures


def zero_against_ddp(res: Results, counts: list[int]) -> Callable[[str, str], str | None]:
    def figures(w: str, platform: str) -> str | None:
        ratios = {g: (epoch_on(res, w, "zero", g, platform), epoch_on(res, w, "ddp", g, platform)) for g in counts}
        return ", ".join(f"x{z / d:.2f} at {g} GPUs" for g, (z, d) in ratios.items() if z and d) or None
    return figures


def fastest_splits(counts: list[int]) -> Callable[[str, str], str | None]:
    def figures(w: str, platform: str) -> str | None:
        from repro.model import platforms
        from repro.model.predict import fastest_split

        if w != "gpt2":
            return None
        profile = platforms.load(platform)
        return ", ".join(f"tp={tp} x dp={g // tp} at {g}" for g in counts for tp, _ in fastest_split(w, g, profile)[:1])
    return figures


def with_time(sentences: list[Sentence], timed: Sentence | None) -> list[Sentence]:
    """`sentences` with the predicted-time sentence before the last (the memory or communication
    prediction, which keeps its place at the end)."""
    return sentences[:-1] + ([timed] if timed else []) + sentences[-1:]


def rq3(res: Results) -> list[Sentence]:
    """From the convergence study where it ran (staleness at equal settings), the matrix and the parity
    report then as context; from those alone otherwise."""
    study = staleness_sentences(res)
    context = rq3_matrix(res)
    if not study:
        return context
    return study + [Sentence(f"Context, not judged (the matrix trains each framework with its own settings): "
                             f"{s.text[0].lower()}{s.text[1:]}", s.evidence) for s in context]


def staleness_sentences(res: Results) -> list[Sentence]:
    """The convergence study's staleness comparisons: PipeDream against a synchronous pipeline with the same
    stages and against one process, at each learning rate, with the step counts."""
    found = outcomes(res, STALENESS)
    if not found:
        return []
    plan = res.study["plan"]
    rates = sorted({res.study["arms"][o["treatment"]]["lr"] for o in found if o["treatment"] in res.study["arms"]})
    head = (f"At equal settings (Adam at lr {' and '.join(f'{lr:g}' for lr in rates)}, global batch 8, {plan['evals'] * plan['steps_per_eval']} "
            f"steps validated every {plan['steps_per_eval']}, {len(res.study['seeds'])} seeds, "
            f"{res.study['workload']}'s reduced model; reports/convergence.md): ")
    return [Sentence(head + "; ".join(effect_text(o) for o in found) + ".", MEASURED)]


def rq3_matrix(res: Results) -> list[Sentence]:
    out = []
    for w in res.workloads:
        g = res.most_gpus_beside_others(w, "pipedream")
        if g is None:
            continue
        cells = res.at(w, g)
        others = {row: r for row, r in cells.items() if row != "pipedream" and family_of(row) == "data"}
        best = min(others, key=lambda row: (others[row].samples_to_target() or float("inf"), row)) if others else None
        text = (f"On {w} at {g} GPUs, the target is reached by PipeDream (stale weights, stashed) "
                f"{per_sample(cells['pipedream'])}")
        if "torchgpipe" in cells:
            text += f", by synchronous torchgpipe {per_sample(cells['torchgpipe'])}"
        if best:
            text += f", by the best data-parallel row ({best}) {per_sample(others[best])}"
        differ = run_settings.differences(cells["pipedream"].settings, others[best].settings) if best else []
        out.append(Sentence(text + (f"; PipeDream also trains with {', '.join(differ)}." if differ else "."), MEASURED))
    parity = {p["name"]: p for p in res.parity if p["max_abs_diff"] is not None}
    if "pipedream-2" in parity:
        stale, exact = parity["pipedream-2"], parity.get("pipedream-1")
        text = (f"At equal settings over {stale['steps']} steps, 2 pipeline stages move PipeDream's loss "
                f"{stale['max_abs_diff']:.1e} from one process")
        if exact:
            text += f", 1 stage {exact['max_abs_diff']:.1e}: the difference is staleness, not arithmetic"
        sync = [p for name, p in parity.items() if p["framework"] in ("torchgpipe", "torch-pipeline")]
        if sync:
            text += (f"; the synchronous pipelines stay within {max(p['max_abs_diff'] for p in sync):.1e} "
                     f"({', '.join(p['name'] for p in sync)})")
        out.append(Sentence(text + ".", MEASURED))
    else:
        out.append(Sentence("Staleness at equal settings: no PipeDream rows in the parity report.", NOT_TESTABLE))
    return out or [Sentence("No PipeDream cell finished.", NOT_TESTABLE)]


def rq4(res: Results, paper_gpus: list[int]) -> list[Sentence]:
    out = []
    for w in res.workloads:
        counts = [g for g in res.gpus(w, "zero") if g >= 2 and res.get(w, "ddp", g)]
        pairs = [(g, res.get(w, "zero", g), res.get(w, "ddp", g)) for g in counts]
        pairs = [(g, z, d) for g, z, d in pairs if z.model_state_bytes and d.model_state_bytes]
        if not pairs:
            continue
        savings = ", ".join(f"{1 - z.model_state_bytes / d.model_state_bytes:.0%} at {g}" for g, z, d in pairs)
        peaks = [(g, res.memory(z)[0], res.memory(d)[0]) for g, z, d in pairs]
        peak_text = ", ".join(f"{1 - zm / dm:.0%} at {g}" for g, zm, dm in peaks if zm and dm)
        out.append(Sentence(f"On {w}, ZeRO's model state per GPU is below DDP's by {savings} GPUs"
                            + (f" (whole memory per GPU: {peak_text})." if peak_text else "."), MEASURED))
        timed = [(g, z, d) for g, z, d in pairs if not res.timed([z, d])]
        if timed:
            g, z, d = timed[-1]
            differ = run_settings.differences(z.settings, d.settings, run_settings.TRAINING)
            out.append(Sentence(f"On {w} at {g} GPUs an epoch of ZeRO takes x{z.epoch_time / d.epoch_time:.2f} DDP's"
                                + (f" (they train differently: {', '.join(differ)})." if differ else "."), MEASURED))
        untimed = [(g, z, d) for g, z, d in pairs if res.timed([z, d])]
        if untimed and w == res.workloads[-1]:
            g, z, d = untimed[-1]
            out.append(Sentence(f"Its epoch time at {g} GPUs: {res.timed([z, d])}.", NOT_TESTABLE))
    if not out:
        out.append(Sentence("No ZeRO and DDP cells at 2 GPUs or more finished.", NOT_TESTABLE))
    return with_time(out[:3] + [prediction_sentence(res, "memory per GPU", paper_gpus, ("ddp", "zero"),
                                                    lambda p: p.memory_bytes, MEMORY_CHECKS)],
                     time_sentence(res, "ZeRO's predicted epoch time against DDP's", zero_against_ddp(res, paper_gpus)))


def rq5(res: Results, paper_gpus: list[int]) -> list[Sentence]:
    out = []
    for w in res.workloads:
        counts = [g for g in res.gpus(w, "megatron-hybrid")
                  if res.get(w, "megatron-hybrid", g).cell.recipe.options("megatron").tp < g]
        if not counts:
            continue
        g = counts[-1]
        cells = res.at(w, g)
        hybrid = cells["megatron-hybrid"]
        tp = hybrid.cell.recipe.options("megatron").tp
        memory = {row: res.memory(r)[0] for row, r in cells.items() if res.memory(r)[0]}
        order = sorted(memory, key=memory.get)
        if "megatron-hybrid" not in order:
            out.append(Sentence(f"The hybrid's memory at {g} GPUs: {res.activation_reason([hybrid])}.", NOT_TESTABLE))
        else:
            out.append(Sentence(f"On {w} at {g} GPUs, the hybrid (tp={tp} x dp={g // tp}) needs {mib(memory['megatron-hybrid'])} "
                                f"per GPU, rank {order.index('megatron-hybrid') + 1} of {len(order)} from the leanest "
                                f"({order[0]} {mib(memory[order[0]])}, most {order[-1]} {mib(memory[order[-1]])}).",
                                MEASURED))
        why_not = res.timed(list(cells.values()))
        if why_not:
            out.append(Sentence(f"Its speed against the others at {g} GPUs: {why_not}.", NOT_TESTABLE))
        elif len(cells) > 1:
            speed = sorted(cells, key=lambda row: cells[row].epoch_time)
            rival = next(row for row in speed if row != "megatron-hybrid")
            out.append(Sentence(f"Per epoch at {g} GPUs the hybrid ranks {speed.index('megatron-hybrid') + 1} of "
                                f"{len(speed)} ({hybrid.epoch_time:.2f}s; fastest other {rival} "
                                f"{cells[rival].epoch_time:.2f}s).", MEASURED))
    if not out:
        out.append(Sentence("No hybrid cell with data parallelism (dp > 1) finished.", NOT_TESTABLE))
    return with_time(out[:3] + [prediction_sentence(res, "communication per GPU a step", paper_gpus,
                                                    ("megatron-hybrid", "megatron-intra", "ddp"), lambda p: p.comm_bytes,
                                                    COMM_CHECKS)],
                     time_sentence(res, "Megatron's fastest tensor x data split by predicted step time", fastest_splits(paper_gpus)))


def answer(res: Results, paper_gpus: list[int] | None = None) -> list[Answer]:
    """RQ1-RQ5 from the indexed results; `paper_gpus`: where the cost model is asked (findings.yaml's)."""
    if paper_gpus is None:
        paper_gpus = yaml.safe_load(thresholds_path().read_text())["hybrid_best_at_scale"]["paper_gpus"]
    built = {"RQ1": rq1_at_scale(res, paper_gpus), "RQ2": rq2(res, paper_gpus), "RQ3": rq3(res), "RQ4": rq4(res, paper_gpus),
             "RQ5": rq5(res, paper_gpus)}
    return [Answer(key, QUESTIONS[key], sentences) for key, sentences in built.items()]


def markdown(answers: list[Answer]) -> str:
    lines = ["# The paper's research questions, answered from these runs", "",
             "Each sentence says what it rests on: *measured here*, *predicted at paper scale* (by the cost model, "
             "with its error against smoke-scale measurements) or *not testable here* (with the reason).", ""]
    for a in answers:
        lines += [f"## {a.key}. {a.question}", ""]
        lines += [f"- {s.text} *[{s.evidence}]*" for s in a.sentences] + [""]
    return "\n".join(lines)
