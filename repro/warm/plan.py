"""Which runs start their ranks warm, and what their fork server imports (no torch here).

A run's ranks are warm when they would be torchrun's workers of `repro.loop` on this one node, as CPU
stand-ins for GPUs (docs/launch.md): the framework's launch line (its plan's `command`) says the first,
the device the second. Frameworks with their own runtime (LBANN's driver), GPU runs and multi-node runs keep theirs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from repro import launch, registry
from repro.recipe import Recipe

RANK_ENTRY = "repro.warm.ranks:loop_rank"  # what each warm rank runs: the loop on RUN_DIR


def runs_torchrun_of_the_loop(recipe: Recipe, command: list[str], run_dir: Path) -> bool:
    """Whether `command`, the framework's launch line of `recipe` (its plan's), is torchrun of the loop on one node."""
    processes = registry.plan_class(recipe.run.framework).processes(recipe)
    return recipe.run.nodes == 1 and command == launch.torchrun_local(processes, run_dir)


def preload(recipes: Iterable[Recipe]) -> list[str]:
    """The modules the ranks of `recipes` import: adapters, workloads and the frameworks they need."""
    modules: list[str] = []
    for recipe in recipes:
        entry = registry.framework(recipe.run.framework)
        modules += [entry.adapter.partition(":")[0], registry.workload(recipe.workload).workload.partition(":")[0],
                    *entry.needs_modules, *entry.rank_modules]
    return list(dict.fromkeys(modules))
