"""The batches every rank trains and validates on: which samples, in which order, fetched how.

Every framework and GPU count sees the same samples in the same order at each step (GlobalBatches),
and validation evaluates each sample exactly once whatever the GPU count (EvenShard).
"""
from __future__ import annotations

import itertools
from typing import Iterator

import torch

# batches fetched in a row from a dataset that collates them (InProcessBatches): a loss window's worth
# (repro.loop.SYNC_EVERY), fetched between two of the loop's windows
FETCHED_TOGETHER = 16


class GlobalBatches(torch.utils.data.Sampler):
    """Each step's global batch from one seeded permutation per epoch, sliced to this rank's shard.

    Every framework and GPU count sees the same samples in the same order at each step, so a
    difference in loss is a difference between frameworks, not between data orders.
    """

    def __init__(
        self, size: int, global_batch: int, shard: tuple[int, int], seed: int, epoch: int = 0, skip: int = 0,
    ):
        index, count = shard
        if global_batch % count:
            raise ValueError(f"global batch {global_batch} does not split into {count} equal shards")
        self.size, self.global_batch, self.seed, self.epoch = size, global_batch, seed, epoch
        self.skip = skip  # batches of this epoch already trained (resuming mid-epoch)
        self.per_shard = global_batch // count
        self.offset = index * self.per_shard

    def __len__(self) -> int:
        return self.size // self.global_batch - self.skip

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator)
        for step in range(self.skip, self.size // self.global_batch):
            start = step * self.global_batch + self.offset
            yield order[start : start + self.per_shard].tolist()


class EvenShard(torch.utils.data.Sampler):
    """Validation: shard `index` of `count` near-equal contiguous shards, split into the same number
    of near-equal batches (at most `batch` samples) on every rank.

    Every sample is evaluated exactly once whatever the GPU count, so validation metrics compare;
    equal batch counts keep ranks whose forward has collectives (FSDP, tensor parallelism) in step.
    """

    def __init__(self, size: int, shard: tuple[int, int], batch: int):
        index, count = shard
        self.start, self.end = index * size // count, (index + 1) * size // count
        self.batches = -(-size // (count * batch))

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[list[int]]:
        length = self.end - self.start
        for number in range(self.batches):
            first, last = self.start + number * length // self.batches, self.start + (number + 1) * length // self.batches
            if last > first:
                yield list(range(first, last))


class InProcessBatches:
    """What a DataLoader without workers yields (the same fetch, through `__getitems__` where the dataset
    has it, and the same `default_collate`), without its machinery around each batch (a profiler range
    and checks): the smoke GPT-2's batch took 71 instead of 126 us of CPU (medians; docs/measurement.md).

    A dataset that collates a batch itself (`collated(indices)`: bit for bit what `default_collate` makes
    of its samples, drawing no random numbers) is asked for FETCHED_TOGETHER batches in a row: right
    after a training step every tensor operation costs several times what it costs in a tight loop
    (the step has evicted the caches), so the smoke GPT-2's batch took 44 us of CPU a step, against
    244 one by one after each step (means; docs/measurement.md)."""

    def __init__(self, dataset: torch.utils.data.Dataset, sampler: torch.utils.data.Sampler):
        self.dataset, self.sampler = dataset, sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator:
        if hasattr(self.dataset, "collated"):
            return self.together()
        return self.one_by_one()

    def one_by_one(self) -> Iterator:
        fetch = getattr(self.dataset, "__getitems__", None) or (lambda indices: [self.dataset[i] for i in indices])
        for indices in self.sampler:
            yield torch.utils.data.default_collate(fetch(indices))

    def together(self) -> Iterator:
        sampled = iter(self.sampler)
        while chunk := list(itertools.islice(sampled, FETCHED_TOGETHER)):
            yield from [self.dataset.collated(indices) for indices in chunk]


def batches(dataset: torch.utils.data.Dataset, sampler: torch.utils.data.Sampler, workers: int) -> InProcessBatches | torch.utils.data.DataLoader:
    """The batches of `sampler` (a batch sampler): in this process, or from a DataLoader's `workers`."""
    if workers:
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers)
    return InProcessBatches(dataset, sampler)
