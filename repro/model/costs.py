"""The cost model: bytes a GPU holds (model state, activations) and hands to communication per step,
per framework, in closed form from the workload's shape (repro.shapes). No torch: `repro predict` and
the pre-launch check use it before anything starts.

Every term cites its derivation: docs/memory.md (model state term by term, as read from the tensors
DDP, DeepSpeed and the optimizers allocate; activations per GPT-2 layer, from PyTorch's autograd
formulas) and docs/memory.md's "Communication" section (payloads per operation, from each framework's
source). No term copies a measured number: `tests/test_costmodel.py` and `reports/model_check.*` hold
the model against the counters (repro.metrics.model_state, repro.activation, repro.communication).

Sizes are in bytes. Weights, gradients and optimizer state are fp32 under every precision the kit uses
(autocast keeps fp32 weights), so model state depends on precision only through ZeRO's buckets
(`autocast_reduction`); activations in 16-bit precision use 2-byte elements (bf16 and fp16 alike) where
autocast computes in 16 bits and fp32 where it does not (repro.model.terms.autocasts; docs/memory.md,
"16-bit activations"), counted on CPU; Megatron's own bf16 is unchecked until a GPU run.

Communication is the payload a rank hands to its process group per step, per kind of operation (what
repro.communication counts). What a ring moves on the wire follows from it (`wire_bytes`).

Here: the data-parallel and tensor-parallel models, and the front (`predict`, `compare`); the pipelines'
models are in repro.model.pipelines, the terms all share (Cell, Prediction) in repro.model.terms.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import TYPE_CHECKING, Any

from repro.hardware import automatic_precision
from repro.model.pipelines import busiest, pipedream, torch_pipeline, torchgpipe
from repro.names import FLOP_PHASES
from repro.model.terms import (
    ACTIVATION_ELEMENT, FP32, Cell, Prediction, activations, autocasts, loss_transient, optimizer_bytes,
)
from repro.shapes import INT64, GPT2Shape, VGG16Shape, dim0_sharded, flat_sharded, parameters, shape_of, tensor_at, tensor_count

if TYPE_CHECKING:  # repro.model.flops builds on this module's sharding terms
    from repro.model.flops import StepFlops

DEEPSPEED_ALIGNMENT = 2  # deepspeed/runtime/zero/stage_1_and_2.py: nccl_start_alignment_factor (x dp size)
# the checked bounds (issue 29): model state and communication exact to 1%, activations to 5%
BOUNDS = {"model_state": 0.01, "activations": 0.05, "comm": 0.01}
# FLOPs by phase (repro.model.flops, issue 40): the counter applies the model's formulas to the real
# step's operations, so they are held exact
FLOP_BOUNDS = {f"flops_{phase}": 0.0 for phase in FLOP_PHASES}


def ddp(cell: Cell) -> Prediction:
    """DDP (docs/memory.md, "DDP"): every rank keeps the weights, `.grad` and the reducer's flat buckets
    (another copy of every gradient: `gradient_as_bucket_view` off), and the whole optimizer state; each
    step it all-reduces every bucket, the whole gradient once (torch/csrc/distributed/c10d/reducer.cpp),
    one process too (its group of one moves nothing on the wire: `wire_bytes`)."""
    psi, count = parameters(cell.shape), tensor_count(cell.shape)
    comm = {"all_reduce": FP32 * psi}
    return Prediction(FP32 * psi, 2 * FP32 * psi, optimizer_bytes(cell, psi, count),
                      activations(cell, cell.batch_per_gpu), comm)


def zero_partition(psi: int, ranks: int) -> int:
    """Elements of one rank's partition: the flat buffer padded to DEEPSPEED_ALIGNMENT x ranks."""
    alignment = DEEPSPEED_ALIGNMENT * ranks
    return math.ceil(psi / alignment) * alignment // ranks


def zero(cell: Cell) -> Prediction:
    """DeepSpeed ZeRO, stages 1-2 (docs/memory.md's table; Rajbhandari et al. 2020, section 5); stage 3:
    `zero3`.

    Parameters: the padded flat buffer of the whole model.
    Optimizer: an fp32 master copy of the partition and the optimizer's state of it, plus Adam's one
    `step` tensor (ZeRO's inner optimizer steps one flat tensor per group).
    Gradients: stage 1 every `.grad` plus one reduction bucket; stage 2 the partition and one bucket,
    plus the whole gradient of each parameter that straddles the rank's partition edge (DeepSpeed keeps
    such a parameter's gradient whole; the busiest rank counts), plus the gradient that completes last in
    backward when it is larger than the bucket (`held_whole`), plus one fp32 scalar the ZeRO
    optimizer holds at the end of backward (seen among its tensors, not identified further).
    Under autocast one bucket per reduction dtype, and the linear layers' gradients are reduced in 16 bits
    (`autocast_reduction`).
    Communication (DeepSpeed's `average_tensor`/`reduce_ipg_grads`; stage 1 reduces the same buckets,
    its contiguous-gradient hooks on): every gradient bucket is reduced (on gloo the reduce-scatter runs
    as an all-reduce of the bucket: the whole gradient), the gradient norm is all-reduced (one fp32),
    and the updated partitions are all-gathered (each rank hands its partition): what DDP moves, as the
    ZeRO paper says of stages 1-2. With one process DeepSpeed still all-reduces the buckets and the norm
    (counted at stage 2: 4 Psi + 4 bytes), and gathers nothing.
    """
    stage, n, k = cell.option("stage", 2), cell.gpus, cell.accumulation_steps
    if stage == 3:
        return zero3(cell)
    psi, count = parameters(cell.shape), tensor_count(cell.shape)
    part = zero_partition(psi, n)
    bucket = min(cell.option("reduce_bucket_size", 500_000_000), psi)
    w = deepspeed_element(cell)
    reduced, buckets = autocast_reduction(cell, psi)
    grads = w * (psi if stage == 1 else part + straddling(cell.shape, part, n) + held_whole(cell.shape, bucket))
    grads += w * bucket * buckets + FP32
    if stage == 2 and k > 1:
        grads += w * (part + straddling(cell.shape, part, n))  # the accumulated gradients of the partition's parameters
    optimizer = FP32 * part + optimizer_bytes(cell, part, 1)
    comm = {"all_reduce": reduced * (k if stage == 2 else 1) + FP32 + overflow_flag(cell)}
    if n > 1:
        comm["all_gather"] = w * part
    return Prediction(w * part * n, grads, optimizer, activations(cell, cell.batch_per_gpu), comm)


def deepspeed_element(cell: Cell) -> int:
    """Bytes of a weight and a gradient element under DeepSpeed: fp16 trains in DeepSpeed's own fp16 mode
    (repro.adapters.zero: the module in fp16, gradients reduced in fp16, the fp32 master partition in
    the optimizer, as the ZeRO paper's 2 + 2 + K bytes a parameter); fp32 and bf16 (autocast) keep fp32."""
    return 2 if cell.precision == "fp16" else FP32


def overflow_flag(cell: Cell) -> int:
    """fp16's dynamic loss scale: DeepSpeed all-reduces a 1-byte overflow flag over the ranks every step
    (zero/stage_1_and_2.py and zero/stage3.py, `has_overflow`), so that all skip the step or none does."""
    return 1 if cell.precision == "fp16" else 0


def autocast_reduction(cell: Cell, psi: int) -> tuple[int, int]:
    """(bytes of every gradient as ZeRO 1-2 reduces them, reduction buckets): under DeepSpeed's torch_autocast
    (the adapter's bf16 path) the parameters of nn.Linear and nn.Conv modules reduce their gradients in the
    autocast dtype, the others in fp32 (deepspeed/runtime/torch_autocast.py, `init_autocast_params`), and
    each dtype has its own bucket of reduce_bucket_size fp32 elements (stage_1_and_2.py, `ipg_buckets`,
    `setup_buckets`)."""
    if not autocasts(cell):
        return deepspeed_element(cell) * psi, 1
    low = cell.shape.linear_elements()
    return FP32 * (psi - low) + ACTIVATION_ELEMENT[cell.precision] * low, 1 if low == psi else 2


ZERO3_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance (elements), which the adapter leaves as is


def zero3(cell: Cell) -> Prediction:
    """DeepSpeed ZeRO-3 (deepspeed/runtime/zero/stage3.py, partition_parameters.py): every parameter
    tensor flattened and partitioned, ceil(numel / N) elements a rank (`ds_tensor`; S in all).
    Parameters: S, plus the first layer's parameters whole: DeepSpeed releases a module's gathered
    parameters from a hook on its input's gradient (parameter_offload.py, PostBackwardFunctionModule),
    and the first layer's input (token ids, images) has none, so they are still gathered when backward
    ends (with one rank the count finds no second storage: the partition is the whole tensor).
    Gradients: the flat gradient partition (S), the reduction bucket (reduce_bucket_size elements,
    allocated whole: `ipg_buckets`), a 1-byte overflow flag (`inf_or_nan_tracker`) and 8 bytes of
    scalars (not identified further). Optimizer: the fp32 master partition, its state, one `step`.
    Communication: the partitions are all-gathered (S elements a rank) before the forward and, for a
    parameter whose reuse lies farther ahead in the trace than stage3_max_reuse_distance elements (2 x
    the parameters of the later layers: their forward and backward), again before the backward
    (partitioned_param_coordinator.py, `__params_to_release`); the ZeRO paper's 1.5 x DDP assumes that
    second gather for every parameter, which DeepSpeed's default distance skips below 5e8 parameters.
    Gradients are reduce-scattered per bucket, each tensor padded to a multiple of N
    (coalesced_collectives.py, `reduce_scatter_coalesced`; an all-reduce of the input on gloo), and
    the squared gradient norm is all-reduced in fp64 (zero/utils.py, `get_norm_dtype`)."""
    n = cell.gpus
    part, count = flat_sharded(cell.shape, n), tensor_count(cell.shape)
    layers = cell.shape.layer_tensors()
    w = deepspeed_element(cell)
    weights = w * (part + (sum(layers[0]) if n > 1 else 0))  # one rank: the gathered tensor is the partition
    grads = w * (part + cell.option("reduce_bucket_size", 500_000_000)) + 1 + 8
    optimizer = FP32 * part + optimizer_bytes(cell, part, 1)
    regathered, later = 0, sum(sum(layer) for layer in layers)
    for layer in layers:
        later -= sum(layer)
        if 2 * later >= ZERO3_REUSE_DISTANCE:
            regathered += sum(-(-numel // n) for numel in layer)
    k = cell.accumulation_steps  # every micro-batch gathers the partitions and reduce-scatters its gradients
    comm = {"all_reduce": k * w * n * part + 8 + overflow_flag(cell)}
    if n > 1:
        comm["all_gather"] = k * w * (part + regathered)
    return Prediction(weights, grads, optimizer, activations(cell, cell.batch_per_gpu), comm)


def held_whole(shape: GPT2Shape | VGG16Shape, bucket: int) -> int:
    """Elements of the gradient DeepSpeed still holds outside its bucket when backward ends: a gradient
    larger than the bucket is reduced on its own (stage_1_and_2.py, `extra_large_param_to_reduce`),
    and the last one to complete, the first layer's (GPT-2's token embedding, which the tied head also
    feeds), is held whole until the reduction after backward. Its largest tensor stands for it."""
    largest = max(shape.runs()[0][0], default=0)
    return largest if largest > bucket else 0


def straddling(shape: GPT2Shape | VGG16Shape, part: int, ranks: int) -> int:
    """The most elements of other ranks' partitions that one rank holds because a parameter's gradient
    crosses its partition's edges (a straddling parameter's whole gradient less the rank's own share)."""
    most = 0
    for rank in range(ranks):
        low, high, extra = rank * part, (rank + 1) * part, 0
        edges = {tensor_at(shape, low), tensor_at(shape, high - 1)}  # a tensor can straddle both edges
        for start, size in edges:
            own = max(0, min(start + size, high) - max(start, low))
            if 0 < own < size:
                extra += size - own
        most = max(most, extra)
    return most


def fsdp(cell: Cell) -> Prediction:
    """FSDP2 (`fully_shard`, docs/memory.md "FSDP2"): every parameter tensor is split along dim 0 into
    one chunk per shard rank, padded to the first (largest) chunk (torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py: `padded_sharded_param_size`); rank 0 holds the largest chunks: S elements of
    weights, of gradients (views of the reduce-scatter's output) and of each optimizer state.
    Per step: every unit is all-gathered before its forward and, resharded after it
    (`reshard_after_forward`, which the adapter passes, so the root unit too), again before its
    backward (grad-op: once), S elements of param_dtype; its gradients are reduce-scattered from the
    dim-0-padded unsharded gradients, shard x S elements of reduce_dtype (_fsdp_collectives.py:
    `foreach_reduce`; gloo runs it as an all-reduce of that input), then under hybrid sharding
    all-reduced across the replicas (S elements). With one shard rank nothing is gathered or reduced.
    Sharded parameters are DTensors, so an optimizer or clip that takes norms reduces their partial
    sums (`sharded_norms`).
    Micro-batches (k a step, gradient sync off for all but the last: repro.adapters.fsdp): every one
    gathers the units again (each backward reshards them), the gradients are reduced once; between
    micro-batches every parameter's whole gradient is held in the reduce dtype (_fsdp_param_group.py,
    `post_backward`; _fsdp_param.py, `to_accumulated_grad_if_needed`), Psi elements, no sharded gradient
    yet: the gradients' high-water mark is the larger of the two. Full recompute gathers nothing more
    (the recomputation runs after the unit's pre-backward gather: _fsdp_state.py, `_pre_forward`)."""
    sharding, gpus = cell.option("sharding", "full"), cell.gpus
    replicas = cell.option("replicas", 2) if sharding == "hybrid" else 1
    if gpus % replicas:
        raise ValueError(f"fsdp: {replicas} replicas must divide the GPUs ({gpus})")
    ranks = gpus // replicas
    held, count, k = dim0_sharded(cell.shape, ranks), tensor_count(cell.shape), cell.accumulation_steps
    reduce_element = ACTIVATION_ELEMENT[cell.option("reduce_dtype", "fp32")]
    comm: dict[str, int] = {}
    if ranks > 1:
        gathered = ACTIVATION_ELEMENT[cell.precision] * held
        comm["all_gather"] = k * gathered * (1 if sharding == "grad-op" else 2)
        reduced = reduce_element * held
        comm["all_reduce"] = ranks * reduced + (reduced if replicas > 1 else 0) + FP32 * sharded_norms(cell, count)[0]
    grads = max(FP32 * held, reduce_element * parameters(cell.shape)) if k > 1 else FP32 * held
    return Prediction(FP32 * held, grads, optimizer_bytes(cell, held, count), activations(cell, cell.batch_per_gpu), comm)


def sharded_norms(cell: Cell, count: int) -> tuple[int, int]:
    """(fp32 elements, all-reduces) a step that complete the norms of `count` sharded (DTensor) tensors: a
    norm of a dim-0 shard is a partial result (DTensor's `_NormPartial`), reduced where it is used, one
    all-reduce a use. timm's Lamb (timm/optim/lamb.py) takes the global gradient norm of the stacked
    per-tensor norms (`_get_clip_grad_norm`, max_grad_norm 1.0 by default: count elements, one call) and,
    with weight decay, per-tensor trust ratios from the weights' and the updates' norms, each used in two
    operations (`_lamb_trust_ratio`: w / g, w > 0, g > 0: 4 count elements, one call each); gradient
    clipping (`clip_grad_norm_`) the stacked gradient norms once more (count, one call). GPT-2 smoke under
    FSDP2, Lamb with weight decay, 52 tensors: 209 all-reduces, as counted (docs/measurement.md, "Where an
    FSDP2 step's time goes")."""
    elements, calls = (count, 1) if cell.option("grad_clip", None) else (0, 0)
    if cell.optimizer == "lamb":
        trust_ratios = 4 * count if cell.option("weight_decay", 0.0) else 0
        elements, calls = elements + count + trust_ratios, calls + 1 + trust_ratios
    return elements, calls


def megatron_elements(shape: GPT2Shape, tp: int) -> int:
    """Parameter elements one tensor-parallel rank holds (Shoeybi et al. 2019, section 3): the token
    embedding (tied to the head) split by vocabulary rows; attention's QKV and the MLP's first linear
    split by columns (weights and biases), their output projections by rows (biases and layer norms
    whole on every rank); position embedding and final layer norm whole."""
    d = shape.d_model
    layer = 4 * d + (3 * d * d + 3 * d) // tp + d * d // tp + d + (4 * d * d + 4 * d) // tp + 4 * d * d // tp + d
    rows = -(-shape.vocab // tp)  # the vocabulary padded to a multiple of tp (repro.adapters.megatron_model.padded_vocab)
    return rows * d + shape.seq_len * d + shape.n_layer * layer + 2 * d


def megatron(cell: Cell) -> Prediction:
    """Megatron (tp x dp): model state of the rank's shard; per step, with tp > 1, the Megatron-LM
    all-reduces of the tp group's activations (Shoeybi et al. 2019, Figure 3: f and g), each of
    tokens x d fp32 elements: two per layer in forward and two in backward, the vocabulary-parallel
    embedding's output in forward and the head's input gradient in backward, and the vocabulary-
    parallel cross entropy's three of one fp32 per token (maximum, target logit, sum of exponentials),
    which it all-reduces over a tp group of one too (counted at tp=1: 3 x 4 bytes a token); with dp > 1 one flattened all-reduce of the shard's gradients (repro.adapters.megatron). The tp ranks
    of a group share its samples: batch_per_gpu x tp sequences (the paper's batch rule)."""
    if not isinstance(cell.shape, GPT2Shape):
        raise KeyError("megatron applies to gpt2 only")
    tp = cell.option("tp", 1)
    if cell.shape.n_head % tp or cell.gpus % tp:
        raise ValueError(f"megatron: tp {tp} must divide the heads ({cell.shape.n_head}) and the GPUs ({cell.gpus})")
    psi, count = megatron_elements(cell.shape, tp), tensor_count(cell.shape)
    reduced = sum(megatron_reduced(cell))
    # on GPUs the adapter takes Transformer Engine's fused layers where installed: their activations are not modelled
    local = cell.device == "cpu" or importlib.util.find_spec("transformer_engine") is None
    return Prediction(FP32 * psi, FP32 * psi, optimizer_bytes(cell, psi, count),
                      megatron_activations(cell, tp) if local else None, {"all_reduce": reduced})


def megatron_reduced(cell: Cell) -> tuple[int, int]:
    """(bytes all-reduced over the tensor-parallel group, over the data-parallel group) per step: the
    terms of `megatron`'s payload, apart because they cross different links (repro.model.time)."""
    tp = cell.option("tp", 1)
    tokens = cell.batch_per_gpu * tp * cell.shape.seq_len
    within = FP32 * 3 * tokens
    if tp > 1:  # full recompute runs each recomputed layer's forward, and its two all-reduces, again
        within += FP32 * tokens * cell.shape.d_model * (4 * cell.shape.n_layer + 2 + 2 * cell.recomputed)
        within += FP32 if cell.option("grad_clip", None) else 0
    across = FP32 * megatron_elements(cell.shape, tp) if cell.gpus // tp > 1 else 0
    return within, across


def megatron_activations(cell: Cell, tp: int) -> int:
    """Bytes a tp rank saves for backward in megatron-core's GPTModel, local layer spec (docs/memory.md,
    "Megatron"), at b = batch_per_gpu x tp sequences (the tp group's samples), N = b s tokens, element
    e, dropout masks of `mask` bytes. Per layer (Korthikanti et al. 2022's count, fp32 and unfused):
    replicated on every tp rank, the two layer norms' inputs and outputs (4 N h e; the outputs are what
    linear_qkv and linear_fc1 save: tensor_parallel/layers.py, LinearWithGradAccumulationAndAsync-
    Communication) and their fp32 mean and rstd (4 N x 4, which the paper leaves out); split over tp, the
    q, k, v views of linear_qkv's one output (3 N h / tp: dot_product_attention.py, baddbmm and bmm),
    linear_proj's input (N h / tp), the biased fc1 output GELU saves and GELU's output linear_fc2 saves
    (8 N h / tp: mlp.py, bias_activation_fusion off); the attention probabilities, b (a / tp) s^2
    elements (fusions/fused_softmax.py, forward_torch_softmax: the softmax saves its fp32 output, and in
    16-bit bmm saves the cast copy too). With dropout: attention dropout's mask and output, and the
    two hidden dropouts' masks (fused_bias_dropout.py): the paper's 5 a s / h and 10 + 24 / tp in 16-bit.
    Once per model: the causal mask (s^2 bool, masked_fill_), the embedding's token ids (int64; with tp
    > 1 the vocabulary-masked copy and its bool mask: VocabParallelEmbedding), the positions (the
    adapter's arange of seq_len), the final layer norm, the head's input, and the vocabulary-parallel
    cross entropy's fp32 softmax, target mask and int64 targets (cross_entropy.py, save_for_backward),
    plus the logits' padding mask where the vocabulary is padded to a multiple of tp.
    Micro-batches (megatron-core's schedule, one graph at a time): b = micro_batch x tp, but at tp = 1 the
    embedding saves the token ids themselves, a view of the whole batch's (with tp > 1 it saves its
    vocabulary-masked copy)."""
    shape, e = cell.shape, ACTIVATION_ELEMENT[cell.precision]
    mask = e if cell.device == "cpu" else 1
    micro = cell.micro_batch or cell.batch_per_gpu
    s, h, b = shape.seq_len, shape.d_model, micro * tp
    n, dropout, probs = b * s, shape.dropout > 0, b * (shape.n_head // tp) * s * s
    if dropout:
        attention = probs * (FP32 + mask + e)  # softmax output, dropout mask, dropped probabilities
    else:
        attention = probs * (FP32 + (e if e != FP32 else 0))  # 16-bit: bmm saves the cast probabilities
    layer = e * (4 * n * h + 12 * n * h // tp) + 2 * 2 * FP32 * n + attention + (2 * mask * n * h if dropout else 0)
    padded = -(-shape.vocab // tp) * tp
    embedding = INT64 * n + (n if tp > 1 else INT64 * s * (cell.batch_per_gpu - micro)) + INT64 * s + (mask * n * h if dropout else 0)
    head = e * 2 * n * h + 2 * FP32 * n + FP32 * n * padded // tp + n + INT64 * n + (padded // tp if padded != shape.vocab else 0)
    held = embedding + s * s  # through the whole step, the causal mask included
    if cell.selective:
        before = e * (2 * n * h + 3 * n * h // tp) + 2 * FP32 * n  # a layer's saved up to attention's core
        return megatron_selective_peak(held, layer - attention, before, attention, head, shape.n_layer)
    if cell.recomputed:
        return megatron_full_peak(held, layer, e * n * h, head, shape.n_layer, cell.recomputed)
    return held + shape.n_layer * layer + head


ATTENTION_MASK_TYPE = 4  # attention.py, _checkpointed_attention_forward: the mask type as a 1-element int32 tensor


def megatron_selective_peak(held: int, kept: int, before: int, attention: int, head: int, layers: int) -> int:
    """Selective recompute (recompute_granularity selective, core_attn: attention.py,
    `_checkpointed_attention_forward` through tensor_parallel/random.py's CheckpointFunction): the
    forward keeps each layer's set less attention's core (`kept`: the probabilities, their softmax and
    dropout, Korthikanti et al. 2022's 5 a s / h), plus the mask type the checkpoint saves; q, k and v,
    which it saves too, are linear_qkv's output, already counted. In backward the last layer's core is
    recomputed after its MLP and projection have freed theirs: everything before it, its saved up to the
    core (`before`) and the core's whole set. The peak is the larger moment."""
    kept += ATTENTION_MASK_TYPE
    return max(held + layers * kept + head, held + (layers - 1) * kept + before + ATTENTION_MASK_TYPE + attention)


def megatron_full_peak(held: int, layer: int, layer_input: int, head: int, layers: int, recomputed: int) -> int:
    """Full recompute by the block method (transformer_block.py, `_checkpointed_forward`): the first
    `recomputed` layers each run under CheckpointFunction, which keeps only the layer's input (`layer_input`
    bytes; the attention mask it saves is the causal mask, counted once); the others keep their sets. In
    backward the last recomputed layer is recomputed after the layers above it and the head have freed
    theirs: the inputs of the recomputed layers below it and its whole set, its input included. The peak
    is the larger of that moment and the forward's end."""
    forward_end = held + recomputed * layer_input + (layers - recomputed) * layer + head
    return max(forward_end, held + (recomputed - 1) * layer_input + layer)


MODELS = {"ddp": ddp, "zero": zero, "fsdp": fsdp, "megatron": megatron, "torchgpipe": torchgpipe,
          "torch-pipeline": torch_pipeline, "pipedream": pipedream}


# the frameworks whose rank runs torch's cross entropy on the whole model's output (`loss_transient`); Megatron's
# vocabulary-parallel loss computes its gradient in place of its saved softmax (tensor_parallel/cross_entropy.py),
# and a pipeline's loss is on its last stage, not always the busiest rank's: not modelled there
WHOLE_LOSS = ("ddp", "zero", "fsdp")


def predict(cell: Cell) -> Prediction:
    """The model of `cell`'s framework; KeyError naming the modelled ones when it has none."""
    if cell.framework not in MODELS:
        raise KeyError(f"no cost model for {cell.framework!r}; modelled: {', '.join(MODELS)}")
    prediction = MODELS[cell.framework](cell)
    if cell.framework in WHOLE_LOSS and prediction.activations is not None:
        return dataclasses.replace(prediction, transient=loss_transient(cell))
    return prediction


def wire_bytes(kind: str, payload: int, group: int) -> float:
    """Bytes a rank sends on the wire for `payload` handed to an operation of `kind` over `group` ranks,
    with ring algorithms (Thakur et al. 2005; NCCL's and gloo's ring): all-reduce 2 (p-1)/p of the
    payload, reduce-scatter (p-1)/p of the input, all-gather (p-1) x the handed partition,
    point-to-point the payload."""
    if group <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (group - 1) / group * payload
    if kind == "reduce_scatter":
        return (group - 1) / group * payload
    if kind == "all_gather":
        return (group - 1) * payload
    return float(payload)


def cell_of(recipe: Any, facts: dict[str, Any] | None = None, capability: int | None = None) -> Cell:
    """The model's view of a resolved recipe (repro.recipe.Recipe); `facts`: what the adapter decided at
    setup (the start event's `adapter`: torchgpipe's computed balance), where the recipe leaves it open;
    `capability`: the GPU's compute capability, which decides train.precision auto (unknown: bf16)."""
    options = recipe.options()
    section = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options or {})
    section["grad_clip"] = recipe.train.grad_clip
    optimizer = recipe.optimizer()
    section["momentum"], section["weight_decay"] = optimizer.momentum, optimizer.weight_decay
    if facts and facts.get("balance"):
        section["balance"] = facts["balance"]
    shape = shape_of(recipe.workload, recipe.model, recipe.data.dataset)
    device = "cuda" if recipe.run.device == "cuda" or (recipe.run.device == "auto" and recipe.scale == "paper") else "cpu"
    if isinstance(shape, GPT2Shape):
        shape = dataclasses.replace(shape, math_attention=device == "cpu")
    train = recipe.train
    recomputed = Cell.recomputed_blocks(shape, train.recompute, train.recompute_layers)
    precision = automatic_precision(device, capability) if train.precision == "auto" else train.precision
    return Cell(shape, recipe.run.framework, recipe.run.gpus, train.batch_per_gpu, optimizer.name,
                precision, section, device, train.micro_batch, recomputed, train.recompute == "selective")


def measured_of(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The counted figures of an epoch event's ranks, as the model states them: the busiest rank's model
    state and activation peak, and by kind the payload per step of the rank that hands over the most
    (the first such rank), as MLflow's comm/bytes_per_step counts it (repro.tracking), and the first
    rank's operations by kind."""
    comm = busiest([(rank.get("comm") or {}).get("bytes", {}) for rank in ranks])
    activations = [r["activation_peak_bytes"] for r in ranks if r.get("activation_peak_bytes") is not None]
    counted = [r["flops"] for r in ranks if r.get("flops")]
    flops = max(counted, key=lambda phases: sum(phases.values())) if counted else {}
    return {"model_state": max(r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks),
            "activations": max(activations) if activations else None,
            "comm": sum(comm.values()) if any(r.get("comm") for r in ranks) else None, "comm_kinds": comm,
            "comm_calls": (ranks[0].get("comm") or {}).get("calls", {}),
            **{f"flops_{phase}": flops.get(phase) for phase in FLOP_PHASES}}


def compare(prediction: Prediction, measured: dict[str, Any], flops: StepFlops | None = None) -> list[dict[str, Any]]:
    """One row per quantity: measured, modelled, its unit (bytes; FLOPs: count), relative error, bound and
    whether it holds (None where either side is missing: not counted, or not modelled); with `flops`
    (repro.model.flops.process_flops: what a process counts), a row per FLOP phase too (the optimizer's
    are modelled, not counted)."""
    modelled = {"model_state": prediction.model_state, "activations": prediction.activations,
                "comm": prediction.comm_bytes}
    bounds = dict(BOUNDS)
    if flops is not None:
        modelled.update({f"flops_{phase}": getattr(flops, phase) for phase in FLOP_PHASES})
        bounds.update(FLOP_BOUNDS)
    rows = []
    for quantity, bound in bounds.items():
        have, want = measured.get(quantity), modelled[quantity]
        error = None
        if have is not None and want is not None:
            error = 0.0 if have == want else abs(have - want) / max(abs(want), 1)
        rows.append({"quantity": quantity, "measured": have, "modelled": want, "error": error, "bound": bound,
                     "within": None if error is None else error <= bound,
                     "unit": "count" if quantity in FLOP_BOUNDS else "bytes"})
    return rows
