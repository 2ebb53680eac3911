"""The one training loop, run by every process of every framework: `python -m repro.loop RUN_DIR`.

It reads the resolved recipe from RUN_DIR, builds the workload's model under the model seed,
hands it to the framework's adapter and trains: epochs of steps, validation after each epoch
(outside the epoch timer), device synchronisation at the timing boundaries. The reporting rank
appends structured events to RUN_DIR/events.jsonl; the parent process turns them into MLflow.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from repro import events, registry, seeding
from repro.adapters.base import Adapter, RunContext
from repro.metrics import Timer, device_name, device_used_bytes, peak_memory_bytes
from repro.recipe import Recipe, resolve

RUN_FILE = "run.json"


class GlobalBatches(torch.utils.data.Sampler):
    """Each step's global batch from one seeded permutation per epoch, sliced to this rank's shard.

    Every framework and GPU count sees the same samples in the same order at each step, so a
    difference in loss is a difference between frameworks, not between data orders.
    """

    def __init__(self, size: int, global_batch: int, shard: tuple[int, int], seed: int, epoch: int = 0):
        index, count = shard
        if global_batch % count:
            raise ValueError(f"global batch {global_batch} does not split into {count} equal shards")
        self.size, self.global_batch, self.seed, self.epoch = size, global_batch, seed, epoch
        self.per_shard = global_batch // count
        self.offset = index * self.per_shard

    def __len__(self) -> int:
        return self.size // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator)
        for step in range(len(self)):
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


def pick_device(recipe: Recipe, local_rank: int) -> torch.device:
    wanted = recipe.run.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: int) -> tuple[int, int, int]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return rank, world, local_rank


class Trainer:
    """Runs the epochs of one rank and emits events on the reporting rank."""

    def __init__(self, recipe: Recipe, run_dir: Path, data_dir: Path):
        self.recipe, self.run_dir = recipe, run_dir
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = pick_device(recipe, self.local_rank)
        rank, world, local_rank = init_distributed(self.device, recipe.run.timeout_s)
        seeds = seeding.seed_table(recipe.seed, rank)
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # one stand-in GPU per core; also keeps CPU reductions deterministic
        seeding.make_deterministic(self.device.type == "cuda")
        workload = registry.workload_class(recipe.workload)(recipe.model, recipe.data, data_dir)
        self.ctx = RunContext(recipe, workload, rank, world, local_rank, self.device, seeds, run_dir)
        seeding.seed_everything(seeds["model_init"])
        model = workload.build_model()
        self.adapter: Adapter = registry.adapter_class(recipe.run.framework)(self.ctx)
        self.adapter.setup(model)
        seeding.seed_everything(seeds["rank_stream"])
        self.train_set, self.val_set = workload.datasets()
        self.global_batch = type(self.adapter).global_batch(recipe)
        self.reporting = rank == self.adapter.reporting_rank
        self.writer = events.EventWriter(run_dir / events.EVENTS_FILE) if self.reporting else None

    def emit(self, kind: str, **fields: object) -> None:
        if self.writer:
            self.writer.emit(kind, **fields)

    def loader(self, dataset: torch.utils.data.Dataset, sampler: torch.utils.data.Sampler) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=self.recipe.data.workers)

    def train_loader(self, epoch: int) -> torch.utils.data.DataLoader:
        shard, seed = self.adapter.data_shard(), self.ctx.seeds["data_order"]
        return self.loader(self.train_set, GlobalBatches(len(self.train_set), self.global_batch, shard, seed, epoch))

    def validate(self) -> dict[str, float]:
        sampler = EvenShard(len(self.val_set), self.adapter.data_shard(), self.recipe.train.batch_per_gpu)
        totals = torch.zeros(3, dtype=torch.float64)
        self.adapter.set_training(False)
        try:
            for inputs, targets in self.loader(self.val_set, sampler):
                sums = self.adapter.eval_step(inputs, targets)
                if sums is not None:
                    totals += sums.detach().cpu().double()
        finally:
            self.adapter.set_training(True)
        totals = self.adapter.reduce_metric_sums(totals.to(self.device)).cpu()
        return self.ctx.workload.finish_metric(totals) if self.reporting else {}

    def memory(self) -> dict[str, object]:
        """Peak and model-state bytes of every rank, gathered to all ranks."""
        peak, method = peak_memory_bytes(self.device)
        mine = {"rank": self.ctx.rank, "peak_bytes": peak, "method": method,
                "device_used_bytes": device_used_bytes(self.device), **self.adapter.model_state_bytes()}
        ranks = [mine]
        if dist.is_initialized() and self.ctx.world > 1:
            ranks = [None] * self.ctx.world
            dist.all_gather_object(ranks, mine)
        return {"ranks": ranks}

    def run(self) -> None:
        recipe = self.recipe
        steps_per_epoch = len(self.train_loader(0))
        if steps_per_epoch == 0:
            raise ValueError(
                f"{recipe.source}: train.batch_per_gpu: the global batch ({self.global_batch}) is larger than "
                f"the training set ({len(self.train_set)} samples)"
            )
        self.emit(
            events.START, seeds=self.ctx.seeds, world=self.ctx.world, device=str(self.device),
            device_name=device_name(self.device),
            global_batch=self.global_batch, steps_per_epoch=steps_per_epoch, epochs=recipe.train.epochs,
            max_steps=recipe.train.max_steps, train_samples=len(self.train_set), val_samples=len(self.val_set),
            adapter=self.adapter.facts(),
        )
        step, elapsed = 0, 0.0
        for epoch in range(recipe.train.epochs):
            epoch_steps = 0
            with Timer(self.device) as timer:
                for inputs, targets in self.train_loader(epoch):
                    loss = self.adapter.train_step(inputs, targets)
                    step, epoch_steps = step + 1, epoch_steps + 1
                    if step % recipe.train.log_every == 0:
                        self.emit(events.STEP, step=step, epoch=epoch, loss=loss)
                    if recipe.train.max_steps and step >= recipe.train.max_steps:
                        break
                self.adapter.end_epoch()
            elapsed += timer.seconds
            samples = epoch_steps * self.global_batch
            metrics = self.validate()
            memory = self.memory()
            self.emit(
                events.EPOCH, epoch=epoch, step=step, epoch_s=timer.seconds, elapsed_s=elapsed,
                samples=samples, samples_per_s=samples / timer.seconds, val=metrics, **memory,
            )
            if recipe.train.max_steps and step >= recipe.train.max_steps:
                break
        self.emit(events.END, step=step, elapsed_s=elapsed)

    def close(self) -> None:
        self.adapter.teardown()
        if self.writer:
            self.writer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(run_dir: str) -> None:
    run_dir_path = Path(run_dir)
    spec = json.loads((run_dir_path / RUN_FILE).read_text())
    recipe = resolve(spec["recipe"], spec["recipe"]["source"])
    trainer = Trainer(recipe, run_dir_path, Path(spec["data_dir"]))
    try:
        trainer.run()
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1])
