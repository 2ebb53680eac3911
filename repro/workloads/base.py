"""The workload interface the ranks use: build the model, read the data, compute loss and metric (torch).

A workload's model is a plain `nn.Sequential` that knows nothing about parallelism, so pipeline
frameworks can partition it and the others wrap it whole. What the parent needs of a workload is its
plan (repro.workloads.plan), which the workload subclasses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from repro.data import SYNTHETIC
from repro.recipe import DataSpec
from repro.workloads.plan import SYNTHETIC_TRAIN, SYNTHETIC_VAL, WorkloadPlan, synthetic_size


class Workload(WorkloadPlan):
    """Base: model, datasets, loss and validation metric of one workload."""

    def __init__(self, spec: Any, data: DataSpec, data_dir: Path | None):
        self.spec, self.data, self.data_dir = spec, data, data_dir

    def build_model(self) -> nn.Sequential:
        raise NotImplementedError

    def blocks(self, model: nn.Sequential) -> list[list[int]]:
        """The model's layers grouped into the architecture's blocks, as indices in order (a
        transformer block, a convolution stage): what a framework that treats the model block by block
        takes as its units (FSDP2 gathers and reduces each unit's parameters at once). Default: each
        layer a block of its own."""
        return [[index] for index in range(len(model))]

    def datasets(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        """(train, validation): the real data, or random samples of the same shapes for `synthetic`."""
        if self.data.dataset == SYNTHETIC:
            generator = torch.Generator().manual_seed(0)
            return (self.random_samples(synthetic_size(self.data.max_train_samples, SYNTHETIC_TRAIN), generator),
                    self.random_samples(synthetic_size(self.data.max_val_samples, SYNTHETIC_VAL), generator))
        return self.real_datasets()

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
        counted = torch.tensor(float(flat_target.numel()), device=loss_sum.device)  # where the sums are (CUDA)
        return torch.stack([loss_sum.detach(), correct.to(loss_sum.dtype), counted])

    def finish_metric(self, sums: torch.Tensor) -> dict[str, float]:
        loss = float(sums[0] / sums[2])
        return {"val/loss": loss, **self._metric(loss, float(sums[1] / sums[2]))}

    def _metric(self, loss: float, accuracy: float) -> dict[str, float]:
        raise NotImplementedError

    def flops_per_sample(self) -> float:
        """Training FLOPs (forward and backward) of one sample."""
        raise NotImplementedError


def limit(dataset: torch.utils.data.Dataset, count: int | None) -> torch.utils.data.Dataset:
    """The first `count` samples (all when None): a fixed, framework-independent subset."""
    if count is None or count >= len(dataset):
        return dataset
    return torch.utils.data.Subset(dataset, range(count))
