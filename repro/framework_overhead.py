"""Each framework's own time a step, measured on this machine: what its step takes beyond the step-time
model's counted terms (repro.model.time: FLOPs, memory-bound bytes, dispatched operations, collectives,
bubble). On small CPU models that is most of what sets frameworks apart: DeepSpeed's and Megatron's
Python around each step and their copies into flat buffers, FSDP2's per-unit hooks and DTensor
dispatch, gloo's reductions on cores that backward also uses (docs/time.md, "A framework's own time").

For every cell of the matrix that the step-time check holds (no more processes than cores), the same
recipe runs STEPS steps at each of two model sizes that the check never uses, one either side of the
smoke recipe's (SIZES: the same layers and tensors), once in each of PASSES passes over all of them; between the two,
at the recipe's own size, a run that the check reads beside the matrix's own (`retimed`), so that a cell is measured
at the median of its timings, as its own time is, and one fast or slow spell of the machine during one of them
does not decide its row (docs/time.md, "Checked where timing is testable"). Each size's measured median step less
the model's terms, the median over the passes, is the framework's own time there: with the terms read on the
machine's fastest profile, it also carries what the machine's typical step this job took beyond its fastest at
that size. The profile keeps both sizes' figures (Platform.frameworks, by
repro.model.time.framework_key) and the model reads them on the line through them at the cell's model state
(at its bucket flushes for ZeRO-1/2, whose own time follows them: repro.model.time.own_time_scale).
So the smoke cells that the check compares are predicted between two measured sizes, never fitted to themselves.
In the main job the first pass runs beside the matrix, each recipe's runs right after the matrix's run of it
(Calibration.beside), and the others after the matrix's parity and convergence runs: both sides of the check then
share the machine's slow and fast spells. The runs are recorded in MLflow (experiment EXPERIMENT) and reused by
recipe fingerprint, with warm ranks, like the matrix's.
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Callable

from repro import calibrate, parity, registry
from repro.cell import Cell
from repro.recipe import Recipe
from repro.matrix import cell_for, load_matrix, repeated
from repro.model import costs, platforms, time
from repro.model.platforms import Platform
from repro.model.terms import Cell as ModelCell

EXPERIMENT = "calibration-smoke"
STEPS = 20  # 5 warm-up steps left out, 15 timed: a median that one slow step does not move
# the sizes each workload's frameworks are timed at, either side of the smoke recipe's (GPT-2 d_model 64, VGG-16
# width_div 8), neither checked: the workloads' own rates' (GPT-2 d_model 32 and 128, VGG-16 width_div 16 and 4).
# Not the negligible size (calibrate.TINY): there a framework's residual holds what the terms miss of a tiny step
# (3-8 ms on a 2-core AMD EPYC, times torchgpipe's micro-batches), which the smoke size does not show, and the
# line from it missed VGG-16's torchgpipe by 30% (docs/time.md, "Checked where timing is testable")
SIZES = {workload: calibrate.CALIBRATION[workload][:2] for workload in calibrate.TINY}
AS_CHECKED = "recipe's size"  # the row tag of a run at the recipe's own size: the check's, not an own time's
# every calibration run is made this many times, a pass over all of them apart (3.5 to 7 min on 2 cores), and the
# median residual kept: runs of one recipe minutes apart differ by up to 40% on this VM (GPT-2 PipeDream 1 at
# d_model 64: 25.7, 18.3 and 23.5 ms), in both directions, so the least of them takes one fast spell for the
# machine's speed, and on the line between two sizes a fast spell at one of them moves the third: the median of
# three passes drops one spell either way (docs/time.md, "Checked where timing is testable")
PASSES = 3


def calibration_cells(scale: str, cores: int) -> list[Cell]:
    """The matrix's cells of at most `cores` processes at `scale`, STEPS steps long at the smaller of SIZES, the
    recipe's own size and the larger, one after another (one of each recipe: megatron-intra and megatron-data
    at 1 GPU share theirs), in PASSES passes: each pass's cell a repeat of the first's with its own seed (so its
    own run) and its own row (so the reports keep every pass's result: repro.report.collect folds the repeats of
    a row), the passes one after another."""
    matrix = load_matrix()
    plan = matrix.scales[scale]
    cells, seen = [], set()
    for workload in plan.workloads:
        small, large = SIZES[workload]
        for row in matrix.rows:
            for gpus in plan.gpus:
                for size in (small, [], large):
                    cell = cell_for(workload, row, gpus, scale, plan.gpus_per_node, [*size, f"train.max_steps={STEPS}"],
                                    plan.tp_per_node)
                    if not cell.recipe or registry.plan_class(cell.framework).processes(cell.recipe) > cores:
                        continue
                    if cell.recipe.fingerprint() not in seen:  # its own row: the reports fold cells of one row as repeats
                        seen.add(cell.recipe.fingerprint())
                        cells.append(dataclasses.replace(cell, row=f"{row.name} [{' '.join(size) or AS_CHECKED}]"))
    passes = [repeated(cell, PASSES) for cell in cells]
    return [dataclasses.replace(repeats[p], row=f"{repeats[p].row} pass {p + 1}")  # a row each: never folded as repeats
            for p in range(PASSES) for repeats in passes]


def at_checked_size(cell: Cell) -> bool:
    """Whether a calibration run is at its recipe's own size (the check's), not at one of SIZES."""
    return f"[{AS_CHECKED}]" in cell.row


def retimed(cells: list[Cell], uri: str) -> dict[tuple[str, object], list[float]]:
    """(time.framework_key, model shape) -> the framework step times of the finished calibration runs among
    `cells` at their recipe's own size: what the check reads beside a matrix cell of that key and shape."""
    from repro.report.collect import collect

    steps: dict[tuple[str, object], list[float]] = {}
    for result in collect([cell for cell in cells if at_checked_size(cell)], uri, EXPERIMENT):
        measured = result.framework_step_time() if result.ok else None
        if measured:
            cell = costs.cell_of(result.cell.recipe, result.facts)
            steps.setdefault((time.framework_key(cell), cell.shape), []).append(measured)
    return steps


def own_times(cells: list[Cell], uri: str, platform: Platform) -> dict[str, list[list[float]]]:
    """framework_key -> [[where, seconds], ...] (time.own_time_scale): at each of SIZES (the runs at the recipe's own
    size are the check's), the median over the passes of a finished run's measured framework step less the model's
    terms on `platform`."""
    residuals = measured_residuals([cell for cell in cells if not at_checked_size(cell)], uri, platform)
    table: dict[str, dict[float, list[float]]] = {}
    for cell, where, residual in residuals:
        table.setdefault(time.framework_key(cell), {}).setdefault(where, []).append(residual)
    return {key: sorted([where, statistics.median(own)] for where, own in points.items()) for key, points in table.items()}


def measured_residuals(cells: list[Cell], uri: str, platform: Platform) -> list[tuple[ModelCell, float, float]]:
    """(the model's cell of the run, where its own time is read (time.own_time_scale), its measured framework
    step less the model's terms on `platform`) for every finished CPU run of a framework the step-time model
    covers."""
    from repro.report.collect import collect

    residuals = []
    for result in collect(cells, uri, EXPERIMENT):
        measured = result.framework_step_time() if result.ok else None
        cell = costs.cell_of(result.cell.recipe, result.facts) if measured else None
        if cell is None or cell.device != "cpu":
            continue
        try:
            modelled = time.model_terms(cell, platform).total_s
        except KeyError:  # a framework without a step-time model (LBANN)
            continue
        residuals.append((cell, time.own_time_scale(cell), measured - modelled))
    return residuals


class Calibration:
    """This machine's profile (repro.calibrate.calibrated: the one kept beside the store, else measured now, and
    then once more after each pass) with its frameworks' own times, measured around the matrix's own runs: the
    first pass of a cell's runs right after the matrix's run of its recipe (`beside`), so that the check compares
    runs made in the same minutes. On a 2-core VM the same steps ran 35-65% slower for the 18 minutes of a
    calibration made after the matrix, and every cell read high (docs/time.md, "Checked where timing is
    testable")."""

    def __init__(self, uri: str, cores: int, again: bool = False):
        self.uri = uri
        folder = calibrate.store_folder(uri)
        platform = None if again else calibrate.kept(calibrate.profile_path(folder))
        self.measuring = platform is None
        self.platform = platform or calibrate.calibrated(folder, again=True)
        self.cells = calibration_cells("smoke", cores)
        self.first_pass = first_pass_by_recipe(self.cells)

    def beside(self, cell: Cell) -> list[tuple[str, Recipe, str]]:
        """The first pass's runs of the matrix cell's recipe that the store lacks, as the matrix runner makes
        them (repro.table2.run_matrix): once per recipe (megatron-intra and -data at 1 GPU share theirs)."""
        from repro.table2 import held_fingerprints

        group = self.first_pass.pop(at_steps(cell.recipe).fingerprint(), []) if cell.recipe else []
        held = held_fingerprints(self.uri, EXPERIMENT, retry_failed=True) if group else set()
        return [(f"calibrate {c.label}", c.recipe, EXPERIMENT) for c in group if c.recipe.fingerprint() not in held]

    def finished(self, out: Callable[[str], None]) -> Platform:
        """The profile with the frameworks' own times, kept in the same file: the runs the store lacks made now,
        pass by pass, and the model's terms subtracted from all of them every time, so that a changed model
        is read against its own terms, never against the terms of the model that measured them."""
        out(f"calibrate: each framework's own time, {len(self.cells)} runs of {STEPS} steps at two sizes and the "
            f"recipe's, in {PASSES} passes (repro/framework_overhead.py)"
            + (", the machine measured again after each" if self.measuring else ""))
        platform = self.platform
        for number in range(1, PASSES + 1):
            parity.train([cell.recipe for cell in self.cells if cell.row.endswith(f" pass {number}")], self.uri,
                         EXPERIMENT, out, label="calibrate")
            if self.measuring:  # minutes apart, each figure its fastest (calibrate.fastest): one slow spell does not set it
                platform = calibrate.remeasured(platform)
        measured = dataclasses.replace(platform, frameworks=own_times(self.cells, self.uri, platform))
        platforms.dump(measured, Path(platform.path))
        return measured


def at_steps(recipe: Recipe) -> Recipe:
    """The recipe cut to the calibration's STEPS steps: the recipe of its run at its own size."""
    return dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, max_steps=STEPS))


def first_pass_by_recipe(cells: list[Cell]) -> dict[str, list[Cell]]:
    """The first pass of `cells` (calibration_cells) by the fingerprint of its run at the recipe's own size: each
    matrix recipe's runs at its own size and at SIZES."""
    groups: dict[tuple[str, int, str], list[Cell]] = {}
    for cell in cells:
        if cell.row.endswith(" pass 1"):
            groups.setdefault((cell.workload, cell.gpus, cell.row.split(" [")[0]), []).append(cell)
    return {own.recipe.fingerprint(): group for group in groups.values() for own in group if at_checked_size(own)}
