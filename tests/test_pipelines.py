"""Pipeline frameworks: torchgpipe equals plain training; PipeDream's schedule, stashing and staleness.

The in-process tests drive the adapters directly on a tiny GPT-2 (4 layers: embedding, two blocks,
tied head) with synthetic tokens; the slow tests run the real CLI on the smoke recipes.
"""
from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.func import functional_call

from repro import registry, seeding
from repro.adapters import pipeline
from repro.adapters.base import RunContext
from repro.optim import make_optimizer
from repro.recipe import load_file, recipe_path

TINY_GPT2 = ["model.n_layer=2", "model.d_model=16", "model.n_head=2", "model.seq_len=16", "train.batch_per_gpu=2"]
STEPS = 5
TOLERANCE = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """As in the training loop on CPU: torchgpipe's per-device threads must not oversubscribe the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_recipe(framework: str, gpus: int, *extra: str):
    overrides = [f"run.framework={framework}", f"run.gpus={gpus}", "run.device=cpu", *TINY_GPT2, *extra]
    return load_file(recipe_path("gpt2", "smoke"), overrides)


def build(recipe, rank: int = 0, world: int = 1):
    """(adapter set up on the tiny model, workload), built as the training loop builds them."""
    workload = registry.workload_class(recipe.workload)(recipe.model, recipe.data, None)
    ctx = RunContext(recipe, workload, rank, world, rank, torch.device("cpu"), seeding.seed_table(recipe.seed, rank))
    seeding.seed_everything(ctx.seeds["model_init"])
    adapter = registry.adapter_class(recipe.run.framework)(ctx)
    adapter.setup(workload.build_model())
    return adapter, workload


def token_batches(batch: int, count: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    windows = torch.randint(0, 256, (count, batch, 17), generator=generator)
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def plain_losses(recipe, batches) -> list[float]:
    """Ordinary single-device training of the same (tied) model with the same optimizer."""
    workload = registry.workload_class(recipe.workload)(recipe.model, recipe.data, None)
    seeding.seed_everything(seeding.seed_table(recipe.seed, 0)["model_init"])
    model = workload.build_model()
    optimizer = make_optimizer(recipe.optimizer(), model.parameters())
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# -- shared helpers ------------------------------------------------------------------------------

def test_balance_costs_minimises_the_slowest_partition():
    assert pipeline.balance_costs([1, 1, 1, 1], 2) == [2, 2]
    assert pipeline.balance_costs([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert pipeline.balance_costs([1, 2, 3, 4, 5], 3) == [3, 1, 1]


def test_untie_copies_a_parameter_shared_across_groups_only():
    recipe = tiny_recipe("ddp", 1)
    model = registry.workload_class("gpt2")(recipe.model, recipe.data, None).build_model()
    assert pipeline.untie(copy.deepcopy(model), [0, 0, 0, 0]) == []
    pairs = pipeline.untie(model, [0, 0, 1, 1])
    assert len(pairs) == 1
    original, twin = pairs[0]
    assert original is model[0].wte.weight and twin is model[3].weight and twin is not original
    assert torch.equal(original, twin)


# -- torchgpipe ----------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("balance", [[2, 2], [1, 1, 1, 1]])
def test_gpipe_equals_plain_training(balance, checkpoint):
    recipe = tiny_recipe(
        "torchgpipe", len(balance), f"torchgpipe.balance={balance}", f"torchgpipe.checkpoint={checkpoint}"
    )
    adapter, _ = build(recipe)
    global_batch = type(adapter).global_batch(recipe)
    assert global_batch == 2 * 4 * len(balance)  # micro-batch 2, 4 micro-batches per GPU
    batches = token_batches(global_batch)
    losses = [adapter.train_step(inputs, targets) for inputs, targets in batches]
    assert adapter.facts()["untied"] == ["3.weight <- 0.wte.weight"]
    assert losses == pytest.approx(plain_losses(recipe, batches), abs=TOLERANCE)
    assert losses[-1] < losses[0]


def test_gpipe_refuses_several_nodes(repro):
    result = repro("run", "vgg16", "--framework", "torchgpipe", "--gpus", "4", "--nodes", "2", "--dry-run")
    assert result.returncode != 0
    assert "torchgpipe drives the GPUs of one node only" in result.stderr + result.stdout


@pytest.mark.slow
def test_gpipe_vgg16_smoke_runs_on_cpu(repro):
    result = repro("run", "vgg16", "--framework", "torchgpipe", "--gpus", "4", "--scale", "smoke", "--max-steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    start = result.events()[0]
    assert start["global_batch"] == 16 * 4 * 4 and start["world"] == 1
    assert sum(start["adapter"]["balance"]) == 40 and len(start["adapter"]["balance"]) == 4
    assert len(result.losses()) == 2
