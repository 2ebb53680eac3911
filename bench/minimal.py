"""The baseline of the harness-overhead benchmark: the smoke GPT-2 trained by a minimal loop
written directly on the framework's API (DDP or DeepSpeed ZeRO), with the kit's model, data and
batch but none of its loop. Launched by torchrun; rank 0 writes its step times as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/minimal.py ddp OUT.json STEPS
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from repro.data.sets import dataset
from repro.recipe import Recipe, load_file, recipe_path
from repro.workloads.gpt2 import GPT2Workload

Step = Callable[[torch.Tensor, torch.Tensor], None]


def ddp_step(model: torch.nn.Module, workload: GPT2Workload, recipe: Recipe) -> Step:
    from timm.optim import Lamb

    model = torch.nn.parallel.DistributedDataParallel(model)
    spec = recipe.optimizer()
    optimizer = Lamb(model.parameters(), lr=spec.lr, betas=tuple(spec.betas), weight_decay=spec.weight_decay)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        workload.loss(model(x), y).backward()
        optimizer.step()

    return step


def zero_step(model: torch.nn.Module, workload: GPT2Workload, recipe: Recipe) -> Step:
    import deepspeed

    spec, zero = recipe.optimizer(), recipe.options()
    config = {"train_micro_batch_size_per_gpu": recipe.train.batch_per_gpu, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1,
              "zero_optimization": {"stage": zero.stage, "reduce_bucket_size": zero.reduce_bucket_size,
                                    "allgather_bucket_size": zero.allgather_bucket_size}}
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.lr, betas=tuple(spec.betas), weight_decay=spec.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(workload.loss(engine(x), y))
        engine.step()

    return step


def main(framework: str, out: str, steps: int) -> None:
    recipe = load_file(recipe_path("gpt2", "smoke"), [f"run.framework={framework}"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    workload = GPT2Workload(recipe.model, recipe.data, dataset(recipe.data.dataset).locate())
    torch.manual_seed(0)
    step = {"ddp": ddp_step, "zero": zero_step}[framework](workload.build_model(), workload, recipe)
    train, _ = workload.datasets()
    sampler = torch.utils.data.DistributedSampler(train, shuffle=False)
    loader = torch.utils.data.DataLoader(train, batch_size=recipe.train.batch_per_gpu, sampler=sampler, drop_last=True)
    ends = [time.perf_counter()]
    while len(ends) <= steps:
        for x, y in loader:  # step time as the kit measures it: end of one step to the end of the next
            step(x, y)
            ends.append(time.perf_counter())
            if len(ends) > steps:
                break
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([b - a for a, b in zip(ends, ends[1:])]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
