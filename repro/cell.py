"""One cell of the comparison matrix: what the matrix runner (repro.table2) makes and the reports read.

It lives below both, so the reports never import the runner.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from repro.recipe import Recipe


@dataclass
class Cell:
    workload: str
    row: str
    framework: str
    gpus: int
    recipe: Recipe | None = None
    skip: str | None = None  # why the cell is not run: not applicable, unavailable or unable to run here
    overrides: list[str] = field(default_factory=list)  # what the row and the command line set in its recipe
    repeat: int = 0  # which of the matrix's repeats (0: the recipe's own seed)

    @property
    def label(self) -> str:
        return f"{self.workload} {self.row} {self.gpus}g" + (f" #{self.repeat + 1}" if self.repeat else "")
