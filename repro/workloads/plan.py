"""What the parent knows of a workload before any process starts, without importing torch: its model
section (`ModelSpec`), the checks a recipe must pass and how many training samples its data holds.

Each workload's plan lives in its own torch-free module (`repro.workloads.NAME_plan`); its workload
(repro.workloads.base.Workload), which builds the model and reads the data in the ranks, subclasses it.
"""
from __future__ import annotations

from pathlib import Path

from repro.data import SYNTHETIC
from repro.recipe import Recipe
from repro.schema import RecipeError

SYNTHETIC_TRAIN, SYNTHETIC_VAL = 512, 64  # samples of the synthetic data set unless data.max_*_samples say


class WorkloadPlan:
    """Base: a workload's model section, its datasets and its validation metric, as facts."""

    ModelSpec: type
    metric: str  # the validation metric's name, "accuracy" or "perplexity"
    higher_is_better: bool
    supported_datasets: tuple[str, ...]  # what `data.dataset` may name for this workload

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        """Cross-field rules of the model section and the dataset; RecipeError naming the field."""
        if recipe.data.dataset not in cls.supported_datasets:
            raise RecipeError(source, "data.dataset", f"{recipe.workload} trains on "
                              f"{', '.join(cls.supported_datasets)}, not {recipe.data.dataset!r}")

    @classmethod
    def train_samples(cls, recipe: Recipe, data_dir: Path) -> int:
        """The training samples there are at most, counted without loading them (checked before launch)."""
        data = recipe.data
        if data.dataset == SYNTHETIC:
            return synthetic_size(data.max_train_samples, SYNTHETIC_TRAIN)
        real = cls.real_train_samples(recipe, data_dir)
        return real if data.max_train_samples is None else min(data.max_train_samples, real)

    @classmethod
    def real_train_samples(cls, recipe: Recipe, data_dir: Path) -> int:
        """An upper bound of the real training split's samples in `data_dir`, from file sizes or names."""
        raise NotImplementedError


def synthetic_size(count: int | None, default: int) -> int:
    return count if count is not None else default
