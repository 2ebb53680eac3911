"""The paper's successors: FSDP2, PyTorch's pipeline schedules and AxoNN.

FSDP must train exactly as DDP does, and every pipeline schedule exactly as sequential training
on the same global batch (one process); the memory accounting must count what each rank holds.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from references import STEPS, gpt2, plain_gpt2
from repro import registry
from repro.adapters import torch_pipeline_plan
from repro.adapters.torch_pipeline import balance, layer_weights, stage_starts
from repro.recipe import Recipe, load_file, recipe_path
from repro.schema import RecipeError

TOLERANCE = 1e-5
TIED_EMBEDDING_BYTES = 256 * 64 * 4  # GPT-2 smoke: byte vocabulary x d_model, fp32


def smoke(framework: str, *overrides: str) -> Recipe:
    return load_file(recipe_path("gpt2", "smoke"), [f"run.framework={framework}", *overrides])


def meta_model(recipe: Recipe) -> nn.Sequential:
    """The workload's layers on the meta device (no memory), as the adapter weighs them."""
    with torch.device("meta"):
        return registry.workload_class(recipe.workload)(recipe.model, recipe.data, None).build_model()


def state_bytes(epoch: dict, kind: str) -> list[int]:
    return [rank[kind] for rank in epoch["ranks"]]


# -- recipes and partitioning (no processes) ---------------------------------------------------
@pytest.mark.units
def test_balance_minimises_the_heaviest_stage() -> None:
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balance([4, 0, 1, 1], 3) == [1, 2, 1]  # [1, 1, 2] is as heavy, but its middle stage has no parameters
    model = meta_model(smoke("torch-pipeline"))
    # embedding 20,480 | four blocks of 49,984 | head 16,512 (64 for its norm's, 16,384 tied)
    assert layer_weights(model) == [20480, 49984, 49984, 49984, 49984, 16512]
    assert balance(layer_weights(model), 4) == [2, 1, 1, 2]


@pytest.mark.units
def test_fsdp_wraps_a_unit_per_block_and_leaves_the_tied_layers_to_the_root() -> None:
    """VGG-16: its five convolution stages (2, 2, 3, 3, 3 convolutions) and its three linear layers, 8
    units where a unit per layer made 16; GPT-2: its four transformer blocks, the tied embedding and
    head left to the root unit (FSDP2 requires a shared parameter to live in one unit)."""
    from repro.adapters.fsdp import units

    for workload, expected in (("vgg16", [["Conv2d"] * 2] * 2 + [["Conv2d"] * 3] * 3 + [["Linear"]] * 3),
                               ("gpt2", [["Block"]] * 4)):
        recipe = load_file(recipe_path(workload, "smoke"), ["run.framework=fsdp"])
        model = meta_model(recipe)
        blocks = registry.workload_class(workload)(recipe.model, recipe.data, None).blocks(model)
        assert sorted(index for block in blocks for index in block) == list(range(len(model)))
        assert [[type(layer).__name__ for layer in unit] for unit in units(model, blocks)] == expected


@pytest.mark.units
@pytest.mark.parametrize("workload", ["gpt2", "vgg16"])
def test_the_plan_finds_the_splits_the_adapter_finds(workload: str) -> None:
    """The plan checks a split without torch, from the workload's shape: its layers have parameters
    where the model's do (GPT-2's head: only its norm's, the tied weight counted with the embedding)
    and may begin a stage where the model's may, so the same splits exist."""
    recipe = load_file(recipe_path(workload, "smoke"), ["run.framework=torch-pipeline"])
    model = meta_model(recipe)
    weights, starts = torch_pipeline_plan.layers(recipe)
    assert [bool(w) for w in weights] == [bool(w) for w in layer_weights(model)]
    assert starts == stage_starts(model)
    if workload == "gpt2":
        assert weights[-1] == layer_weights(model)[-1] - TIED_EMBEDDING_BYTES // 4 == 128


@pytest.mark.units
def test_no_stage_begins_with_an_in_place_layer() -> None:
    recipe = load_file(recipe_path("vgg16", "smoke"), ["run.framework=torch-pipeline", "run.gpus=4"])
    model = meta_model(recipe)
    sizes = balance(layer_weights(model), 4, stage_starts(model))
    firsts = [sum(sizes[:s]) for s in range(4)]
    assert not any(getattr(model[first], "inplace", False) for first in firsts)
    assert stage_starts(model)[:3] == [True, False, True]  # conv, ReLU(inplace=True), conv
    with pytest.raises(RecipeError, match="not beginning with an in-place layer"):
        load_file(recipe_path("vgg16", "smoke"), ["run.framework=torch-pipeline", "run.gpus=2", f"torch_pipeline.balance=[1,{len(model) - 1}]"])


@pytest.mark.units
def test_train_micro_batch_sets_the_schedules_micro_batch_size_for_plan_and_model_alike() -> None:
    """train.micro_batch samples each: the global batch of 8 x 2 in 4 micro-batches, as torch_pipeline.microbatches=4
    would cut it, so one recipe file holds the size at every GPU count; the model (pipelines.schedule_microbatches)
    counts the same, and predicts the same activations as the count would. Setting both is refused."""
    from repro.model import costs, pipelines

    sized, counted = smoke("torch-pipeline", "run.gpus=2", "train.micro_batch=4"), smoke("torch-pipeline", "run.gpus=2", "torch_pipeline.microbatches=4")
    plan = registry.plan_class("torch-pipeline")
    assert torch_pipeline_plan.microbatches(sized) == 4 and plan.effective(sized)["micro_batches"] == 4
    assert plan.effective(sized)["global_batch"] == 16
    assert pipelines.schedule_microbatches(costs.cell_of(sized)) == 4
    assert costs.predict(costs.cell_of(sized)).activations == costs.predict(costs.cell_of(counted)).activations
    assert torch_pipeline_plan.microbatches(smoke("torch-pipeline", "run.gpus=4", "train.micro_batch=2")) == 16
    with pytest.raises(RecipeError, match=r"torch_pipeline.microbatches: set either torch_pipeline.microbatches \(4 a step\) "
                                          r"or train.micro_batch \(4 samples each\), not both"):
        smoke("torch-pipeline", "run.gpus=2", "train.micro_batch=4", "torch_pipeline.microbatches=4")


@pytest.mark.units
def test_pipeline_recipe_errors_print_the_arithmetic() -> None:
    with pytest.raises(RecipeError, match=r"4 GPUs x 2 stages per rank = 8 stages, but the model has only 6 layers with parameters"):
        smoke("torch-pipeline", "run.gpus=4", "torch_pipeline.schedule=interleaved-1f1b")
    with pytest.raises(RecipeError, match=r"global batch \(16\) must split into 3 equal microbatches: 16 % 3 = 1"):
        smoke("torch-pipeline", "run.gpus=2", "torch_pipeline.microbatches=3")
    with pytest.raises(RecipeError, match=r"1f1b needs at least one microbatch per stage: 2 < 4 stages"):
        smoke("torch-pipeline", "run.gpus=4", "torch_pipeline.microbatches=2")
    with pytest.raises(RecipeError, match=r"torch_pipeline.balance: needs 2 layer counts summing to 6"):
        smoke("torch-pipeline", "run.gpus=2", "torch_pipeline.balance=[3,2]")
    assert smoke("torch-pipeline", "run.gpus=4").options().schedule == "1f1b"


@pytest.mark.units
def test_fsdp_recipe_checks_hybrid_replicas_and_takes_fp16() -> None:
    with pytest.raises(RecipeError, match=r"fsdp.replicas: .* 6 % 4 = 2"):
        smoke("fsdp", "run.gpus=6", "fsdp.sharding=hybrid", "fsdp.replicas=4")
    assert smoke("fsdp", "train.precision=fp16").train.precision == "fp16"  # loss-scaled (issue 39)
    assert smoke("fsdp", "run.gpus=4", "fsdp.sharding=hybrid").options().replicas == 2


@pytest.mark.units
def test_list_and_run_give_axonns_reason(repro) -> None:
    listed = repro.here("list")
    assert listed.returncode == 0
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line.startswith("  ")}
    assert lines["fsdp"].endswith(" available") and lines["torch-pipeline"].endswith(" available")
    assert "unavailable" in lines["axonn"] and "needs CUDA GPUs and NCCL" in lines["axonn"]
    out = repro.here("run", "gpt2", "--framework", "axonn", "--dry-run")
    assert out.returncode == 2
    assert "run.framework: axonn 0.2.0 needs CUDA GPUs and NCCL" in out.stderr
    assert "Traceback" not in out.stderr


# -- training equivalence (the ranks tier: tests/references.py's parity recipes) -------------------
@pytest.mark.ranks
def test_fsdp_equals_ddp_and_holds_half_the_state(references) -> None:
    fsdp, ddp = references.losses(gpt2("fsdp", 2)), references.losses(gpt2("ddp", 2))
    assert len(fsdp) == len(ddp) == STEPS
    assert max(abs(a - b) for a, b in zip(fsdp, ddp)) < TOLERANCE
    assert fsdp[-1] < fsdp[0]
    fsdp_epoch, ddp_epoch = references.epoch(gpt2("fsdp", 2)), references.epoch(gpt2("ddp", 2))
    assert fsdp_epoch["val"]["val/loss"] == pytest.approx(ddp_epoch["val"]["val/loss"], abs=TOLERANCE)
    # every dimension splits evenly in two here; DDP's gradient count also holds its reducer buckets
    # (a second copy of every gradient), so FSDP's gradient shard is half of one fp32 copy: half the parameters.
    # Adam's two moments (2 x 4 bytes a parameter) are sharded; its step counters (one fp32 per parameter
    # tensor) are not: every rank keeps them all.
    whole = {kind: state_bytes(ddp_epoch, kind)[0] for kind in ("parameters", "gradients", "optimizer")}
    assert whole["gradients"] == 2 * whole["parameters"]
    steps = whole["optimizer"] - 2 * whole["parameters"]
    recipe = gpt2("ddp", 2)
    assert steps == 4 * len(list(registry.workload_class("gpt2")(recipe.model, recipe.data, None).build_model().parameters()))
    for kind, share in (("parameters", whole["parameters"]), ("gradients", whole["parameters"]),
                        ("optimizer", whole["optimizer"] + steps)):
        assert state_bytes(fsdp_epoch, kind) == [share // 2, share // 2], kind


@pytest.mark.ranks
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
def test_pipeline_schedule_equals_sequential_training(references, schedule) -> None:
    """Two stages against one process on the same global batch (the pipeline's, in 4 micro-batches)."""
    recipe = gpt2("torch-pipeline", 2, f"torch_pipeline.schedule={schedule}")
    pipe, one = references.losses(recipe), references.losses(plain_gpt2())
    assert len(pipe) == len(one) == STEPS
    assert max(abs(a - b) for a, b in zip(pipe, one)) < TOLERANCE
    out, sequential = references.epoch(recipe), references.epoch(plain_gpt2())
    assert out["val"]["val/loss"] == pytest.approx(sequential["val"]["val/loss"], abs=TOLERANCE)
    # the stages hold the whole model between them, plus the head's copy of the tied embedding
    whole = state_bytes(sequential, "parameters")[0]
    assert sum(state_bytes(out, "parameters")) == whole + TIED_EMBEDDING_BYTES
