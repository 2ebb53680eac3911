"""The baseline of the harness-overhead benchmark: a smoke workload (GPT-2, or VGG-16) trained by a
minimal loop written directly on the framework's API (DDP, DeepSpeed ZeRO or FSDP2), with the kit's model (its weights,
from the model seed of the kit's seed table), data (in its data-order seed's order, fetched as the kit
fetches it: repro.batches.batches), batch, sampler,
optimizer, DeepSpeed configuration and deterministic kernels (the recipe's seed policy, which
every framework runs under: about 3% of a one-process smoke GPT-2 step on CPU, a cost of the policy,
not of the loop) but none of its loop: no loss read, no stop vote, no events, no checkpoints.
Launched by torchrun; rank 0 writes its step times, and the wall times they lie between, as JSON.
It ends as the loop does (repro.loop.Trainer.close): every rank waits for the others before
DeepSpeed and the process group are torn down, else a rank that leaves first aborts its peer
(SIGABRT at exit).

FSDP2 is written out as its users write it (`fully_shard` on each of the kit's units, the workload's
blocks, then on the model; the optimizer over the DTensor parameters); `fsdp_parts` takes the wrapping
and options to vary, for bench/fsdp_costs.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/minimal.py ddp OUT.json STEPS [WORKLOAD]
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from repro import registry, seeding
from repro.data.sets import dataset
from repro.batches import GlobalBatches, batches
from repro.optim import make_optimizer
from repro.recipe import Recipe, load_file, recipe_path
from repro.workloads.base import Workload

Step = Callable[[torch.Tensor, torch.Tensor], None]
Teardown = Callable[[], None]


def ddp_step(model: torch.nn.Module, workload: Workload, recipe: Recipe) -> tuple[Step, Teardown]:
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = make_optimizer(recipe.optimizer(), model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model(x), y).backward()
        optimizer.step()

    return step, lambda: None


def zero_step(model: torch.nn.Module, workload: Workload, recipe: Recipe) -> tuple[Step, Teardown]:
    import deepspeed

    from repro.adapters.base import RunContext
    from repro.adapters.zero import ZeroAdapter

    # The adapter's own configuration, so that both sides run the same ZeRO (buckets, overlap, stage).
    context = RunContext(recipe, workload, dist.get_rank(), dist.get_world_size(), 0, torch.device("cpu"))
    config = ZeroAdapter(context).deepspeed_config()
    optimizer = make_optimizer(recipe.optimizer(), model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(workload.loss(engine(x), y))
        engine.step()

    return step, engine.destroy


def fsdp_parts(
    model: torch.nn.Sequential, workload: Workload, recipe: Recipe, wrap: str = "block",
    reshard_root: bool | None = True, foreach: bool | None = True,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2 over the whole world, fp32. `wrap`: "block" (a unit per block of the workload's model, as
    the kit wraps it: repro.adapters.fsdp.units), "layer" (a unit per layer with parameters: the kit
    before) or "root" (the model one unit). `reshard_root`: the root's reshard_after_forward (True, as
    the kit passes it to every unit; None: FSDP2's default, False for the root, which backward would
    gather again at once; the other units reshard). `foreach`: the torch optimizers' multi-tensor path
    (None: torch's default, on CPU the per-tensor loop)."""
    from torch.distributed.fsdp import fully_shard

    from repro.adapters.fsdp import units

    if wrap != "root":
        blocks = workload.blocks(model) if wrap == "block" else [[index] for index in range(len(model))]
        for unit in units(model, blocks):
            fully_shard(unit)
    fully_shard(model, reshard_after_forward=reshard_root)
    return model, make_optimizer(recipe.optimizer(), model.parameters(), foreach=foreach)


def fsdp_step(model: torch.nn.Module, workload: Workload, recipe: Recipe) -> tuple[Step, Teardown]:
    model, optimizer = fsdp_parts(model, workload, recipe)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model(x), y).backward()
        optimizer.step()

    return step, lambda: None


STEP_BUILDERS = {"ddp": ddp_step, "zero": zero_step, "fsdp": fsdp_step}


def build_model(workload: Workload, recipe: Recipe) -> torch.nn.Module:
    """The kit's model: built under the recipe's model seed, so both sides start from the same weights."""
    seeding.seed_everything(seeding.seed_table(recipe.seed, dist.get_rank())["model_init"])
    return workload.build_model()


def timed_steps(step: Step, train: torch.utils.data.Dataset, recipe: Recipe, steps: int) -> list[float]:
    """`steps` steps over the kit's global batches (its data-order seed) from epoch 0 on, each timed as
    the kit times a step: from the end of one step to the end of the next."""
    rank, world = dist.get_rank(), dist.get_world_size()
    order = seeding.seed_table(recipe.seed, rank)["data_order"]
    epoch, ends = 0, [time.perf_counter()]
    while len(ends) <= steps:
        sampler = GlobalBatches(len(train), recipe.train.batch_per_gpu * world, (rank, world), order, epoch)
        for x, y in batches(train, sampler, recipe.data.workers):
            step(x, y)
            ends.append(time.perf_counter())
            if len(ends) > steps:
                break
        epoch += 1
    return [b - a for a, b in zip(ends, ends[1:])]


def main(framework: str, out: str, steps: int, workload_name: str = "gpt2") -> None:
    recipe = load_file(recipe_path(workload_name, "smoke"), [f"run.framework={framework}"])
    torch.set_num_threads(1)
    seeding.make_deterministic(on_cuda=False)
    dist.init_process_group("gloo")
    workload = registry.workload_class(workload_name)(recipe.model, recipe.data, dataset(recipe.data.dataset).locate())
    step, teardown = STEP_BUILDERS[framework](build_model(workload, recipe), workload, recipe)
    train, _ = workload.datasets()
    started = time.time()
    steps_s = timed_steps(step, train, recipe, steps)
    if dist.get_rank() == 0:  # the walls bound the steps, for the CPU the job's processes spent meanwhile
        Path(out).write_text(json.dumps({"steps_s": steps_s, "start_wall": started, "end_wall": time.time()}))
    dist.barrier()
    teardown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
