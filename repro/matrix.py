"""The experiment matrix's file (`configs/table2.yaml`) and its expansion into cells.

What the matrix runner (`repro.table2`) runs and what the model (`repro.model`) and the reports read,
kept below all three so none of them imports the runner. With `repeats` N, each cell runs N times:
repeat 0 with the recipe's seed (so a store made without repeats is reused), repeat r with
seed + r x REPEAT_SEED_STRIDE. The seed is part of the recipe, so each repeat has its own fingerprint.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from repro import registry
from repro.cell import Cell
from repro.recipe import configs_dir, load_file, recipe_path
from repro.schema import RecipeError, build

REPEAT_SEED_STRIDE = 1000  # repeats' master seeds lie this far apart (per-rank seeds derive from them)


@dataclass
class Row:
    name: str
    framework: str
    set: list[str] = field(default_factory=list)

    def overrides(self, gpus: int, tp_per_node: int) -> list[str]:
        """The row's `set` with `{gpus}` and `{tp_per_node}` filled in."""
        return [text.format(gpus=gpus, tp_per_node=tp_per_node) for text in self.set]


@dataclass
class ScalePlan:
    gpus: list[int]
    gpus_per_node: int
    workloads: list[str]
    tp_per_node: int | None = None  # the hybrid's tensor-parallel size, `{tp_per_node}`: GPUs per node unless set


@dataclass
class Matrix:
    rows: list[Row]
    scales: dict[str, ScalePlan]


def matrix_path() -> Path:
    return configs_dir() / "table2.yaml"


def load_matrix(path: Path | None = None, rows: list[str] | None = None) -> Matrix:
    """The matrix file, keeping only `rows` when given (KeyError naming the valid rows otherwise)."""
    path = path or matrix_path()
    raw = yaml.safe_load(path.read_text())
    matrix = build(Matrix, {**raw, "scales": {}}, str(path))
    matrix.scales = {name: build(ScalePlan, plan, str(path), f"scales.{name}") for name, plan in raw["scales"].items()}
    if rows:
        valid = [row.name for row in matrix.rows]
        unknown = [name for name in rows if name not in valid]
        if unknown:
            raise KeyError(f"unknown row {unknown[0]!r}; valid rows: {', '.join(valid)}")
        matrix.rows = [row for row in matrix.rows if row.name in rows]
    return matrix


def cell_for(workload: str, row: Row, gpus: int, scale: str, gpus_per_node: int, extra: list[str],
             tp_per_node: int | None = None) -> Cell:
    """The cell's recipe: the row's `set` with `{gpus}` and `{tp_per_node}` (GPUs per node unless given)
    filled in; a recipe the framework rejects (tp=2 on 1 GPU) makes the cell not applicable, with why."""
    cell = Cell(workload, row.name, row.framework, gpus)
    absence = registry.framework(row.framework).absence()
    if absence:
        cell.skip = f"unavailable here: {absence}"
        return cell
    nodes = math.ceil(gpus / gpus_per_node)
    fields = [f"run.framework={row.framework}", f"run.gpus={gpus}", f"run.nodes={nodes}"]
    cell.overrides = row.overrides(gpus, tp_per_node or gpus_per_node) + list(extra)
    fields += cell.overrides
    try:
        cell.recipe = load_file(recipe_path(workload, scale), fields)
    except RecipeError as error:
        cell.skip = f"not applicable: {error.problem}"
    return cell


def repeated(cell: Cell, repeats: int) -> list[Cell]:
    """The cell and its repeats, each with its own master seed."""
    if not cell.recipe:
        return [cell]
    seeds = [cell.recipe.seed + r * REPEAT_SEED_STRIDE for r in range(repeats)]
    return [cell] + [dataclasses.replace(cell, repeat=r, recipe=dataclasses.replace(cell.recipe, seed=seed),
                                         overrides=[*cell.overrides, f"seed={seed}"])
                     for r, seed in enumerate(seeds[1:], 1)]


def expand(
    matrix: Matrix, scale: str, extra: list[str] = (), gpus_per_node: int | None = None, repeats: int = 1,
) -> list[Cell]:
    """Every cell of the matrix at `scale`, `repeats` times (cells with equal recipes, such as
    megatron-intra and megatron-data at 1 GPU, share one run)."""
    plan = matrix.scales[scale]
    per_node = gpus_per_node or plan.gpus_per_node
    tp_per_node = None if gpus_per_node else plan.tp_per_node  # a node size given here sets the hybrid's tp
    return [
        repeat
        for workload in plan.workloads for row in matrix.rows for gpus in plan.gpus
        for repeat in repeated(cell_for(workload, row, gpus, scale, per_node, list(extra), tp_per_node), repeats)
    ]
