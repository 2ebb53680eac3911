"""Where an FSDP2 step's time goes on CPU: bench/minimal.py's FSDP2 loop (`fsdp_parts`) in variants that
change its wrapping or options but not its arithmetic, beside DDP and the bare model, on the kit's
smoke workload, model (its model seed) and batches (its data-order seed).

The variants train side by side on the same ranks, one step each in turn (A B C A B C ...), so that
the machine's drift lands on all of them alike; each step is split into forward (with the loss and
zero_grad), backward and optimizer step, timed on the host (perf_counter, after a barrier, so that a
rank does not start a step while its peer still finishes the last one). After WARM_UP rounds, rank 0
prints the median of every part per variant, and the collectives of one step (the kit's
communication counter: calls and payload per kind), with the load average before and after.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/fsdp_costs.py vgg16 ROUNDS [VARIANT ...]

Variants (default: all):
- none: the model without FSDP or DDP: the arithmetic alone, nothing communicated;
- ddp: DistributedDataParallel, the kit's control;
- kit: the kit's FSDP adapter (repro.adapters.fsdp), its whole step (`train_step`), beside `block`: the
  adapter's own share of a step, without the drift that separates bench/paired.py's blocks;
- block: FSDP2 as the kit applies it (a unit per block of the workload's model, the multi-tensor optimizer);
- block-loop: the same with the optimizer's per-tensor loop (torch's default on CPU);
- block-root-kept: the root unit kept gathered from forward to backward (FSDP2's default for the root;
  the kit reshards it too, and backward gathers it again at once);
- layer, layer-loop: a unit per layer with parameters (VGG-16: 16 units, not 8), with either optimizer
  path (layer-loop: the kit before issue 41);
- root: the whole model one FSDP unit (one all-gather, one reduce-scatter a step);
- block-lamb-foreach: `block` with timm's LAMB on its multi-tensor path (not bit for bit its loop's
  arithmetic, so not the kit's; GPT-2 only).
"""
from __future__ import annotations

import copy
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from minimal import build_model, fsdp_parts

from repro import registry, seeding
from repro.adapters.base import RunContext
from repro.adapters.fsdp import FSDPAdapter
from repro.batches import GlobalBatches, batches
from repro.communication import CommCounter
from repro.data.sets import dataset
from repro.optim import make_optimizer
from repro.recipe import load_file, recipe_path

WARM_UP = 3  # rounds left out: allocator, first collectives, optimizer state
PARTS = ("forward", "backward", "optimizer", "step")


Parts = tuple[torch.nn.Module, torch.optim.Optimizer]


def variant(name: str, model: torch.nn.Sequential, workload, recipe) -> Parts | FSDPAdapter:
    if name == "kit":
        world = dist.get_world_size()
        context = RunContext(recipe, workload, dist.get_rank(), world, 0, torch.device("cpu"))
        adapter = FSDPAdapter(context)
        adapter.setup(model)
        return adapter
    if name in ("none", "ddp"):
        model = torch.nn.parallel.DistributedDataParallel(model) if name == "ddp" else model
        return model, make_optimizer(recipe.optimizer(), model.parameters(), foreach=True)
    options = {"block": {}, "block-loop": {"foreach": None}, "block-root-kept": {"reshard_root": None},
               "layer": {"wrap": "layer"}, "layer-loop": {"wrap": "layer", "foreach": None}, "root": {"wrap": "root"},
               "block-lamb-foreach": {}}
    if name not in options:
        raise SystemExit(f"fsdp_costs.py: unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
    model, optimizer = fsdp_parts(model, workload, recipe, **options[name])
    if name == "block-lamb-foreach":  # timm's LAMB reads its path from the group at each step
        for group in optimizer.param_groups:
            group["foreach"] = True
    return model, optimizer


VARIANTS = ("none", "ddp", "kit", "block", "block-loop", "block-root-kept", "layer", "layer-loop", "root",
            "block-lamb-foreach")


def timed_step(built: Parts | FSDPAdapter, workload, x, y, align: bool = True) -> list[float]:
    """Forward (zero_grad, forward, loss), backward, optimizer step and the whole, in milliseconds; the
    kit's step is one call (Adapter.train_step), whole only (its parts: NaN)."""
    if align:
        dist.barrier()
    start = time.perf_counter()
    if isinstance(built, FSDPAdapter):
        built.train_step(x, y)
        return [math.nan] * 3 + [(time.perf_counter() - start) * 1e3]
    model, optimizer = built
    optimizer.zero_grad(set_to_none=True)
    loss = workload.loss(model(x), y)
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    return [(b - a) * 1e3 for a, b in ((start, forward), (forward, backward), (backward, end), (start, end))]


def main(workload_name: str, rounds: int, names: list[str]) -> None:
    world = int(os.environ["WORLD_SIZE"])  # torchrun's
    recipe = load_file(recipe_path(workload_name, "smoke"), ["run.framework=fsdp", f"run.gpus={world}"])
    torch.set_num_threads(1)
    seeding.make_deterministic(on_cuda=False)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loaded = os.getloadavg()[0]
    workload = registry.workload_class(workload_name)(recipe.model, recipe.data, dataset(recipe.data.dataset).locate())
    train, _ = workload.datasets()
    order = seeding.seed_table(recipe.seed, rank)["data_order"]
    sampler = GlobalBatches(len(train), recipe.train.batch_per_gpu * world, (rank, world), order, 0)
    data = list(batches(train, sampler, recipe.data.workers))
    base = build_model(workload, recipe)
    built = {name: variant(name, copy.deepcopy(base), workload, recipe) for name in names}
    times = {name: [] for name in names}
    comm = {}
    for index in range(rounds + WARM_UP):
        x, y = data[index % len(data)]
        for name, parts in built.items():
            if index == WARM_UP - 1:  # one step counted, after the others' warm-up
                counter, _ = CommCounter(), dist.barrier()
                with counter.counting():
                    timed_step(parts, workload, x, y, align=False)
                comm[name] = counter.per_step()
                continue
            measured = timed_step(parts, workload, x, y)
            if index >= WARM_UP:
                times[name].append(measured)
    if rank == 0:
        print(f"{workload_name} smoke, {world} process(es), {rounds} rounds, medians in ms; "
              f"load average {loaded:.2f} before, {os.getloadavg()[0]:.2f} after")
        print(f"  {'variant':20s}" + "".join(f"{part:>11s}" for part in PARTS) + "  collectives a step (calls, payload bytes)")
        for name in names:
            medians = [statistics.median(step[i] for step in times[name]) for i in range(len(PARTS))]
            calls = comm[name].get("calls", {})
            sent = ", ".join(f"{kind} {calls[kind]} x, {comm[name]['bytes'][kind]:,} B" for kind in calls) or "none"
            print(f"  {name:20s}" + "".join(f"{value:11.2f}" for value in medians) + f"  {sent}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] or list(VARIANTS))
