"""Pipeline frameworks: torchgpipe equals plain training; PipeDream's schedule, stashing and staleness.

The in-process tests drive the adapters directly on a tiny GPT-2 (4 layers: embedding, two blocks,
tied head) with synthetic tokens (units), stages in forked gloo ranks (ranks); the end-to-end tests run
the real CLI on the smoke recipes.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call

from repro import names, registry, seeding, tracking
from repro.adapters import pipeline
from repro.adapters.base import RunContext
from repro.optim import make_optimizer
from repro.recipe import load_file, recipe_path
from repro.schema import RecipeError
from ranks import start_ranks

TINY_GPT2 = ["model.n_layer=2", "model.d_model=16", "model.n_head=2", "model.seq_len=16", "train.batch_per_gpu=2"]
STEPS = 5
ADAM = "train.optimizer={name: adam, lr: 0.02}"  # learns the counting sequences within STEPS
TOLERANCE = 1e-5
SMALL_VALIDATION = ("--set", "data.max_val_samples=64")


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
    """Counting sequences from four starts: learnable (next = current + 1) in a few steps."""
    generator = torch.Generator().manual_seed(7)
    windows = (torch.randint(0, 4, (count, batch, 1), generator=generator) + torch.arange(17)) % 256
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

@pytest.mark.units
def test_balance_costs_minimises_the_slowest_partition():
    assert pipeline.balance_costs([1, 1, 1, 1], 2) == [2, 2]
    assert pipeline.balance_costs([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert pipeline.balance_costs([1, 2, 3, 4, 5], 3) == [3, 1, 1]


@pytest.mark.units
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

@pytest.mark.units
@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("balance", [[2, 2], [1, 1, 1, 1]])
def test_gpipe_equals_plain_training(balance, checkpoint):
    recipe = tiny_recipe(
        "torchgpipe", len(balance), ADAM, f"torchgpipe.balance={balance}", f"torchgpipe.checkpoint={checkpoint}"
    )
    adapter, _ = build(recipe)
    global_batch = type(adapter).global_batch(recipe)
    assert global_batch == 2 * 4 * len(balance)  # micro-batch 2, 4 micro-batches per GPU
    batches = token_batches(global_batch)
    losses = [loss_value(adapter.train_step(inputs, targets)) for inputs, targets in batches]
    assert adapter.facts()["untied"] == ["3.weight <- 0.wte.weight"]
    assert losses == pytest.approx(plain_losses(recipe, batches), abs=TOLERANCE)
    assert losses[-1] < losses[0]


@pytest.mark.units
def test_gpipe_refuses_several_nodes():
    with pytest.raises(RecipeError, match="torchgpipe drives the GPUs of one node only"):
        tiny_recipe("torchgpipe", 4, "run.nodes=2")


@pytest.mark.end_to_end
def test_gpipe_vgg16_smoke_runs_on_cpu(repro):
    result = repro(
        "run", "vgg16", "--framework", "torchgpipe", "--gpus", "4", "--scale", "smoke", "--max-steps", "2",
        "--set", "train.batch_per_gpu=4", *SMALL_VALIDATION,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    start = result.events()[0]
    assert start["global_batch"] == 4 * 4 * 4 and start["world"] == 1  # micro-batch x 4 x GPUs, one process
    assert sum(start["adapter"]["balance"]) == 40 and len(start["adapter"]["balance"]) == 4
    assert len(result.losses()) == 2


# -- PipeDream -----------------------------------------------------------------------------------

VALIDATION = token_batches(3, count=2)  # a batch size the training never used
PLAIN_SGD = "train.optimizer={name: sgd, lr: 0.5, momentum: 0.0, weight_decay: 0.0}"


@pytest.mark.units
def test_pipedream_one_stage_equals_plain_sgd():
    recipe = tiny_recipe("pipedream", 1, PLAIN_SGD, "pipedream.balance=[4]")
    adapter, _ = build(recipe)
    batches = token_batches(type(adapter).global_batch(recipe))
    losses = [loss_value(adapter.train_step(inputs, targets)) for inputs, targets in batches]
    adapter.end_epoch()
    assert adapter.facts()["untied"] == []
    assert losses == pytest.approx(plain_losses(recipe, batches), abs=TOLERANCE)
    assert losses[-1] < losses[0]


def loss_value(loss: torch.Tensor | None) -> float | None:
    """A step's loss as the loop logs it (train_step keeps it on the device)."""
    return None if loss is None else float(loss)


def stage_worker(overrides: list[str], out: Path) -> None:
    """One stage (a rank started by tests/ranks.py): train STEPS mini-batches, drain and validate, then save what it saw."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        recipe = tiny_recipe("pipedream", world, *overrides)
        adapter, _ = build(recipe, rank, world)
        losses = [loss_value(adapter.train_step(i, t)) for i, t in token_batches(recipe.train.batch_per_gpu)]
        adapter.end_epoch()
        sums = torch.zeros(3, dtype=torch.float64)  # as the loop validates: stages without output add zeros
        for inputs, targets in VALIDATION:
            stage_sums = adapter.eval_step(inputs, targets)
            sums += 0 if stage_sums is None else stage_sums.double()
        sums = adapter.reduce_metric_sums(sums)
        saved = {"losses": losses, "trace": list(adapter.trace), "weights": adapter.live, "val_sums": sums}
        torch.save(saved, out / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_stages(tmp_path: Path, balance: list[int], vertical_sync: bool) -> list[dict]:
    overrides = [PLAIN_SGD, f"pipedream.balance={balance}", f"pipedream.vertical_sync={vertical_sync}"]
    world = len(balance)
    start_ranks(world, stage_worker, overrides, tmp_path)
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(world)]


def reference_pipedream(balance: list[int], vertical_sync: bool) -> tuple[list[float], list[dict], torch.Tensor]:
    """PipeDream's arithmetic stated directly: mini-batch k runs stage s on that stage's weights after
    version(k, s) of its own updates, and stage s applies the gradient of mini-batch k as its (k+1)-th
    update (plain SGD). Returns the losses, each stage's final weights and their validation sums."""
    recipe = tiny_recipe("pipedream", len(balance), PLAIN_SGD, f"pipedream.balance={balance}")
    workload = registry.workload_class(recipe.workload)(recipe.model, recipe.data, None)
    seeding.seed_everything(seeding.seed_table(recipe.seed, 0)["model_init"])
    model = workload.build_model()
    groups = pipeline.group_of_layers(balance)
    pipeline.untie(model, groups)
    stages = len(balance)
    history = [[{n: p.detach().clone() for n, p in model.named_parameters() if groups[int(n.split(".")[0])] == s}]
               for s in range(stages)]
    losses = []
    for k, (inputs, targets) in enumerate(token_batches(recipe.train.batch_per_gpu)):
        lag = [stages - 1 if vertical_sync else stages - 1 - s for s in range(stages)]
        used = {n: w.clone().requires_grad_() for s in range(stages) for n, w in history[s][max(0, k - lag[s])].items()}
        loss = workload.loss(functional_call(model, used, (inputs,)), targets)
        grads = dict(zip(used, torch.autograd.grad(loss, list(used.values()))))
        for s in range(stages):
            history[s].append({n: w - recipe.train.optimizer.lr * grads[n] for n, w in history[s][-1].items()})
        losses.append(loss.item())
    final = {n: w for h in history for n, w in h[-1].items()}
    with torch.no_grad():
        sums = sum(workload.metric_sums(functional_call(model, final, (i,)), t).double() for i, t in VALIDATION)
    return losses, [h[-1] for h in history], sums


@pytest.mark.ranks
@pytest.mark.parametrize("balance", [[2, 2], [1, 1, 1, 1]])
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_stages_match_stashed_stale_arithmetic(tmp_path, balance, vertical_sync):
    stages = run_stages(tmp_path, balance, vertical_sync)
    count = len(balance)
    forwards = [{e["minibatch"]: e["version"] for e in s["trace"] if e["phase"] == "forward"} for s in stages]
    for s, stage in enumerate(stages):
        lag = count - 1 if vertical_sync else count - 1 - s
        for k in range(count - 1, STEPS):  # steady state
            # staleness: stage s runs S-1-s updates behind the last stage; vertical sync: one version
            assert forwards[-1][k] - forwards[s][k] == (0 if vertical_sync else lag)
        for event in (e for e in stage["trace"] if e["phase"] == "backward"):
            assert event["version"] == forwards[s][event["minibatch"]]  # backward on its forward's version
            if event["minibatch"] >= count - 1:  # ...while the live weights had moved on
                assert event["live"] - event["version"] == lag
    assert all(loss is None for stage in stages[:-1] for loss in stage["losses"])
    expected_losses, expected_weights, expected_sums = reference_pipedream(balance, vertical_sync)
    assert stages[-1]["losses"] == pytest.approx(expected_losses, abs=TOLERANCE)
    for stage, expected in zip(stages, expected_weights):  # a stage keeps the whole model's layer names
        assert stage["weights"].keys() == expected.keys()
        for name, weight in expected.items():
            torch.testing.assert_close(stage["weights"][name].detach(), weight, atol=TOLERANCE, rtol=0)
    for stage in stages:  # validation passed activations through the stages; every rank holds the sums
        torch.testing.assert_close(stage["val_sums"], expected_sums, atol=1e-4, rtol=0)


def resumable_stage_worker(overrides: list[str], out: Path, first: int, stop: int) -> None:
    """One stage trains mini-batches [first, stop) of STEPS, as one process of a run that may be stopped and
    resumed: it restores out/checkpoint when first > 0, and saves there when it stops before the end (with the
    generator state, as the loop does); otherwise it drains. Then it saves what it saw."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    folder, random_file = out / "checkpoint", out / "checkpoint" / f"random-{rank}.pt"
    try:
        adapter, _ = build(tiny_recipe("pipedream", world, *overrides), rank, world)
        if first:
            adapter.load_checkpoint(folder)
            torch.set_rng_state(torch.load(random_file))
        batches = token_batches(adapter.ctx.recipe.train.batch_per_gpu)[first:stop]
        losses = [loss_value(adapter.train_step(inputs, targets)) for inputs, targets in batches]
        if stop < STEPS:
            adapter.save_checkpoint(folder)
            torch.save(torch.get_rng_state(), random_file)
        else:
            adapter.end_epoch()
        saved = {"losses": losses, "trace": list(adapter.trace), "weights": adapter.live}
        torch.save(saved, out / f"{first}-{stop}-{rank}.pt")
        adapter.teardown()
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_stopped_mid_pipeline_resumes_bit_for_bit(tmp_path, vertical_sync):
    """Stopped twice between steps with mini-batches in flight and gradients in transit (at 2 the pipeline
    is still filling, at 4 every stage holds its allowance), each time restarted in fresh processes, four
    stages end exactly where four stages left alone end (dropout on: the rerun forwards must draw the
    same random numbers)."""
    overrides = ["model.dropout=0.1", "pipedream.balance=[1, 1, 1, 1]", f"pipedream.vertical_sync={vertical_sync}"]
    (tmp_path / "checkpoint").mkdir()

    def run(first: int, last: int) -> list[dict]:
        start_ranks(4, resumable_stage_worker, overrides, tmp_path, first, last)
        return [torch.load(tmp_path / f"{first}-{last}-{rank}.pt") for rank in range(4)]

    def saved_in_flight() -> list[list[dict]]:
        files = [tmp_path / "checkpoint" / f"pipedream-stage{rank}.pt" for rank in range(4)]
        return [torch.load(file, weights_only=False)["in_flight"] for file in files]

    alone = run(0, STEPS)
    pieces = []
    for first, stop in [(0, 2), (2, 4)]:
        pieces.append(run(first, stop))
        in_flight = saved_in_flight()
        assert [len(entries) for entries in in_flight] == [min(stop, 3 - rank) for rank in range(4)]
        received = [entry["grad_output"] is not None for entries in in_flight for entry in entries]
        assert sum(received) == (2 if stop == 2 else 3)  # stages holding their full allowance got one
    pieces.append(run(4, STEPS))
    assert [loss for piece in pieces for loss in piece[-1]["losses"]] == alone[-1]["losses"]
    for left_alone, resumed in zip(alone, pieces[-1]):
        assert resumed["trace"] == left_alone["trace"]
        assert resumed["weights"].keys() == left_alone["weights"].keys()
        assert all(torch.equal(resumed["weights"][n], w) for n, w in left_alone["weights"].items())


@pytest.mark.end_to_end
def test_pipedream_gpt2_smoke_runs_on_cpu_and_reports_the_last_stage(repro):
    result = repro(
        "run", "gpt2", "--framework", "pipedream", "--gpus", "4", "--scale", "smoke", "--max-steps", "6", *SMALL_VALIDATION
    )
    assert result.returncode == 0, result.stderr[-2000:]
    start, *_ = result.events()
    (epoch,) = [e for e in result.events() if e["event"] == "epoch"]  # a checkpoint event follows it now
    assert start["world"] == 4 and start["global_batch"] == 8
    assert start["adapter"]["stages"] == 4 and sum(start["adapter"]["balance"]) == 6
    assert start["adapter"]["untied"] == ["5.weight <- 0.wte.weight"]
    assert len(epoch["ranks"]) == 4 and epoch["val"]["val/perplexity"] < 256
    losses = result.losses()
    assert len(losses) == 6 and None not in losses
    mlflow = tracking.client(repro.tracking_uri)
    run = mlflow.search_runs([tracking.experiment_id(mlflow, tracking.DEFAULT_EXPERIMENT)])[0]
    logged = [m.value for m in sorted(mlflow.get_metric_history(run.info.run_id, names.TRAIN_LOSS), key=lambda m: m.step)]
    assert logged == pytest.approx(losses)
    assert json.loads(run.data.params["adapter.balance"]) == start["adapter"]["balance"]
