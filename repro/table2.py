"""The experiment matrix of `make reproduce-table2`: run the cells MLflow lacks.

A cell is one recipe run (workload x framework row x GPU count). Cells are identified by their
recipe fingerprint, so an interrupted matrix resumes where it stopped and a second call only
rebuilds the reports. Cells that do not apply (Megatron on VGG-16) or cannot run here (LBANN
without its binary) are kept with the reason, so the report can show them.

The matrix's file and its expansion into cells (repeats included) live in `repro.matrix`.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable

from repro import names, registry
from repro.cell import Cell
from repro.recipe import Recipe
from repro.schema import RecipeError

Run = tuple[str, Recipe, str]  # one run to make: its progress label, its recipe, its MLflow experiment


def held_fingerprints(uri: str, experiment: str, retry_failed: bool) -> set[str]:
    """Fingerprints MLflow already holds a finished (or, unless retried, failed) run for."""
    from repro.report.collect import search_runs

    keep = {"FINISHED"} if retry_failed else {"FINISHED", "FAILED"}
    return {r.data.tags.get(names.RECIPE_SHA256) for r in search_runs(uri, experiment) if r.info.status in keep}


def cannot_run(cell: Cell, experiment: str) -> str | None:
    """Why a cell cannot run here, with the commands that fix it (None when it can): the pre-run
    check of `repro run`, on the machine (devices, or a launcher that provides them) and the data."""
    from repro import runner
    from repro.data import DataError
    from repro.run import preflight
    from repro.run.options import Launch, LaunchError

    reasons = []
    try:
        runner.check_machine(cell.recipe, Launch())
    except LaunchError as error:
        recipe = cell.recipe
        command = " ".join([f"repro run {cell.workload} --framework {cell.framework} --gpus {cell.gpus}",
                            f"--nodes {recipe.run.nodes} --scale {recipe.scale}",
                            *(f"--set {text}" for text in cell.overrides),
                            f"--launcher slurm --experiment {experiment}"])
        reasons.append(f"{error}; fix: {command}")
    except registry.Unavailable as error:
        reasons.append(str(error))
    try:
        preflight.check_data(cell.recipe)
    except (DataError, RecipeError) as error:
        reasons.append(str(error))
    return "; and ".join(reasons) or None


def plan(
    cells: list[Cell], uri: str, experiment: str, retry_failed: bool = False,
    out: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> tuple[list[Cell], dict[str, int]]:
    """The runs to make: cells MLflow lacks that pass the pre-run check. Prints one line per cell that
    cannot run (the reason, kept in `cell.skip` for the reports) and a summary; starts nothing."""
    held = held_fingerprints(uri, experiment, retry_failed)
    unique = {c.recipe.fingerprint(): c for c in cells if c.recipe}
    missing = [c for key, c in unique.items() if key not in held]
    for cell in missing:
        cell.skip = cannot_run(cell, experiment)
        if cell.skip:
            out(f"{cell.label:<28} cannot run: {cell.skip}")
    todo = [c for c in missing if not c.skip]
    counts = {"held": len(unique) - len(missing), "blocked": len(missing) - len(todo), "ran": 0, "failed": 0,
              "skipped": sum(1 for c in cells if not c.recipe)}
    out(f"matrix: {len(unique)} runs, {counts['held']} already in MLflow, {len(todo)} to run, "
        f"{counts['blocked']} cannot run here, {counts['skipped']} cells skipped")
    return todo, counts


def run_matrix(
    cells: list[Cell], uri: str, experiment: str, retry_failed: bool = False,
    out: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    after_each: Callable[[], None] = lambda: None,
    beside: Callable[[Cell], list[Run]] = lambda cell: [],
) -> dict[str, int]:
    """Run the cells MLflow lacks and that can run here, one after another, each followed by the runs
    `beside` gives for it (the main job's calibration runs of its recipe, in their own experiment:
    repro.framework_overhead.Calibration), with a progress line per run and `after_each` called after each
    (the main job rewrites its reports there)."""
    todo, counts = plan(cells, uri, experiment, retry_failed, out)
    runs: list[Run] = []
    owners: list[Cell | None] = []  # the matrix's cell of each run; None for a run beside one
    for cell in todo:
        extra = beside(cell)
        runs += [(cell.label, cell.recipe, experiment), *extra]
        owners += [cell] + [None] * len(extra)
    for cell, (code, refusal) in zip(owners, run_each(runs, uri, out, after_each)):
        if cell:
            counts["ran" if code == 0 else "failed"] += 1
            cell.skip = refusal
    return counts


class TimeLeft:
    """The time a list of runs has left, from the recorded times of those finished: each run still to go is
    expected to take what the finished runs of its workload, GPU count and step limit took on average (of its
    workload and step limit while none of those has finished, then of its workload, else of all). The matrix's
    cells differ far more by workload and GPU count (VGG-16 trains 10 epochs, GPT-2 3) than by framework, and
    the calibration's runs beside them (20 steps) far less long, so the pace of all runs so far misleads."""

    def __init__(self, recipes: list[Recipe]):
        self.recipes = recipes
        self.took: list[tuple[tuple[str, int], float]] = []

    @staticmethod
    def kind(recipe: Recipe) -> tuple[str, int, int | None]:
        return recipe.workload, recipe.run.gpus, recipe.train.max_steps

    def finished(self, recipe: Recipe, seconds: float) -> None:
        self.took.append((self.kind(recipe), seconds))

    def expected(self, recipe: Recipe) -> float:
        workload, gpus, steps = self.kind(recipe)
        for alike in (lambda k: k == (workload, gpus, steps), lambda k: k[0] == workload and k[2] == steps,
                      lambda k: k[0] == workload, lambda k: True):
            times = [seconds for kind, seconds in self.took if alike(kind)]
            if times:
                return sum(times) / len(times)
        return 0.0

    def seconds(self) -> float:
        return sum(self.expected(recipe) for recipe in self.recipes[len(self.took):])


def run_each(runs: list[Run], uri: str, out: Callable[[str], None],
             after_each: Callable[[], None] = lambda: None) -> list[tuple[int, str | None]]:
    """Run each (label, recipe, experiment) in turn with `repro run`'s own path, one progress line each (with the time
    left, TimeLeft), then `after_each`; per run, its exit code and why it could not start (None when it did)."""
    from repro import runner
    from repro.data import DataError

    from repro.run.options import Launch

    results, left = [], TimeLeft([recipe for _, recipe, _ in runs])
    width = max((len(label) for label, _, _ in runs), default=0)  # the runs' columns aligned, the longest label's
    with kept_warm([recipe for _, recipe, _ in runs]) as warm:
        for index, (label, recipe, experiment) in enumerate(runs, 1):
            begun, refusal = time.monotonic(), None
            try:
                code = runner.execute(recipe, uri, experiment, Launch(warm=warm), echo=lambda line: None,
                                      progress=False).returncode
            except (DataError, registry.Unavailable) as error:
                code, refusal = 1, str(error)
            results.append((code, refusal))
            left.finished(recipe, time.monotonic() - begun)
            state = "done" if code == 0 else f"FAILED (exit {code})"
            out(f"[{index}/{len(runs)}] {label:<{width}} {state:<18} {time.monotonic() - begun:6.1f}s   "
                f"~{left.seconds() / 60:4.1f} min left")
            after_each()
    return results


def kept_warm(recipes: list[Recipe]) -> contextlib.AbstractContextManager:
    """One warm launcher for runs made one after another (the matrix's cells, the parity runs; docs/launch.md),
    started before the first: its fork server imports, once, what the ranks of every run of CPU stand-ins
    need; none when no run has such ranks."""
    from repro.run.executors.warm import stand_in_ranks
    from repro.run.options import Launch
    from repro.warm import plan as warm_plan
    from repro.warm.client import Launcher

    warm = [recipe for recipe in recipes if stand_in_ranks(recipe, Launch())]
    return Launcher(warm_plan.preload(warm)) if warm else contextlib.nullcontext()
