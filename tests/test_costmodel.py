"""The cost model (repro.model.costs) against the counters: model state, activations and communication.

Units: the torch-free shapes (repro.shapes) equal the built modules tensor for tensor, and the model
imports no torch. Ranks: GPT-2 smoke (and VGG-16 where its layers differ) under every modelled
framework at 2 and 4 processes on gloo (1 where it differs), the real training loop in ranks forked
by the tests' warm launcher, each run's counted figures (epoch event) against the model, within the
bounds of costs.BOUNDS; a different ZeRO bucket or tp degree moves both sides. End to end: one
cell as a real `repro run`.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import ranks
from conftest import NO_DEEPSPEED_FP16, REPO, Repro
from repro import events, names
from repro.activation import Counter as ActivationCounter
from repro.adapters.recompute import checkpoint_blocks
from repro.flops import FlopCounter
from repro.hardware import cpu_computes_fp16
from repro.model import costs, flops, time
from repro.adapters.torch_pipeline import stage_starts
from repro.model.predict import Fit
from repro.model.terms import Cell
from repro.recipe import Recipe, load_file, recipe_path, resolve
from repro.runfiles import RUN_FILE
from repro.shapes import GPT2Shape, VGG16Shape, parameters, tensors
from repro.warm import fork_server
from repro.warm import plan as warm_plan
from repro.workloads.gpt2 import GPT2Spec, build_gpt2
from repro.workloads.vgg16 import VGG16Spec, build_vgg16


@pytest.mark.units
@pytest.mark.parametrize("spec", [GPT2Spec(4, 64, 4, 64, "bytes", 0.0), GPT2Spec()], ids=["smoke", "medium"])
def test_gpt2_shape_matches_the_built_module_tensor_for_tensor(spec):
    with torch.device("meta"):
        model = build_gpt2(spec)
    shape = GPT2Shape.from_model(spec)
    assert tensors(shape) == [p.numel() for p in model.parameters()]
    assert [rows for layer, repeat in shape.shaped_runs() for _ in range(repeat) for rows in layer] == [
        (p.shape[0], p[0].numel()) for p in model.parameters()]
    assert [sum(layer) for layer in shape.layer_tensors()] == [
        sum(p.numel() for p in layer.parameters(recurse=True) if p is not model[0].wte.weight or index == 0)
        for index, layer in enumerate(model)]
    assert shape.output_elements(2) == layer_outputs(model, torch.zeros(2, spec.seq_len, dtype=torch.long, device="meta"))
    assert shape.stage_starts() == stage_starts(model)
    if spec.n_layer == 24:
        assert parameters(shape) == 354_823_168  # GPT-2-medium, published


@pytest.mark.units
@pytest.mark.parametrize("spec,classes", [(VGG16Spec(8, 128, 1, 32, 0.0), 10), (VGG16Spec(), 1000)], ids=["smoke", "paper"])
def test_vgg16_shape_matches_the_built_module_layer_for_layer(spec, classes):
    with torch.device("meta"):
        model = build_vgg16(spec, classes)
    shape = VGG16Shape.from_model(spec, "digits" if classes == 10 else "imagenet")
    assert shape.layer_tensors() == [[p.numel() for p in layer.parameters()] for layer in model]
    assert shape.shaped_layers() == [[(p.shape[0], p[0].numel()) for p in layer.parameters()] for layer in model]
    assert shape.output_elements(2) == layer_outputs(model, torch.zeros(2, 3, spec.image_size, spec.image_size, device="meta"))
    assert shape.stage_starts() == stage_starts(model)
    if classes == 1000:
        assert parameters(shape) == 138_357_544  # torchvision's vgg16


# shapes no recipe uses: GPT-2 with 5 heads of 8 over 24 tokens, VGG-16 at other widths
OTHER_GPT2, OTHER_VGG16 = GPT2Spec(3, 40, 5, 24, "bytes", 0.0), VGG16Spec(16, 96, 1, 32, 0.0)


@pytest.mark.units
@pytest.mark.parametrize("spec,batch,recomputed", [
    (OTHER_GPT2, 3, 0), (OTHER_GPT2, 3, 2), (dataclasses.replace(OTHER_GPT2, dropout=0.1), 3, 1), (OTHER_VGG16, 5, 0),
    (OTHER_VGG16, 5, 3)], ids=["gpt2", "gpt2-recompute", "gpt2-dropout-recompute", "vgg16", "vgg16-recompute"])
def test_a_steps_counted_flops_equal_the_model_on_shapes_no_recipe_uses(spec, batch, recomputed):
    if isinstance(spec, GPT2Spec):  # on CPU, attention with dropout takes SDPA's math path
        model = build_gpt2(spec)
        shape = dataclasses.replace(GPT2Shape.from_model(spec), math_attention=True)
        inputs = targets = torch.randint(0, shape.vocab, (batch, spec.seq_len))
    else:
        model, shape = build_vgg16(spec, 10), VGG16Shape.from_model(spec, "digits")
        inputs, targets = torch.randn(batch, 3, spec.image_size, spec.image_size), torch.randint(0, 10, (batch,))
    counter = FlopCounter()
    checkpoint_blocks(model, shape.blocks()[:recomputed], ActivationCounter(), counter)
    with counter.counting():
        output = model(inputs)
        torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1)).backward()
    modelled = flops.step_flops(Cell(shape, "ddp", 1, batch, recomputed=recomputed))
    assert counter.per_step() == {"forward": modelled.forward, "backward": modelled.backward, "recompute": modelled.recompute}
    assert modelled.recompute > 0 if recomputed else modelled.recompute == 0


def layer_outputs(model: torch.nn.Sequential, inputs: torch.Tensor) -> list[int]:
    """Elements of each layer's output (a pipeline's activation across a cut after it)."""
    sizes = []
    for layer in model:
        inputs = layer(inputs)
        sizes.append(inputs.numel())
    return sizes


@pytest.mark.units
def test_the_cost_model_imports_no_torch():
    code = "import sys, repro.model.costs; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.units
def test_ring_wire_bytes():
    assert costs.wire_bytes("all_reduce", 1000, 4) == 1500
    assert costs.wire_bytes("all_gather", 250, 4) == 750
    assert costs.wire_bytes("all_reduce", 1000, 1) == 0


# -- measured against modelled ----------------------------------------------------------------------
BF16 = "train.precision=bf16"
# (framework, processes, --set overrides[, workload]): every modelled framework at 2 and 4 processes, and
# one change of a ZeRO bucket and of a tp degree at the same process count
CELLS = {
    "ddp-2": ("ddp", 2, []), "ddp-4": ("ddp", 4, []),
    "zero-2": ("zero", 2, []), "zero-4": ("zero", 4, []),
    "zero-4-bucket": ("zero", 4, ["zero.reduce_bucket_size=7000"]),
    "zero1-2": ("zero", 2, ["zero.stage=1"]), "zero1-4": ("zero", 4, ["zero.stage=1"]),
    "zero3-1": ("zero", 1, ["zero.stage=3"]), "zero3-2": ("zero", 2, ["zero.stage=3"]),
    "zero3-4": ("zero", 4, ["zero.stage=3"]), "zero3-4-vgg16": ("zero", 4, ["zero.stage=3"], "vgg16"),
    "megatron-1": ("megatron", 1, []), "megatron-tp2-2": ("megatron", 2, ["megatron.tp=2"]),
    "megatron-tp2-4": ("megatron", 4, ["megatron.tp=2"]), "megatron-tp4-4": ("megatron", 4, ["megatron.tp=4"]),
    # torchgpipe: one process whatever the partitions; checkpointed micro-batches recomputed in backward
    "torchgpipe-1": ("torchgpipe", 1, []), "torchgpipe-2": ("torchgpipe", 2, []), "torchgpipe-4": ("torchgpipe", 4, []),
    # FSDP2: nothing sent at 1; the LAMB norms of sharded tensors; dim-0 padding (VGG-16's 10-class
    # head on 4 ranks); grad-op gathers once; hybrid adds the replicas' all-reduce
    "fsdp-1": ("fsdp", 1, []), "fsdp-2": ("fsdp", 2, []), "fsdp-4": ("fsdp", 4, []),
    "fsdp-4-vgg16": ("fsdp", 4, [], "vgg16"), "fsdp-4-grad-op": ("fsdp", 4, ["fsdp.sharding=grad-op"]),
    "fsdp-4-hybrid": ("fsdp", 4, ["fsdp.sharding=hybrid"]),
    # the pipelines: point-to-point at each cut, the tied weight's copy (VGG-16: cuts of other widths);
    # the interleaved schedules hold two stages a rank (8 stages: more than GPT-2 smoke's 6 layers with
    # parameters, so VGG-16 at 4), zero bubble its input-only backwards' graphs
    "torch-pipeline-1": ("torch-pipeline", 1, []), "torch-pipeline-2": ("torch-pipeline", 2, []),
    "torch-pipeline-4": ("torch-pipeline", 4, []), "torch-pipeline-4-vgg16": ("torch-pipeline", 4, [], "vgg16"),
    "torch-pipeline-2-interleaved": ("torch-pipeline", 2, ["torch_pipeline.schedule=interleaved-1f1b"]),
    "torch-pipeline-2-zero-bubble": ("torch-pipeline", 2, ["torch_pipeline.schedule=zero-bubble"]),
    "torch-pipeline-4-vgg16-interleaved": ("torch-pipeline", 4, ["torch_pipeline.schedule=interleaved-1f1b"], "vgg16"),
    "torch-pipeline-4-vgg16-zero-bubble": ("torch-pipeline", 4, ["torch_pipeline.schedule=zero-bubble"], "vgg16"),
    "pipedream-2": ("pipedream", 2, []), "pipedream-4": ("pipedream", 4, []),
    "pipedream-4-vgg16": ("pipedream", 4, [], "vgg16"), "torchgpipe-4-vgg16": ("torchgpipe", 4, [], "vgg16"),
    # torchgpipe's balance by time changes from run to run; this one starts partitions at an in-place ReLU
    # (whose output is the received input's storage), a convolution and a max-pool
    "torchgpipe-4-vgg16-cuts": ("torchgpipe", 4, ["torchgpipe.balance=[6,8,9,17]"], "vgg16"),
    # the memory settings (issue 39): full recompute (every block, or the first two) keeps the blocks' inputs
    # and recomputes one block at a time in backward; micro-batches hold one micro-batch's activations but the
    # whole batch's input and targets (views of it); torchgpipe recomputes every micro-batch, the last too
    "ddp-2-recompute": ("ddp", 2, ["train.recompute=full"]), "ddp-2-micro": ("ddp", 2, ["train.micro_batch=2"]),
    "ddp-2-recompute2-micro": ("ddp", 2, ["train.recompute=full", "train.recompute_layers=2", "train.micro_batch=4"]),
    "ddp-2-vgg16-recompute-micro": ("ddp", 2, ["train.recompute=full", "train.micro_batch=4"], "vgg16"),
    # with dropout, CPU attention runs SDPA's math path, which keeps its probabilities (GPT2Shape.math_attention)
    "ddp-2-dropout-recompute-micro": ("ddp", 2, ["model.dropout=0.1", "train.recompute=full", "train.micro_batch=2"]),
    "torchgpipe-2-always": ("torchgpipe", 2, ["torchgpipe.checkpoint=always"]),
    # ZeRO: stage 1 reduces once at the accumulation boundary; stage 2 every micro-batch, keeping the partition's
    # accumulated gradients beside; stage 3 gathers and reduces every micro-batch
    "zero-2-micro": ("zero", 2, ["train.micro_batch=2"]), "zero-2-recompute": ("zero", 2, ["train.recompute=full"]),
    "zero1-2-micro": ("zero", 2, ["zero.stage=1", "train.micro_batch=2"]),
    "zero3-2-micro": ("zero", 2, ["zero.stage=3", "train.micro_batch=2"]),
    "zero-4-micro": ("zero", 4, ["train.micro_batch=4"]), "zero3-2-recompute": ("zero", 2, ["zero.stage=3", "train.recompute=full"]),
    # FSDP2: the recomputation gathers nothing more; each micro-batch gathers again, and between them every
    # whole gradient is held (gradient sync off); grad-op gathers once per micro-batch
    "fsdp-2-recompute": ("fsdp", 2, ["train.recompute=full"]), "fsdp-2-micro": ("fsdp", 2, ["train.micro_batch=2"]),
    "fsdp-4-grad-op-recompute2-micro": ("fsdp", 4, ["fsdp.sharding=grad-op", "train.recompute=full",
                                                    "train.recompute_layers=2", "train.micro_batch=4"]),
    # Megatron: micro-batches through megatron-core's schedule; at tp=1 the embedding saves the token ids, a
    # view of the whole batch
    "megatron-1-micro": ("megatron", 1, ["train.micro_batch=2"]),
    "megatron-tp2-4-micro": ("megatron", 4, ["megatron.tp=2", "train.micro_batch=4"]),
    # megatron-core's recompute: selective drops attention's core, recomputed layer by layer in backward; full
    # keeps each recomputed layer's input (the block method: the first 2 of 4 layers)
    "megatron-tp2-2-selective": ("megatron", 2, ["megatron.tp=2", "train.recompute=selective"]),
    "megatron-tp2-2-selective-dropout": ("megatron", 2, ["megatron.tp=2", "train.recompute=selective", "model.dropout=0.1"]),
    "megatron-1-full": ("megatron", 1, ["train.recompute=full"]),
    "megatron-tp2-2-full2-micro": ("megatron", 2, ["megatron.tp=2", "train.recompute=full", "train.recompute_layers=2",
                                                   "train.micro_batch=2"]),
    "fsdp-2-vgg16-recompute-micro": ("fsdp", 2, ["train.recompute=full", "train.micro_batch=4"], "vgg16"),
    # fp16 (issue 39): DeepSpeed's own fp16 mode keeps the module, its gradients and their reductions in fp16
    # (2 bytes an element; costs.deepspeed_element), the master partition and Adam's moments in fp32
    "zero-2-fp16": ("zero", 2, ["train.precision=fp16"]), "zero3-2-fp16": ("zero", 2, ["zero.stage=3", "train.precision=fp16"]),
    # 16-bit (issue 39): DDP and ZeRO under torch.autocast (fp32 residual stream and layer norms, the weights'
    # 16-bit copies; ZeRO reduces the linear layers' gradients in 16 bits, in a bucket of their own), FSDP with
    # bf16 parameters (no autocast); a shape no other cell has, with recompute and micro-batches
    "ddp-2-bf16": ("ddp", 2, [BF16]), "zero-2-bf16": ("zero", 2, [BF16]), "fsdp-2-bf16": ("fsdp", 2, [BF16]),
    "zero1-2-bf16-micro": ("zero", 2, [BF16, "zero.stage=1", "train.micro_batch=2"]),
    "ddp-2-vgg16-bf16": ("ddp", 2, [BF16], "vgg16"), "zero-2-vgg16-bf16": ("zero", 2, [BF16], "vgg16"),
    "fsdp-2-vgg16-bf16": ("fsdp", 2, [BF16], "vgg16"),
    "ddp-2-bf16-odd-shape": ("ddp", 2, [BF16, "model.n_layer=3", "model.d_model=96", "model.n_head=6", "model.seq_len=32",
                                        "train.recompute=full", "train.recompute_layers=2", "train.micro_batch=4"]),
    "ddp-2-vgg16-bf16-recompute-micro": ("ddp", 2, [BF16, "train.recompute=full", "train.micro_batch=4"], "vgg16"),
    # torch-pipeline: one autocast context around the schedule, whose cached weight copies serve every micro-batch;
    # GPT-2's cuts carry the fp32 residual stream, VGG-16's 16-bit outputs
    "torch-pipeline-2-bf16": ("torch-pipeline", 2, [BF16]),
    "torch-pipeline-2-bf16-interleaved": ("torch-pipeline", 2, [BF16, "torch_pipeline.schedule=interleaved-1f1b"]),
    "torch-pipeline-4-vgg16-bf16": ("torch-pipeline", 4, [BF16], "vgg16"),
    "torch-pipeline-4-vgg16-bf16-zero-bubble": ("torch-pipeline", 4, [BF16, "torch_pipeline.schedule=zero-bubble"], "vgg16"),
    # shapes no recipe uses (issue 40: FLOPs, and the bytes with them): GPT-2 with 5 heads of 8 over 24 tokens,
    # VGG-16 at half the smoke widths, cut into pipeline stages
    "zero-2-other-shape": ("zero", 2, ["model.n_layer=3", "model.d_model=40", "model.n_head=5", "model.seq_len=24"]),
    "torch-pipeline-2-vgg16-other-widths": ("torch-pipeline", 2, ["model.width_div=16", "model.classifier_width=96"], "vgg16"),
}
# One cell runs as users run it (`repro run`: pre-flight, launcher, MLflow); the others' point is the
# counts, so their ranks are forked by the tests' warm launcher (tests/ranks.py) on the same recipe.
REAL_RUN = "ddp-2"
# The communication counter counts the last warm-up step (the 5th), the activation counter the steps
# before it; PipeDream's first stage of 4 holds its steady S - s = 4 weight versions from its 7th forward on
STEPS, PIPEDREAM_STEPS = 5, 8
VALIDATION = "data.max_val_samples=8"  # the epoch's end validates; the counts do not depend on it
LAUNCH_TIMEOUT_S = 1500  # DeepSpeed JIT-builds its CPU collectives (shm_comm) on first use: minutes on 2 loaded cores


def cell_recipe(name: str) -> Recipe:
    """The recipe `repro run WORKLOAD --framework F --gpus N --scale smoke --max-steps S --set ...` resolves."""
    framework, gpus, sets, *workload = CELLS[name]
    steps = PIPEDREAM_STEPS if framework == "pipedream" else STEPS
    fields = [f"run.framework={framework}", f"run.gpus={gpus}", f"train.max_steps={steps}", VALIDATION, *sets]
    return load_file(recipe_path(workload[0] if workload else "gpt2", "smoke"), fields)


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """name -> (prediction, measured, comparison rows), one run per cell, shared by the module's tests;
    "folder": where the forked cells' run folders go. The fork server of the forked ranks imports every
    cell's frameworks once (where this module is the first to start it)."""
    fork_server.preload(warm_plan.preload(cell_recipe(name) for name in CELLS if name != REAL_RUN))
    return {"folder": tmp_path_factory.mktemp("cells")}


def check(shared_repro: Repro, cache: dict, name: str) -> tuple:
    if name not in cache:
        recipe = cell_recipe(name)
        if name == REAL_RUN:
            framework, gpus, sets, *workload = CELLS[name]
            args = [arg for value in [VALIDATION, *sets] for arg in ("--set", value)]
            result = shared_repro("run", *(workload or ["gpt2"]), "--framework", framework, "--gpus", str(gpus),
                                  "--scale", "smoke", "--max-steps", str(recipe.train.max_steps), *args, timeout=LAUNCH_TIMEOUT_S)
            assert result.returncode == 0, result.stderr[-3000:]
            written = result.events()
            spec = json.loads((result.run_dir / RUN_FILE).read_text())
            recipe = resolve(spec["recipe"], spec["recipe"]["source"])  # what the command resolved and ran
        else:
            written = ranks.train(recipe, cache["folder"] / name)
        (start,) = [e for e in written if e["event"] == events.START]
        # the counters keep their high-water marks from epoch to epoch: the last epoch event holds them all
        # (VGG-16's 4-GPU epochs are shorter than PipeDream's steps: two epoch events)
        epoch = [e for e in written if e["event"] == events.EPOCH][-1]
        cell = costs.cell_of(recipe, start["adapter"])
        prediction = costs.predict(cell)
        measured = costs.measured_of(epoch["ranks"])
        cache[name] = (prediction, measured, costs.compare(prediction, measured, flops.process_flops(cell)))
    return cache[name]


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.end_to_end if name == REAL_RUN else pytest.mark.ranks)
                                  for name in CELLS])
def test_measured_equals_the_model_within_its_bounds(shared_repro, checked, name):
    if CELLS[name][0] == "zero" and "train.precision=fp16" in CELLS[name][2] and not cpu_computes_fp16():
        pytest.skip(NO_DEEPSPEED_FP16)
    prediction, measured, rows = check(shared_repro, checked, name)
    assert measured["comm"] is not None and measured["comm_kinds"] == prediction.comm
    # model state, activations (data parallelism: the whole model's; Megatron: a tp shard's at the tp
    # group's batch; the pipelines: a stage's in flight), communication and FLOPs by phase (forward,
    # backward, recompute: exact), every one counted and modelled
    assert [row["within"] for row in rows] == [True] * 6, rows


@pytest.mark.ranks
def test_zero_issues_the_gradient_all_reduces_the_time_model_counts(shared_repro, checked):
    """The step-time model charges ZeRO-1/2 one call a flush of DeepSpeed's bucket (repro.model.time.zero_flushes)
    and the gradient norm's: what the counter counted, at 2 and 4 ranks, a smaller bucket, stage 1 and
    micro-batches (stage 2 reduces in each pass's backward)."""
    for name in ("zero-2", "zero-4", "zero-4-bucket", "zero1-2", "zero-2-micro", "zero1-2-micro"):
        _, measured, _ = check(shared_repro, checked, name)
        cell = costs.cell_of(cell_recipe(name))
        assert measured["comm_calls"]["all_reduce"] == time.zero_flushes(cell) + 1, name


@pytest.mark.ranks
def test_a_bucket_size_and_a_tp_degree_move_both_sides(shared_repro, checked):
    zero, rebucketed = (check(shared_repro, checked, name) for name in ("zero-4", "zero-4-bucket"))
    assert zero[0].model_state != rebucketed[0].model_state and zero[1]["model_state"] != rebucketed[1]["model_state"]
    tp2, tp4 = (check(shared_repro, checked, name) for name in ("megatron-tp2-4", "megatron-tp4-4"))
    assert tp2[0].model_state != tp4[0].model_state and tp2[1]["model_state"] != tp4[1]["model_state"]
    assert tp2[0].comm_bytes != tp4[0].comm_bytes and tp2[1]["comm"] != tp4[1]["comm"]
    assert tp2[0].activations != tp4[0].activations and tp2[1]["activations"] != tp4[1]["activations"]


# -- every run checks itself (issue 39) ----------------------------------------------------------------
# A shape of a user's own (2 blocks, d_model 48, 6 heads, 40 tokens), the first block recomputed, 2 micro-batches a rank
OWN_SHAPE = ["model.n_layer=2", "model.d_model=48", "model.n_head=6", "model.seq_len=40", "train.recompute=full",
             "train.recompute_layers=1", "train.micro_batch=2", VALIDATION]


@pytest.mark.end_to_end
def test_a_run_checks_the_model_against_its_own_counters_and_says_so(repro, monkeypatch):
    """`repro run` of that shape ends with the model check's line, and its MLflow run holds the model's
    figures (those of the recipe it ran) and their errors, within the bounds. The same run's check with a
    model 25% off in activations says so, past the bound; a framework without a model says why."""
    from repro.model import check
    from repro.run.follower import self_check
    from repro.runfiles import Outcome, RunFolder
    from repro.tracking import client

    result = repro("run", "gpt2", "--framework", "ddp", "--gpus", "2", "--scale", "smoke", "--max-steps", str(STEPS),
                   *[arg for value in OWN_SHAPE for arg in ("--set", value)], timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = RunFolder(result.run_dir)
    run = client(repro.tracking_uri).get_run(folder.read_spec().mlflow_run_id)
    (start,) = [e for e in result.events() if e["event"] == events.START]
    modelled = costs.predict(costs.cell_of(folder.recipe(), start["adapter"]))
    assert folder.recipe().train.micro_batch == 2 and modelled.activations > 0
    metric = lambda quantity, kind: run.data.metrics[names.MODEL_CHECK.format(quantity, kind)]
    assert [metric(q, "bytes") for q in costs.BOUNDS] == [modelled.model_state, modelled.activations, modelled.comm_bytes]
    step = flops.process_flops(costs.cell_of(folder.recipe(), start["adapter"]))
    assert [metric(q, "count") for q in costs.FLOP_BOUNDS] == [step.forward, step.backward, step.recompute]
    assert [metric(q, "error") for q in costs.FLOP_BOUNDS] == [0.0, 0.0, 0.0]
    assert run.data.metrics[names.FLOPS.format("total")] == step.counted
    errors = [metric(q, "error") for q in costs.BOUNDS]
    assert all(0 <= error <= bound for error, bound in zip(errors, costs.BOUNDS.values())), errors
    line = (f"model check: model state {errors[0]:.2%} (bound 1%), activations {errors[1]:.2%} (bound 5%), "
            f"communication {errors[2]:.2%} (bound 1%), forward FLOPs 0.00% (bound 0%), backward FLOPs 0.00% "
            "(bound 0%), recompute FLOPs 0.00% (bound 0%)")
    assert line in result.stdout.splitlines() and run.data.tags[names.MODEL_CHECK_LINE] == line

    last = {e["event"]: e for e in result.events()}
    off = dataclasses.replace(modelled, activations=modelled.activations * 5 // 4)
    monkeypatch.setattr(check.costs, "predict", lambda cell: off)
    said, outcome = [], Outcome("FINISHED")
    self_check(outcome, folder, last, said.append)
    measured = costs.measured_of(last[events.EPOCH]["ranks"])["activations"]
    error = outcome.metrics[names.MODEL_CHECK.format("activations", "error")]
    assert error == abs(measured - off.activations) / off.activations > costs.BOUNDS["activations"]
    assert f"activations {error:.2%} (bound 5%: OUT OF BOUND)" in said[0]
    monkeypatch.undo()

    spec = folder.read_spec()
    spec.recipe = load_file(recipe_path("vgg16", "smoke"), ["run.framework=lbann"]).to_dict()
    folder.write_spec(spec)
    said, outcome = [], Outcome("FINISHED")
    self_check(outcome, folder, last, said.append)
    assert said == ["model check: not modelled: no cost model for 'lbann'; modelled: ddp, zero, fsdp, megatron, "
                    "torchgpipe, torch-pipeline, pipedream"]
    assert outcome.metrics == {} and outcome.tags[names.MODEL_CHECK_LINE] == said[0]


# -- refused before launch ----------------------------------------------------------------------------
@pytest.mark.units
def test_a_run_that_cannot_fit_is_refused_before_launch_even_dry(repro):
    out = repro("run", "gpt2", "--set", "model.n_layer=100000000", "--dry-run")
    assert out.returncode == 2
    (line,) = [line for line in out.stderr.splitlines() if "memory:" in line]
    assert "predicted 289,940.8 GiB per GPU" in line and "this machine's RAM" in line and "--ignore-memory-check" in line
    assert repro("run", "gpt2", "--set", "model.n_layer=100000000", "--dry-run", "--ignore-memory-check").returncode == 0


@pytest.mark.parametrize("spec,classes,batch", [
    (VGG16Spec(8, 128, 1, 32, 0.0), 10, 16),  # the smoke recipe
    (VGG16Spec(8, 128, 1, 32, 0.5), 10, 4),  # dropout: a mask and a new output each (CPU: float masks)
    (VGG16Spec(16, 256, 7, 64, 0.5), 1000, 2),  # an average pool to 7x7 saves its input (a 1x1 one does not)
], ids=["smoke", "dropout", "pooled"])
@pytest.mark.units
def test_vgg16_activations_equal_the_counter(spec, classes, batch):
    from repro.activation import Counter

    torch.manual_seed(0)
    model, counter = build_vgg16(spec, classes), Counter()
    images, labels = torch.randn(batch, 3, spec.image_size, spec.image_size), torch.randint(classes, (batch,))
    with counter.hooks():
        loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
    loss.backward()
    shape = VGG16Shape.from_model(spec, "digits" if classes == 10 else "imagenet")
    assert counter.peak_bytes == shape.activation_bytes(batch, 4, mask=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec,batch", [
    (GPT2Spec(4, 64, 4, 64, "bytes", 0.0), 8),  # the smoke recipe
    (GPT2Spec(3, 96, 6, 32, "bytes", 0.0), 5),  # a shape no recipe has
    (VGG16Spec(8, 128, 1, 32, 0.0), 16),
    (VGG16Spec(16, 256, 7, 64, 0.5), 2),  # dropout on 16-bit outputs (CPU: 16-bit masks), a pooled classifier input
], ids=["gpt2-smoke", "gpt2-odd", "vgg16-smoke", "vgg16-pooled-dropout"])
@pytest.mark.units
def test_autocast_activations_equal_the_counter(spec, batch, dtype):
    """Under torch.autocast (16-bit compute over fp32 weights, as DDP and ZeRO run bf16 and fp16) the model's
    activations equal the counter to the byte: GPT-2's fp32 residual stream and layer norms, attention's fp32
    log-sum-exp, every matmul weight's 16-bit copy; the same byte widths for bf16 and fp16."""
    from repro.activation import Counter

    torch.manual_seed(0)
    gpt2 = isinstance(spec, GPT2Spec)
    model, counter = build_gpt2(spec) if gpt2 else build_vgg16(spec, 1000), Counter()
    if gpt2:
        inputs, targets = (torch.randint(spec.vocab_size, (batch, spec.seq_len)) for _ in range(2))
    else:
        inputs, targets = torch.randn(batch, 3, spec.image_size, spec.image_size), torch.randint(1000, (batch,))
    with counter.hooks(), torch.autocast("cpu", dtype=dtype):
        output = model(inputs)
        loss = torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]).float(), targets.reshape(-1))
    loss.backward()
    shape = GPT2Shape.from_model(spec) if gpt2 else VGG16Shape.from_model(spec, "imagenet")
    assert counter.peak_bytes == shape.activation_bytes(batch, 2, mask=2, autocast=True)
    assert counter.peak_bytes > shape.activation_bytes(batch, 2, mask=2) * 1.1  # what the model held before: 10-20% short


@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
@pytest.mark.units
def test_vgg16_stage_activations_equal_the_counter_stage_by_stage(inplace):
    """Every stage of two splits of the smoke VGG-16, each run on its own as a pipeline runs it: the first
    on the images, the others on a received tensor; out of place as torchgpipe and PipeDream make ReLU
    (repro.adapters.pipeline.disable_inplace), whose cuts may fall before a ReLU."""
    from repro.activation import Counter
    from repro.adapters.pipeline import disable_inplace

    spec, batch = VGG16Spec(8, 128, 1, 32, 0.0), 4
    torch.manual_seed(0)
    model, shape = build_vgg16(spec, 10), VGG16Shape.from_model(spec, "digits")
    if not inplace:
        disable_inplace(model)
    splits = ([19, 4, 5, 12], [5, 12, 14, 9]) if inplace else ([19, 4, 5, 12], [7, 7, 10, 16], [1, 1, 3, 35])
    for sizes in splits:
        start = 0
        for size in sizes:
            stage, counter = model[start : start + size], Counter()
            inputs = torch.randn(batch, 3, 32, 32) if start == 0 else torch.randn(
                batch, *layer_shape(model[:start], batch), requires_grad=True)
            with counter.hooks():
                out = stage(inputs)
                if start + size == len(model):
                    out = torch.nn.functional.cross_entropy(out, torch.randint(10, (batch,)))
            assert counter.peak_bytes == shape.stage_activation_bytes(start, start + size, batch), (sizes, start)
            start += size


def layer_shape(layers: torch.nn.Sequential, batch: int) -> tuple[int, ...]:
    with torch.device("meta"):
        return tuple(layers(torch.zeros(batch, 3, 32, 32)).shape[1:])


@pytest.mark.parametrize("ranks_,micro", [(2, 4), (2, 2), (4, 8), (4, 4), (4, 12)])
@pytest.mark.parametrize("zero_bubble", [False, True], ids=["interleaved-1f1b", "zero-bubble"])
@pytest.mark.units
def test_the_interleaved_schedules_order_is_torchs(ranks_, micro, zero_bubble):
    """The model's order of each rank's compute actions (pipelines.looped_actions) is the one
    torch's schedule computes for it (bubbles left out)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    from repro.model.pipelines import looped_actions

    schedule = schedules.ScheduleInterleavedZeroBubble if zero_bubble else schedules.ScheduleInterleaved1F1B
    rounds = max(1, micro // ranks_)
    plan = SimpleNamespace(n_local_stages=2, pp_group_size=ranks_, _n_microbatches=micro,
                           number_of_rounds=rounds, microbatches_per_round=micro // rounds)
    for rank in range(ranks_):
        theirs = [(a.computation_type.value, a.stage_index) for a in schedule._calculate_single_rank_operations(plan, rank) if a]
        assert theirs == looped_actions(rank, ranks_, 2, micro, zero_bubble), rank  # F, B, I, W: torch's letters


@pytest.mark.units
def test_predict_prints_both_workloads_at_paper_scale_without_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "repro.cli", "predict", "--gpu-memory", "V100=16GiB"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported
    lines = out.stdout.splitlines()
    assert all(any(line.startswith(f"{w}, paper scale") for line in lines) for w in ("gpt2", "vgg16"))
    gpt2 = lines[next(i for i, line in enumerate(lines) if line.startswith("gpt2")):]
    ddp64 = next(line.split() for line in gpt2 if line.split()[:2] == ["ddp", "64"])
    shape = GPT2Shape(24, 1024, 16, 1024, 50257, 0.1)  # the recipe's DDP: every block recomputed, micro-batches of 8
    cell = costs.Cell(shape, "ddp", 64, 32, "lamb", "bf16", {"weight_decay": 0.01}, micro_batch=8, recomputed=24)
    medium = costs.predict(cell)
    assert ddp64[2:6] == [f"{medium.model_state / 2**30:.2f}", f"{medium.activations / 2**30:.2f}",
                          f"{medium.transient / 2**30:.2f}", f"{medium.estimated_peak / 2**30:.2f}"] == [
        "6.61", "2.43", "3.07", "12.11"] and ddp64[-1] == "V100"
    # the loss's backward: two fp32 gradients of a micro-batch of 8 x 1024 tokens x the vocabulary
    assert medium.transient == 2 * 4 * 8 * 1024 * 50257
    assert ddp64[7] == f"{flops.step_flops(cell).total / 1e9:.0f}"  # about 8 x parameters x tokens (recompute), plus attention
    from repro.model.predict import memory_minimum, predict_row

    intra = {g: predict_row("gpt2", "megatron-intra", g) for g in (1, 2, 4, 8, 16, 32, 64)}
    lowest, shape = memory_minimum({g: p.estimated_peak for g, p in intra.items() if p})
    assert f"megatron-intra's peak per GPU is lowest at {lowest} GPU{'s' if lowest > 1 else ''} ({shape})" in map(str.strip, lines)


@pytest.mark.units
def test_paper_scale_rows_say_whether_the_papers_gpus_hold_them():
    """Table 2's GPUs (per node / GPUs per node) against GPT-2-medium's predicted peaks under the recipe:
    PipeDream's 34.89 GiB at 16 GPUs (fp32, every activation kept: it applies no memory setting) fits an
    A100 40 GB, not a V100 16 GB, and says why; at 1 GPU (62.58 GiB) it fits neither, almost all of it
    activations; Megatron-intra at 8 GPUs (Megatron-LM's example: every layer recomputed, micro-batches of 4)
    and the 1F1B pipeline at 16 GPUs (micro-batches of 4 sequences) fit both."""
    from repro.hardware import GPU_MEMORY_GIB, paper_gpu_memory
    from repro.model.predict import paper_fit, predict_row

    assert paper_gpu_memory() == {"V100-16GB": 16.0, "A100-40GB": 40.0}
    assert {name: GPU_MEMORY_GIB[name] for name in paper_gpu_memory()} == paper_gpu_memory()
    ddp, over, intra, pipe = (predict_row("gpt2", row, g) for row, g in (
        ("pipedream", 16), ("pipedream", 1), ("megatron-intra", 8), ("torch-1f1b", 16)))
    assert round(ddp.estimated_peak / 2**30, 2) == 34.89 and round(intra.estimated_peak / 2**20) == 3_176
    assert paper_fit(ddp.estimated_peak, ddp.model_state) == (
        "over the paper's V100-16GB: its runs there cannot have held this much; activations dominate "
        "(88.8% activations, 11.2% model state)")
    assert paper_fit(over.estimated_peak, over.model_state) == (
        "over the paper's V100-16GB and A100-40GB: its runs there cannot have held this much; activations dominate "
        "(89.4% activations, 10.6% model state)")
    assert paper_fit(intra.estimated_peak, intra.model_state) == "fits the paper's V100-16GB and A100-40GB"
    assert paper_fit(pipe.estimated_peak, pipe.model_state) == "fits the paper's V100-16GB and A100-40GB"
    assert round(pipe.estimated_peak / 2**30, 2) == 5.39  # fp32 (configs/gpt2-paper.yaml), 128 micro-batches of 4
    assert paper_fit(20 * 2**30, 15 * 2**30).endswith("model state dominate (25.0% activations, 75.0% model state)")
    out = subprocess.run([sys.executable, "-m", "repro.cli", "predict", "--model", "gpt2"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert next(line for line in out if line.startswith("    pipedream at 1-16 GPUs, most at 1 (62.58 GiB)")).endswith(
        "why: train.recompute and train.micro_batch refused: PipeDream has no such mechanism: each stage keeps every "
        "in-flight mini-batch's activations for its backward against the stashed weights, and a mini-batch is one step "
        "(no accumulation)")
    assert not any(line.startswith(("    ddp at", "    zero at", "    fsdp at", "    megatron")) for line in out)  # their settings fit a V100
    assert not any(line.startswith("    torch-1f1b at") for line in out)  # fp32, micro-batches of 4: the V100


@pytest.mark.units
def test_the_model_gives_the_counted_model_state_of_docs_and_the_issue():
    """Counted before the model existed: docs/memory.md's GPT-2 smoke table (Adam, 4 ranks, bucket 20,000) and
    issue 29's bytes per parameter (ZeRO-2 on VGG-16 smoke: 12.83 at 2 ranks, 9.12 at 4; DDP with LAMB 20.0)."""
    gpt2 = GPT2Shape(4, 64, 4, 64, 256)
    bucket = {"reduce_bucket_size": 20_000}
    assert costs.predict(costs.Cell(gpt2, "zero", 4, 8, "adam", options=bucket)).model_state == 1_905_416
    assert costs.predict(costs.Cell(gpt2, "ddp", 4, 8, "adam")).model_state == 4_411_088
    assert costs.predict(costs.Cell(gpt2, "ddp", 2, 8, "lamb")).model_state == 20 * 220_544
    vgg = VGG16Shape(8, 128, 1, 32, 10)
    per_param = [costs.predict(costs.Cell(vgg, "zero", n, 16, "adam", options={"reduce_bucket_size": 25_000}))
                 .model_state / parameters(vgg) for n in (2, 4)]
    assert [round(x, 2) for x in per_param] == [12.83, 9.12]


@pytest.mark.units
def test_the_pipelines_memory_plateau_is_quoted_as_the_models_prediction():
    from repro.model.predict import predict_row
    from repro.report.evidence import Results
    from repro.report.model_check import paper_predictor
    from repro.report.predicted import pipeline_memory_predicted

    res = Results([], 2, predict=paper_predictor([]))
    res.workloads = ["gpt2"]
    torchgpipe, pipedream = pipeline_memory_predicted(res, {"rows": ["torchgpipe", "pipedream"], "plateau_ratio": 1.3})
    assert "no memory prediction" in torchgpipe  # its activations are modelled on CPU stand-ins only
    peaks = [predict_row("gpt2", "pipedream", g).estimated_peak for g in (1, 2, 4)]
    assert peaks[0] / peaks[1] > 1.3 > peaks[1] / peaks[2]  # the model's own figures: a fall, then a flat step
    assert "plateaus from 4 GPUs" in pipedream and f"2 GPUs {peaks[1] / 2**20:.2f} MiB" in pipedream


@pytest.mark.units
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatrons_layer_is_korthikantis_in_16_bit_with_dropout_plus_what_the_local_spec_adds(tp):
    """Korthikanti et al. 2022: s b h (10 + 24 / tp + 5 a s / (h tp)) bytes per layer in 16-bit with dropout
    (1-byte masks: CUDA). The local spec adds the fp32 softmax output (2 a s^2 b / tp bytes more than the
    paper's 16-bit one) and the layer norms' fp32 statistics (16 s b); docs/memory.md, "Megatron"."""
    s, h, a, b = 128, 64, 4, 2 * tp  # b: the tp group's sequences, 2 per GPU

    def layers(n: int) -> int:
        cell = costs.Cell(GPT2Shape(n, h, a, s, 256, 0.1), "megatron", tp, 2, precision="bf16", options={"tp": tp})
        return costs.megatron_activations(cell, tp)

    layer = layers(2) - layers(1)
    assert layer == s * b * h * (10 + 24 // tp) + 5 * a * s * s * b // tp + 2 * a * s * s * b // tp + 16 * s * b


@pytest.mark.units
def test_megatron_activations_are_the_local_specs_only(monkeypatch):
    """On GPUs the adapter uses Transformer Engine's layers where installed (repro.adapters.megatron.layer_spec_name):
    no activation prediction there; the CPU always runs the local spec."""
    cell = costs.Cell(GPT2Shape(4, 64, 4, 64, 256, 0.0), "megatron", 2, 8, options={"tp": 2})
    assert costs.predict(cell).activations == costs.megatron_activations(cell, 2)
    monkeypatch.setattr(costs.importlib.util, "find_spec", lambda name: object() if name == "transformer_engine" else None)
    assert costs.predict(cell).activations is None
    assert costs.predict(dataclasses.replace(cell, device="cpu")).activations == costs.megatron_activations(cell, 2)


@pytest.mark.units
def test_megatron_intras_memory_minimum_is_quoted_as_the_models_prediction():
    from repro.model.predict import predict, predict_row
    from repro.report.evidence import Results
    from repro.report.model_check import paper_predictor
    from repro.report.predicted import megatron_memory_predicted

    res = Results([], 2, predict=paper_predictor([]))
    res.workloads = ["gpt2", "vgg16"]
    gpt2, vgg16 = megatron_memory_predicted(res, {"row": "megatron-intra"})
    # under Megatron-LM's example (every layer recomputed, micro-batches of 4) model state falls with tp faster
    # than the tp group's growing batch adds activations up to 4 GPUs, slower beyond: the paper's U
    peaks = {g: predict_row("gpt2", "megatron-intra", g).estimated_peak for g in (1, 2, 4, 8, 16)}
    assert peaks[1] > peaks[2] > peaks[4] < peaks[8] < peaks[16]
    assert "(every block recomputed, micro-batches of 4), memory per GPU lowest at 4 GPUs (a U; local layer spec)" in gpt2
    assert f"16 GPUs {peaks[16] / 2**20:.2f} MiB" in gpt2 and round(peaks[4] / 2**20, 2) == 3002.01
    assert ("from 1 to 16 GPUs model state x0.07 (5414.17 MiB -> 355.54 MiB), activations x4.20 (998.59 MiB -> "
            "4194.57 MiB)") in gpt2
    assert "predicted by the cost model" in gpt2 and "not modelled for this workload" in vgg16
    # every activation kept (the recipe without its settings), the peak only rises: no U
    kept = [predict("gpt2", "megatron", g, sets=[f"megatron.tp={g}", *UNSET]).estimated_peak for g in (1, 2, 4, 8, 16)]
    assert kept == sorted(kept) and round(kept[-1] / 2**30, 2) == 231.19


# -- repro predict --fit and the setting a refusal names (issue 39) --------------------------------------
GIB = 2**30


def paper_peak(workload: str, framework: str, gpus: int, *sets: str) -> int:
    """The model's peak per GPU for a paper recipe with `sets` applied, through the recipe (load_file,
    cell_of) rather than predict --fit's own path (predict.recipe_cell), on the GPU predict takes (its
    capability decides train.precision auto: fp16 on the V100)."""
    from repro.hardware import capability_of
    from repro.model.predict import PREDICTED_GPU

    recipe = load_file(recipe_path(workload, "paper"), [f"run.framework={framework}", f"run.gpus={gpus}", *sets])
    return costs.predict(costs.cell_of(recipe, capability=capability_of(PREDICTED_GPU))).fit_bytes


def fits(workload: str, size_gib: float) -> dict[tuple[str, int], Fit]:
    """predict --fit's choice for every cell of `workload` at paper scale, by (row, GPUs)."""
    from repro.model.predict import matrix_fits

    return {(entry["row"], entry["gpus"]): entry["fit"] for entry in matrix_fits(workload, size_gib * GIB)}


# the paper recipe without its frameworks' own memory settings (train_by_framework): where fit's search starts
UNSET = ("train.recompute=null", "train.micro_batch=null")


def unset_fit(framework: str, gpus: int, size_gib: float) -> Fit:
    """predict --fit's choice for GPT-2 at paper scale from the recipe without memory settings (UNSET)."""
    from repro.model.predict import fit, recipe_cell

    return fit(recipe_cell("gpt2", framework, gpus, sets=UNSET), size_gib * GIB)


# Paper cells off the V100-16GB under the recipes' settings: the smallest of the paper's GPUs each fits (None:
# neither), all of them rows whose framework applies no memory setting (configs/*-paper.yaml say why)
OFF_V100 = {
    "vgg16": {("pipedream", 4): "A100-40GB", ("pipedream", 8): "A100-40GB", ("pipedream", 16): "A100-40GB"},
    "gpt2": {("pipedream", 1): None, ("pipedream", 2): None, ("pipedream", 4): None, ("pipedream", 8): None,
             ("pipedream", 16): "A100-40GB"},
}


@pytest.mark.units
@pytest.mark.parametrize("workload", ["gpt2", "vgg16"])
def test_every_paper_cell_fits_the_v100_or_says_why_not(workload):
    """Under configs/*-paper.yaml's own settings (train_by_framework) every modelled cell of the matrix fits
    the paper's V100-16GB, except OFF_V100's, whose frameworks apply no memory setting: each says so, and
    fits the A100-40GB or neither as listed. None is off the V100 for want of a setting its framework has."""
    from repro.model.predict import paper_devices

    entries = paper_devices(workload)
    assert len(entries) >= 30
    off = {(e["row"], e["gpus"]): e for e in entries if e["device"] != "V100-16GB"}
    assert {cell: e["device"] for cell, e in off.items()} == OFF_V100[workload]
    for entry in off.values():
        assert entry["fit"].peak is None and entry["why"].startswith("train.recompute and train.micro_batch refused: ")
    assert all(not e["why"] and e["fit"].sets == () for e in entries if e["device"] == "V100-16GB")


@pytest.mark.units
def test_fit_chooses_micro_batches_before_recompute_with_the_models_peak_for_the_recipe_with_it():
    """GPT-2-medium at paper scale on a V100-16GB: DDP fits with micro-batches of 4 (8 does not), and full
    recompute alone would not (the loss's logits and their two fp32 gradients, 18 GiB at 32 sequences, are not
    recomputed); ZeRO-2 at 1 GPU needs 4 too, its accumulated partition (4 Psi bytes more with k > 1) pushing 8
    over. On an A100-40GB DDP needs micro-batches of 16; all from the recipe without memory settings (UNSET)."""
    for gpus in (1, 64):
        chosen = unset_fit("ddp", gpus, 16)
        assert chosen.sets == ("train.micro_batch=4",) and chosen.setting() == "--set train.micro_batch=4"
        assert chosen.peak == paper_peak("gpt2", "ddp", gpus, *UNSET, "train.micro_batch=4")
        assert round(chosen.peak / GIB, 2) == 13.17 and round(chosen.as_written / GIB, 2) == 54.45
    assert paper_peak("gpt2", "ddp", 1, *UNSET, "train.micro_batch=8") > 16 * GIB
    assert paper_peak("gpt2", "ddp", 1, *UNSET, "train.recompute=full") > 16 * GIB
    zero = unset_fit("zero", 1, 16)
    assert zero.sets == ("train.micro_batch=4",) and zero.peak == paper_peak("gpt2", "zero", 1, *UNSET, "train.micro_batch=4")
    assert paper_peak("gpt2", "zero", 1, *UNSET, "train.micro_batch=8") > 16 * GIB
    a100 = unset_fit("ddp", 1, 40)
    assert a100.sets == ("train.micro_batch=16",) and a100.peak == paper_peak("gpt2", "ddp", 1, *UNSET, "train.micro_batch=16")


@pytest.mark.units
def test_fit_recomputes_the_fewest_blocks_and_says_why_a_cell_cannot_fit():
    """At 8 GiB DDP needs micro-batches of 1 and 14 of GPT-2-medium's 24 blocks recomputed (13 do not fit);
    ZeRO-2 at 1 GPU (fp16 on the V100) does not fit 6 GiB even with all of it, and says its smallest peak; Megatron and PipeDream
    apply no memory setting and say why, torch's 1F1B does not fit even with micro-batches of 1 sequence, while Megatron fits by recomputing 14
    of its 24 layers (the block method) at micro-batches of 1, at 7 GiB."""
    small = fits("gpt2", 7)
    ddp = unset_fit("ddp", 1, 8)
    sets = ("train.recompute=full", "train.recompute_layers=14", "train.micro_batch=1")
    assert ddp.sets == sets and ddp.peak == paper_peak("gpt2", "ddp", 1, *UNSET, *sets) <= 8 * GIB
    assert paper_peak("gpt2", "ddp", 1, *UNSET, "train.recompute=full", "train.recompute_layers=13",
                      "train.micro_batch=1") > 8 * GIB
    assert fits("gpt2", 8)[("ddp", 1)].sets == sets  # the same from the recipe's own settings (every block, micro-batches of 8)
    zero = unset_fit("zero", 1, 6)
    smallest = paper_peak("gpt2", "zero", 1, *UNSET, "train.recompute=full", "train.micro_batch=1")
    assert zero.peak is None and zero.why_not == (
        f"over even with --set train.recompute=full --set train.micro_batch=1: {smallest / GIB:.2f} GiB")
    assert smallest > 6 * GIB
    megatron, pipedream, schedule = unset_fit("megatron", 1, 7), small[("pipedream", 2)], small[("torch-1f1b", 1)]
    sets = ("train.recompute=full", "train.recompute_layers=14", "train.micro_batch=1")
    assert megatron.sets == sets and megatron.peak == paper_peak("gpt2", "megatron", 1, *UNSET, *sets) <= 7 * GIB
    assert small[("megatron-data", 1)].sets == () and small[("megatron-data", 1)].peak == paper_peak("gpt2", "megatron", 1)
    smallest = paper_peak("gpt2", "torch-pipeline", 1, "train.micro_batch=1")
    assert schedule.peak is None and schedule.why_not == f"over even with --set train.micro_batch=1: {smallest / GIB:.2f} GiB"
    assert smallest > 7 * GIB
    assert pipedream.why_not.startswith("train.recompute and train.micro_batch refused: PipeDream has no such mechanism")


@pytest.mark.units
@pytest.mark.parametrize("workload", ["gpt2", "vgg16"])
def test_fits_bisection_finds_what_the_whole_search_finds(workload):
    """fit bisects the number of recomputed blocks, assuming the peak falls as more are recomputed: on the
    paper shapes, at sizes from tight to loose, it chooses what trying every setting in order chooses."""
    from repro import registry
    from repro.model.predict import fit, micro_batches, overrides, recipe_cell

    for framework in ("ddp", "zero", "fsdp", *(("megatron",) if workload == "gpt2" else ())):
        cell = recipe_cell(workload, framework, 2, sets=[*UNSET, *(["megatron.tp=2"] if framework == "megatron" else [])])
        every = [dataclasses.replace(cell, recomputed=n, micro_batch=m) for n in range(len(cell.shape.blocks()) + 1)
                 for m in micro_batches(cell, registry.plan_class(framework))]
        peaks = [costs.predict(candidate).fit_bytes for candidate in every]
        for size in sorted(set(peaks))[:: max(1, len(set(peaks)) // 12)]:
            first = next(candidate for candidate, peak in zip(every, peaks) if peak <= size)
            chosen = fit(cell, size)
            assert (chosen.sets, chosen.peak) == (overrides(cell, first), costs.predict(first).fit_bytes), (framework, size)


@pytest.mark.units
def test_fit_undoes_what_the_recipe_already_sets():
    """From a recipe that recomputes 2 blocks at micro-batches of 16, the chosen --set list, applied on top
    of it, gives the chosen peak: the overrides are relative to the recipe, not to the paper's."""
    from repro.model.predict import fit

    written = ("train.recompute=full", "train.recompute_layers=2", "train.micro_batch=16")
    recipe = load_file(recipe_path("gpt2", "paper"), ["run.framework=ddp", "run.gpus=1", *written])
    chosen = fit(costs.cell_of(recipe), 16 * GIB)
    assert chosen.sets == ("train.recompute=none", "train.recompute_layers=null", "train.micro_batch=4")
    assert chosen.peak == paper_peak("gpt2", "ddp", 1, *written, *chosen.sets)


@pytest.mark.units
def test_predict_fit_prints_each_cells_setting_and_how_many_fit_without_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "repro.cli", "predict", "--model", "gpt2",
                          "--fit", "V100-16GB"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "torch" not in {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    lines = out.stdout.splitlines()
    assert lines[0].startswith("gpt2, paper scale, fitted to V100-16GB (16 GiB)")
    peak = paper_peak("gpt2", "ddp", 8)  # the recipe's own settings fit
    assert round(peak / GIB, 2) == 12.11 and f"  {'ddp':<16}{8:>5}{peak / GIB:>9.2f}{peak / GIB:>9.2f}  as written" in lines
    megatron = paper_peak("gpt2", "megatron", 1)  # Megatron-LM's example: every layer recomputed, micro-batches of 4
    assert round(megatron / GIB, 2) == 6.26 and f"  {'megatron-data':<16}{1:>5}{megatron / GIB:>9.2f}{megatron / GIB:>9.2f}  as written" in lines
    chosen = fits("gpt2", 16)
    fitted = sum(f.peak is not None for f in chosen.values())
    torchgpipe = sum(row == "torchgpipe" for row, _ in chosen)  # fits by model state: its GPU activations are not modelled
    assert lines[-1] == (f"  {fitted} of {len(chosen)} cells fit V100-16GB: {sum(f.peak is not None and not f.sets for f in chosen.values())} "
                         f"as written, {sum(bool(f.sets) for f in chosen.values())} with a setting; {torchgpipe} of them by model state alone")
    bad = subprocess.run([sys.executable, "-m", "repro.cli", "predict", "--fit", "V100"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "--fit: 'V100' is not [NAME=]SIZE in GiB" in bad.stderr and "V100-16GB" in bad.stderr


@pytest.mark.units
@pytest.mark.parametrize("device", ["V100-16GB", "A100-40GB"])
def test_docs_quote_predict_fit_as_it_prints(device):
    """docs/memory.md ("Fitting a device") quotes predict --fit for GPT-2 at paper scale verbatim: a change
    to the model or the search that moves a figure must move the quote too."""
    command = f"$ repro predict --model gpt2 --fit {device}\n"
    docs = (REPO / "docs" / "memory.md").read_text()
    quoted = docs[docs.index(command) + len(command):].split("```", 1)[0]
    out = subprocess.run([sys.executable, "-m", "repro.cli", "predict", "--model", "gpt2", "--fit", device], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert quoted == out
