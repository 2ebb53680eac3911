"""The cost model's figures at the paper's scale, quoted in the findings as predictions beside what was
measured here, each with the model's error against this machine's counters. One function per finding
that quotes the model: predictions for another finding belong here too.
"""
from __future__ import annotations

from typing import Any

from repro.report.evidence import COMM_CHECKS, FAILS, HOLDS, MEMORY_CHECKS, Prediction, Results, mib


def model_error(predictions: dict[str, Prediction | None], quantities: tuple[str, ...]) -> str:
    """The model's error behind predicted figures of several rows: per quantity the largest over all their
    counted smoke cells, naming its row, and the rows none of whose cells counted these quantities (unchecked)."""
    checked = {row: p for row, p in predictions.items() if p and p.checked_cells and set(quantities) & set(p.errors)}
    unchecked = sorted(row for row in predictions if row not in checked)
    worst = []
    for quantity in quantities:
        errors = {row: p.errors[quantity] for row, p in checked.items() if quantity in p.errors}
        if errors:
            row = max(errors, key=errors.get)
            worst.append(f"{quantity.replace('_', ' ')} at most {errors[row]:.2%} ({row})")
    text = (f"model error over {sum(p.checked_cells for p in checked.values())} counted smoke cells of "
            f"{', '.join(sorted(checked))} (reports/model_check.md): {', '.join(worst)}" if worst
            else "model error: no smoke cell of these rows counted against the model here")
    return text + (f"; {', '.join(unchecked)} unchecked" if unchecked and worst else "")


def paper_gpus_note(w: str, figures: dict[str, Prediction | None]) -> str:
    """Predicted memory per GPU of labelled figures ("8 GPUs", "ddp 64 GPUs") against the paper's GPUs (its
    Table 2): which exceed which GPU and how much of each is activations, or that all fit."""
    from repro.hardware import paper_gpu_memory
    from repro.model.predict import over_paper_gpus

    figures = {label: p for label, p in figures.items() if p and p.memory_bytes and p.model_state_bytes is not None}
    over = {label: (over_paper_gpus(p.memory_bytes), 1 - p.model_state_bytes / p.memory_bytes)
            for label, p in figures.items() if over_paper_gpus(p.memory_bytes)}
    if not over:
        return f"each fits the paper's {' and '.join(paper_gpu_memory())} (its Table 2)" if figures else ""
    return ("against the paper's GPUs (its Table 2): " + ", ".join(
        f"{label} over {' and '.join(gpus)} ({share:.1%} activations)" for label, (gpus, share) in over.items())
            + f": the paper's runs on those GPUs cannot have held that much under configs/{w}-paper.yaml's settings "
            "(each framework's own recompute and micro-batches, where it has them)")


def zero_memory_predicted(res: Results, from_gpus: int, paper: tuple[float, float]) -> list[str]:
    """ZeRO's saving at the paper's scale and GPU counts, from the cost model: a prediction beside the
    paper's figure, not a verdict; with the model's error on ZeRO's and DDP's cells where it is connected."""
    from repro.matrix import load_matrix
    from repro.model.predict import memory_settings, quoted, zero_saving

    notes = []
    for w in res.workloads:
        values, counts = [], [g for g in load_matrix().scales["paper"].gpus if g >= from_gpus]
        for g in counts:
            saving = zero_saving(w, g)
            if saving:
                state, peak = saving
                values.append(f"{g} GPUs {state:.0%}" + (f" ({peak:.0%} of model state + activations)" if peak is not None else ""))
        if values:
            error = (f" ({model_error({row: res.predict(w, row, counts[-1]) for row in ('zero', 'ddp')}, MEMORY_CHECKS)})"
                     if res.predict else "")
            fits = paper_gpus_note(w, {f"{row} {counts[-1]} GPUs": res.predict(w, row, counts[-1])
                                       for row in ("ddp", "zero")}) if res.predict else ""
            notes.append(f"{w} at paper scale, ZeRO's model-state saving against DDP (paper: {paper[0]:.0%}-{paper[1]:.0%}), "
                         + quoted(values) + error + (f"; {fits}" if fits else "")
                         + whole_saving(zero_saving(w, counts[-1]), counts[-1], paper,
                                        {row: memory_settings(w, row, counts[-1]) for row in ("zero", "ddp")}))
    return notes


def whole_saving(saving: tuple[float, float | None] | None, gpus: int, paper: tuple[float, float],
                 settings: dict[str, str]) -> str:
    """ZeRO's predicted saving of the whole peak (model state + activations) at `gpus` against the paper's
    range, under the recipes' memory settings `settings` (row -> words); empty where activations are not modelled."""
    if not saving or saving[1] is None:
        return ""
    where = "within" if paper[0] <= saving[1] <= paper[1] else "below" if saving[1] < paper[0] else "above"
    return (f"; at {gpus} GPUs the predicted saving of the whole peak, {saving[1]:.0%}, lies {where} the paper's "
            f"{paper[0]:.0%}-{paper[1]:.0%} (" + "; ".join(f"{row}: {text}" for row, text in settings.items()) + ")")


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
        error = model_error(figures, COMM_CHECKS)
        mine = figures.pop(t["row"])
        less = all(mine.comm_bytes < p.comm_bytes for row, p in figures.items() if row in t["data_parallel"] or row == "megatron-intra")
        verdicts.append(HOLDS if less else FAILS)
        notes.append(f"{w} {g} GPUs (predicted, {error}): {t['row']} sends {mib(mine.comm_bytes)} per GPU a step; "
                     + ", ".join(f"{row} {mib(p.comm_bytes)}" for row, p in figures.items()))
        verdicts += hybrid_memory_predicted(res, w, g, t, notes)
    return verdicts


def hybrid_memory_predicted(res: Results, w: str, g: int, t: dict[str, Any], notes: list[str]) -> list[str]:
    """The hybrid's predicted peak per GPU at `g` GPUs under the recipes' memory settings against the
    data-parallel rows' (the finding's memory clause at the paper's scale), with the model's error."""
    from repro.model.predict import memory_settings

    figures = {row: res.predict(w, row, g) for row in (t["row"], *t["data_parallel"])}
    figures = {row: p for row, p in figures.items() if p and p.memory_bytes}
    if t["row"] not in figures or len(figures) < 2:
        return []
    error = model_error(figures, MEMORY_CHECKS)
    mine = figures.pop(t["row"])
    leaner = all(mine.memory_bytes < p.memory_bytes for p in figures.values())
    fits = paper_gpus_note(w, {f"{t['row']} {g} GPUs": mine})
    notes.append(f"{w} {g} GPUs (predicted, {error}): {t['row']} peak {mib(mine.memory_bytes)} per GPU "
                 f"({memory_settings(w, t['row'], g)}); " + ", ".join(f"{row} {mib(p.memory_bytes)}" for row, p in figures.items())
                 + f" ({'below' if leaner else 'not below'} every data-parallel row); {fits}")
    return [HOLDS if leaner else FAILS]


def pipeline_memory_predicted(res: Results, t: dict[str, Any]) -> list[str]:
    """Where each pipeline's memory per GPU (model state + activations) plateaus at the paper's scale and
    GPU counts, from the cost model: a prediction beside the measured verdict, with the model's error."""
    from repro.matrix import load_matrix
    from repro.model.predict import quoted

    if res.predict is None:
        return []
    notes, counts = [], load_matrix().scales["paper"].gpus
    for w in res.workloads:
        for row in t["rows"]:
            figures = {g: res.predict(w, row, g) for g in counts}
            memory = {g: p.memory_bytes for g, p in figures.items() if p and p.memory_bytes}
            if len(memory) < 2:
                notes.append(f"{w} {row} at paper scale: no memory prediction (its activations are not predicted on GPUs)")
                continue
            gpus = sorted(memory)
            flat = [b for a, b in zip(gpus, gpus[1:]) if memory[a] / memory[b] < t["plateau_ratio"]]
            where = f"plateaus from {flat[0]} GPUs (a step down below x{t['plateau_ratio']})" if flat else "no plateau"
            error = model_error({row: figures[gpus[-1]]}, MEMORY_CHECKS)
            fits = paper_gpus_note(w, {f"{g} GPU{'s' if g > 1 else ''}": figures[g] for g in gpus})
            notes.append(f"{w} {row} at paper scale, memory per GPU {where}, "
                         + quoted([f"{g} GPU{'s' if g > 1 else ''} {mib(memory[g])}" for g in gpus]) + f" ({error}); {fits}")
    return notes


def megatron_memory_predicted(res: Results, t: dict[str, Any]) -> list[str]:
    """Where Megatron-intra's memory per GPU (model state + activations) has its minimum at the paper's
    scale and GPU counts, from the cost model: a prediction beside the measured verdict, with the
    model's error. Counts whose tp does not split the heads have no prediction (left out)."""
    from repro.matrix import load_matrix
    from repro.model.predict import memory_minimum, memory_settings, quoted

    if res.predict is None:
        return []
    notes, counts = [], load_matrix().scales["paper"].gpus
    for w in res.workloads:
        figures = {g: res.predict(w, t["row"], g) for g in counts}
        memory = {g: p.memory_bytes for g, p in figures.items() if p and p.memory_bytes}
        if len(memory) < 3:
            why = "fewer than 3 GPU counts modelled" if memory else "not modelled for this workload"
            notes.append(f"{w} {t['row']} at paper scale: no memory prediction ({why})")
            continue
        gpus = sorted(memory)
        lowest, shape = memory_minimum(memory)
        error = model_error({t["row"]: figures[gpus[-1]]}, MEMORY_CHECKS)
        fits = paper_gpus_note(w, {f"{g} GPU{'s' if g > 1 else ''}": figures[g] for g in gpus})
        notes.append(f"{w} {t['row']} at paper scale ({memory_settings(w, t['row'], gpus[-1])}), memory per GPU lowest at "
                     f"{lowest} GPU{'s' if lowest > 1 else ''} ({shape}; local layer spec), "
                     + quoted([f"{g} GPU{'s' if g > 1 else ''} {mib(memory[g])}" for g in gpus]) + f" ({error}); "
                     + u_terms({g: figures[g] for g in gpus}) + f"; {fits}")
    return notes


def u_terms(figures: dict[int, Prediction]) -> str:
    """Why memory per GPU has its shape: how model state and activations each move from the fewest GPUs to
    the most (a U needs the first to fall faster than the second grows, then slower)."""
    first, last = min(figures), max(figures)
    state = {g: p.model_state_bytes for g, p in figures.items()}
    active = {g: p.memory_bytes - p.model_state_bytes for g, p in figures.items()}
    return (f"from {first} to {last} GPUs model state x{state[last] / state[first]:.2f} ({mib(state[first])} -> "
            f"{mib(state[last])}), activations x{active[last] / active[first]:.2f} ({mib(active[first])} -> {mib(active[last])})"
            + (": by the paper's rule the tp group's batch grows with the GPU count, and what tp does not split grows "
               "with it" if active[last] > active[first] else ""))


def timing_error(p: Prediction) -> str:
    """The step-time model's checked error, as the timing predictions quote it."""
    if p.time_error is None:
        return "step-time model not checked here: no cell of no more processes than cores timed"
    return f"step-time model checked here to a median error of {p.time_error:.1%} over {p.time_cells} cells (reports/model_check.md)"


def predicted_epochs(res: Results, w: str, gpus: int, rows: list[str]) -> dict[str, dict[str, float]]:
    """Platform -> row -> predicted epoch time at paper scale, for the rows the model times at `gpus`."""
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        p = res.predict(w, row, gpus) if res.predict else None
        for name, seconds in (p.epoch_s if p else {}).items():
            out.setdefault(name, {})[row] = seconds
    return out


def first_prediction(res: Results, w: str, rows: list[str], gpus: list[int]) -> Prediction | None:
    return next((p for g in gpus for row in rows if (p := res.predict(w, row, g)) is not None and p.epoch_s), None)


def predicted_verdict(points: list[str]) -> str:
    """`holds` where every point of a prediction says yes, else `does not hold` (the points say where)."""
    return HOLDS if all(" yes " in f"{point} " for point in points) else FAILS


def on_platform(name: str) -> str:
    return f"on {name} (published figures with a stated efficiency, configs/platforms/{name}.yaml: an assumption)"


def pipelines_slowest_predicted(res: Results, t: dict[str, Any], notes: list[str]) -> list[str]:
    """Whether torchgpipe and PipeDream are the slowest per epoch at each of the paper's GPU counts from 2
    (at 1 a pipeline is the whole model on one GPU) where at least `min_rows` rows are timed, on each
    shipped platform: predictions, with the model's error."""
    from repro.matrix import load_matrix

    if res.predict is None:
        return []
    matrix = load_matrix()
    rows, verdicts = [row.name for row in matrix.rows], []
    counts = [g for g in matrix.scales["paper"].gpus if g >= 2]
    for w in res.workloads:
        sample = first_prediction(res, w, rows, counts)
        by_platform: dict[str, list[str]] = {}
        for g in counts:
            for name, epochs in predicted_epochs(res, w, g, rows).items():
                present = [row for row in t["rows"] if row in epochs]
                if len(epochs) < t["min_rows"] or not present:
                    continue
                ranking = sorted(epochs, key=epochs.get, reverse=True)
                slowest = set(ranking[: len(present)]) == set(present)
                verdicts.append(HOLDS if slowest else FAILS)
                by_platform.setdefault(name, []).append(
                    f"{g} GPUs {'yes' if slowest else 'no'} (slowest {', '.join(f'{r} {epochs[r]:.0f} s' for r in ranking[:2])})")
        for name, points in by_platform.items():
            notes.append(f"{w} at paper scale {on_platform(name)}, the pipelines slowest per epoch, predicted "
                         f"({timing_error(sample)}): {predicted_verdict(points)}: " + "; ".join(points))
    return verdicts


def zero_time_predicted(res: Results, from_gpus: int, max_ratio: float, notes: list[str]) -> list[str]:
    """ZeRO's predicted epoch time against DDP's at the paper's GPU counts on each shipped platform: the
    "no loss in performance" clause as a prediction, with the model's error."""
    from repro.matrix import load_matrix

    if res.predict is None:
        return []
    verdicts, counts = [], [g for g in load_matrix().scales["paper"].gpus if g >= from_gpus]
    for w in res.workloads:
        ratios: dict[str, list[str]] = {}
        for g in counts:
            for name, epochs in predicted_epochs(res, w, g, ["zero", "ddp"]).items():
                if len(epochs) == 2:
                    ratio = epochs["zero"] / epochs["ddp"]
                    verdicts.append(HOLDS if ratio <= max_ratio else FAILS)
                    ratios.setdefault(name, []).append(f"{g} GPUs x{ratio:.2f} {'yes' if ratio <= max_ratio else 'no'}")
        sample = first_prediction(res, w, ["zero"], counts)
        for name, points in ratios.items():
            notes.append(f"{w} at paper scale {on_platform(name)}, ZeRO's epoch time against DDP's (at most x{max_ratio}), "
                         f"predicted ({timing_error(sample)}): {predicted_verdict(points)}: {', '.join(points)}")
    return verdicts


def hybrid_time_predicted(res: Results, w: str, t: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The hybrid's predicted epoch time against the fastest other row at the paper's GPU counts on each
    shipped platform (the verdict at the highest count), and Megatron's fastest tensor x data split there:
    (verdicts, notes)."""
    from repro.model import platforms
    from repro.model.predict import fastest_split

    sample = first_prediction(res, w, [t["row"]], t["paper_gpus"]) if res.predict else None
    verdicts: list[str] = []
    notes: list[str] = []
    if sample is None:
        return verdicts, notes
    for name in sample.epoch_s:
        points, quickest = [], None
        for g in t["paper_gpus"]:
            epochs = predicted_epochs(res, w, g, [t["row"], *t["against"]]).get(name, {})
            if t["row"] not in epochs or len(epochs) < 2:
                continue
            fastest = min((row for row in epochs if row != t["row"]), key=epochs.get)
            quickest = epochs[t["row"]] <= epochs[fastest]
            split = fastest_split(w, g, platforms.load(name))[0][0]
            points.append(f"{g} GPUs {t['row']} {epochs[t['row']]:.0f} s, fastest other {fastest} {epochs[fastest]:.0f} s, "
                          f"fastest split tp={split} x dp={g // split}")
        if quickest is not None:
            verdicts.append(HOLDS if quickest else FAILS)
            notes.append(f"{w} at paper scale {on_platform(name)}, epoch time, predicted ({timing_error(sample)}): "
                         f"{HOLDS if quickest else FAILS} at {t['paper_gpus'][-1]} GPUs: " + "; ".join(points))
    return verdicts, notes
