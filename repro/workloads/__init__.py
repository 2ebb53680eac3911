"""Workloads: one model definition and one data pipeline per paper workload, shared by every framework.

A workload's model is a plain `nn.Sequential` that knows nothing about parallelism, so pipeline
frameworks can partition it and the others wrap it whole.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from repro.recipe import DataSpec, Recipe
from repro.schema import RecipeError


SYNTHETIC_TRAIN, SYNTHETIC_VAL = 512, 64  # samples of the synthetic data set unless data.max_*_samples say


class Workload:
    """Base: model, datasets, loss and validation metric of one workload."""

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

    def __init__(self, spec: Any, data: DataSpec, data_dir: Path | None):
        self.spec, self.data, self.data_dir = spec, data, data_dir

    def build_model(self) -> nn.Sequential:
        raise NotImplementedError

    def datasets(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        """(train, validation): the real data, or random samples of the same shapes for `synthetic`."""
        from repro.data import SYNTHETIC

        if self.data.dataset == SYNTHETIC:
            generator = torch.Generator().manual_seed(0)
            return (self.random_samples(synthetic_size(self.data.max_train_samples, SYNTHETIC_TRAIN), generator),
                    self.random_samples(synthetic_size(self.data.max_val_samples, SYNTHETIC_VAL), generator))
        return self.real_datasets()

    def train_samples(self) -> int:
        """The training samples there are at most, counted without loading them (checked before launch)."""
        from repro.data import SYNTHETIC

        if self.data.dataset == SYNTHETIC:
            return synthetic_size(self.data.max_train_samples, SYNTHETIC_TRAIN)
        limit = self.data.max_train_samples
        return self.real_train_samples() if limit is None else min(limit, self.real_train_samples())

    def real_train_samples(self) -> int:
        """An upper bound of the real training split's samples, from file sizes or names."""
        raise NotImplementedError

    def real_datasets(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        raise NotImplementedError

    def random_samples(self, count: int, generator: torch.Generator) -> torch.utils.data.Dataset:
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def metric_sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[summed loss, correct predictions, counted targets] of one batch, to be summed over ranks."""
        flat_out = output.reshape(-1, output.shape[-1]).float()
        flat_target = target.reshape(-1)
        loss_sum = nn.functional.cross_entropy(flat_out, flat_target, reduction="sum")
        correct = (flat_out.argmax(-1) == flat_target).sum()
        return torch.stack([loss_sum.detach(), correct.to(loss_sum.dtype), torch.tensor(float(flat_target.numel()))])

    def finish_metric(self, sums: torch.Tensor) -> dict[str, float]:
        loss = float(sums[0] / sums[2])
        return {"val/loss": loss, **self._metric(loss, float(sums[1] / sums[2]))}

    def _metric(self, loss: float, accuracy: float) -> dict[str, float]:
        raise NotImplementedError

    def flops_per_sample(self) -> float:
        """Training FLOPs (forward and backward) of one sample."""
        raise NotImplementedError


def synthetic_size(count: int | None, default: int) -> int:
    return count if count is not None else default


def limit(dataset: torch.utils.data.Dataset, count: int | None) -> torch.utils.data.Dataset:
    """The first `count` samples (all when None): a fixed, framework-independent subset."""
    if count is None or count >= len(dataset):
        return dataset
    return torch.utils.data.Subset(dataset, range(count))
