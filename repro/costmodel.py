"""The cost model: bytes a GPU holds (model state, activations) and hands to communication per step,
per framework, in closed form from the workload's shape (repro.shapes). No torch: `repro predict` and
the pre-launch check use it before anything starts.

Every term cites its derivation: docs/memory.md (model state term by term, as read from the tensors
DDP, DeepSpeed and the optimizers allocate; activations per GPT-2 layer, from PyTorch's autograd
formulas) and docs/memory.md's "Communication" section (payloads per operation, from each framework's
source). No term copies a measured number: `tests/test_costmodel.py` and `reports/model_check.*` hold
the model against the counters (repro.metrics.model_state, repro.activation, repro.communication).

Sizes are in bytes. Weights, gradients and optimizer state are fp32 under every precision the kit uses
(autocast keeps fp32 weights), so model state does not depend on precision; activations in 16-bit
precision use 2-byte elements, unchecked until a GPU run (smoke runs are fp32).

Communication is the payload a rank hands to its process group per step, per kind of operation (what
repro.communication counts). What a ring moves on the wire follows from it (`wire_bytes`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from repro.partition import balance
from repro.shapes import GPT2Shape, VGG16Shape, dim0_sharded, flat_sharded, parameters, shape_of, tensor_at, tensor_count

FP32 = 4
ACTIVATION_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
# optimizer state per parameter element, and per parameter tensor (torch.optim.Adam(W)'s `step` is a
# 4-byte tensor per parameter; timm's Lamb keeps its step in the param group)
OPTIMIZER_STATE = {"adam": (2 * FP32, FP32), "adamw": (2 * FP32, FP32), "lamb": (2 * FP32, 0), "sgd": (FP32, 0)}
PIPEDREAM_HEADER = 8 * 8  # repro.adapters.pipedream.HEADER int64 slots before each activation
DEEPSPEED_ALIGNMENT = 2  # deepspeed/runtime/zero/stage_1_and_2.py: nccl_start_alignment_factor (x dp size)
# the checked bounds (issue 29): model state and communication exact to 1%, activations to 5%
BOUNDS = {"model_state": 0.01, "activations": 0.05, "comm": 0.01}


@dataclass(frozen=True)
class Cell:
    """What the model needs of a run: the workload's shape and the framework's settings."""

    shape: GPT2Shape | VGG16Shape
    framework: str
    gpus: int
    batch_per_gpu: int
    optimizer: str = "adam"
    precision: str = "fp32"
    options: dict[str, Any] = field(default_factory=dict)  # the framework's recipe section, as a mapping
    device: str = "cuda"  # "cpu": dropout keeps a mask of the activations' own dtype (CUDA's fused kernel: 1 byte)

    def option(self, name: str, default: Any) -> Any:
        return self.options.get(name, default)


@dataclass(frozen=True)
class Prediction:
    """Per GPU, the busiest one: model state and activation peak in bytes, payload per step by kind."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int | None  # None: not modelled for this framework and workload
    comm: dict[str, int]

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def comm_bytes(self) -> int:
        return sum(self.comm.values())

    @property
    def estimated_peak(self) -> int | None:
        """Model state + activations: what the CPU stand-ins measure as `memory/estimated_peak_bytes`."""
        return None if self.activations is None else self.model_state + self.activations

    @property
    def fit_bytes(self) -> int:
        """What a device must hold: the estimated peak, or the model state where activations are not modelled."""
        return self.model_state if self.estimated_peak is None else self.estimated_peak


def optimizer_bytes(cell: Cell, elements: int, tensor_count: int) -> int:
    per_element, per_tensor = OPTIMIZER_STATE[cell.optimizer]
    if cell.optimizer == "sgd" and not cell.option("momentum", 0.9):
        per_element = 0
    return per_element * elements + per_tensor * tensor_count


def activations(cell: Cell, batch: int) -> int | None:
    """Activation peak of the whole model at `batch` samples on one GPU: the sum of what each layer
    saves for backward (the peak is reached at the end of the forward; docs/memory.md)."""
    element = ACTIVATION_ELEMENT[cell.precision]
    return cell.shape.activation_bytes(batch, element, element if cell.device == "cpu" else 1)


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
    Communication (DeepSpeed's `average_tensor`/`reduce_ipg_grads`; stage 1 reduces the same buckets,
    its contiguous-gradient hooks on): every gradient bucket is reduced (on gloo the reduce-scatter runs
    as an all-reduce of the bucket: the whole gradient), the gradient norm is all-reduced (one fp32),
    and the updated partitions are all-gathered (each rank hands its partition): what DDP moves, as the
    ZeRO paper says of stages 1-2. With one process DeepSpeed still all-reduces the buckets and the norm
    (counted at stage 2: 4 Psi + 4 bytes), and gathers nothing.
    """
    stage, n = cell.option("stage", 2), cell.gpus
    if stage == 3:
        return zero3(cell)
    psi, count = parameters(cell.shape), tensor_count(cell.shape)
    part = zero_partition(psi, n)
    bucket = min(cell.option("reduce_bucket_size", 500_000_000), psi)
    grads = FP32 * (psi if stage == 1 else part + straddling(cell.shape, part, n) + held_whole(cell.shape, bucket))
    grads += FP32 * bucket + FP32
    optimizer = FP32 * part + optimizer_bytes(cell, part, 1)
    comm = {"all_reduce": FP32 * psi + FP32}
    if n > 1:
        comm["all_gather"] = FP32 * part
    return Prediction(FP32 * part * n, grads, optimizer, activations(cell, cell.batch_per_gpu), comm)


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
    weights = FP32 * (part + (sum(layers[0]) if n > 1 else 0))  # one rank: the gathered tensor is the partition
    grads = FP32 * (part + cell.option("reduce_bucket_size", 500_000_000)) + 1 + 8
    optimizer = FP32 * part + optimizer_bytes(cell, part, 1)
    regathered, later = 0, sum(sum(layer) for layer in layers)
    for layer in layers:
        later -= sum(layer)
        if 2 * later >= ZERO3_REUSE_DISTANCE:
            regathered += sum(-(-numel // n) for numel in layer)
    comm = {"all_reduce": FP32 * n * part + 8}
    if n > 1:
        comm["all_gather"] = FP32 * (part + regathered)
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
    sums (`sharded_norms`)."""
    sharding, gpus = cell.option("sharding", "full"), cell.gpus
    replicas = cell.option("replicas", 2) if sharding == "hybrid" else 1
    if gpus % replicas:
        raise ValueError(f"fsdp: {replicas} replicas must divide the GPUs ({gpus})")
    ranks = gpus // replicas
    held, count = dim0_sharded(cell.shape, ranks), tensor_count(cell.shape)
    comm: dict[str, int] = {}
    if ranks > 1:
        gathered = ACTIVATION_ELEMENT[cell.precision] * held
        comm["all_gather"] = gathered * (1 if sharding == "grad-op" else 2)
        reduced = ACTIVATION_ELEMENT[cell.option("reduce_dtype", "fp32")] * held
        comm["all_reduce"] = ranks * reduced + (reduced if replicas > 1 else 0) + FP32 * sharded_norms(cell, count)
    return Prediction(FP32 * held, FP32 * held, optimizer_bytes(cell, held, count),
                      activations(cell, cell.batch_per_gpu), comm)


def sharded_norms(cell: Cell, count: int) -> int:
    """fp32 elements all-reduced per step to complete the norms of `count` sharded (DTensor) tensors: a
    norm of a dim-0 shard is a partial result (DTensor's `_NormPartial`), reduced where it is used.
    timm's Lamb (timm/optim/lamb.py) takes the global gradient norm of the stacked per-tensor norms
    (`_get_clip_grad_norm`, max_grad_norm 1.0 by default: count elements) and, with weight decay,
    per-tensor trust ratios from the weights' and the updates' norms, each stack used in two operations
    (`_lamb_trust_ratio`: w / g, w > 0, g > 0: 4 count elements); gradient clipping
    (`clip_grad_norm_`) the stacked gradient norms once more (count)."""
    elements = count if cell.option("grad_clip", None) else 0
    if cell.optimizer == "lamb":
        elements += count + (4 * count if cell.option("weight_decay", 0.0) else 0)
    return elements


def megatron_elements(shape: GPT2Shape, tp: int) -> int:
    """Parameter elements one tensor-parallel rank holds (Shoeybi et al. 2019, section 3): the token
    embedding (tied to the head) split by vocabulary rows; attention's QKV and the MLP's first linear
    split by columns (weights and biases), their output projections by rows (biases and layer norms
    whole on every rank); position embedding and final layer norm whole."""
    d = shape.d_model
    layer = 4 * d + (3 * d * d + 3 * d) // tp + d * d // tp + d + (4 * d * d + 4 * d) // tp + 4 * d * d // tp + d
    rows = -(-shape.vocab // tp)  # the vocabulary padded to a multiple of tp (repro.adapters.megatron.padded_vocab)
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
    dp = cell.gpus // tp
    psi = megatron_elements(cell.shape, tp)
    count = tensor_count(cell.shape)
    tokens = cell.batch_per_gpu * tp * cell.shape.seq_len
    reduced = FP32 * 3 * tokens
    if tp > 1:
        reduced += FP32 * tokens * cell.shape.d_model * (4 * cell.shape.n_layer + 2)
        reduced += FP32 if cell.option("grad_clip", None) else 0
    if dp > 1:
        reduced += FP32 * psi
    return Prediction(FP32 * psi, FP32 * psi, optimizer_bytes(cell, psi, count), None, {"all_reduce": reduced})


def torchgpipe(cell: Cell) -> Prediction:
    """torchgpipe (one process, k partitions): per partition the layers it holds, their `.grad` and
    optimizer state (the busiest partition); every micro-batch hands its activation across each
    boundary and its gradient back, chunks_per_gpu x k micro-batches of batch_per_gpu samples; a
    partition's count holds both of its boundaries (repro.communication.BoundaryCounter)."""
    layers, k = cell.shape.layer_tensors(), cell.gpus
    if len(layers) < k:
        raise ValueError(f"torchgpipe: {len(layers)} layers cannot fill {k} partitions")
    balance = cell.option("balance", None) or even_balance(len(layers), k)
    chunks = cell.option("chunks_per_gpu", 4) * k
    # torchgpipe refuses shared parameters, so the adapter unties them whatever the partition count: the
    # last partition keeps its own copy of a tied weight, alone too (repro.adapters.torchgpipe)
    tied = cell.shape.tied_elements()
    parts = split(layers, balance)
    shares = [(sum(map(sum, part)) + (tied if index == k - 1 else 0), sum(map(len, part)) + (index == k - 1 and tied > 0))
              for index, part in enumerate(parts)]
    busiest, tensors = max(shares)
    crossing = [FP32 * chunks * elements for elements in cut_outputs(cell.shape, balance, cell.batch_per_gpu)]
    joined = max(sum(stage_cuts(crossing, stage)) for stage in range(k))
    comm = {"boundary:activation": joined, "boundary:gradient": joined} if k > 1 else {}
    return Prediction(FP32 * busiest, FP32 * busiest, optimizer_bytes(cell, busiest, tensors), None, comm)


def cut_outputs(shape: GPT2Shape | VGG16Shape, sizes: list[int], batch: int) -> list[int]:
    """Elements handed across each cut between consecutive stages of `sizes` layers: the output of the
    layer before the cut, at `batch` samples."""
    outputs = shape.output_elements(batch)
    return [outputs[sum(sizes[: index + 1]) - 1] for index in range(len(sizes) - 1)]


def stage_cuts(crossing: list[int], stage: int) -> list[int]:
    """The cuts stage `stage` joins: the one before it (received forward, sent back in backward) and the
    one after it (sent forward, received back)."""
    return [crossing[cut] for cut in (stage - 1, stage) if 0 <= cut < len(crossing)]


def rank_shares(cell: Cell, sizes: list[int], ranks: int) -> list[tuple[int, int]]:
    """(parameter elements, parameter tensors) of each rank when stage s of `sizes` runs on rank
    s % ranks; where the first and the last stage are on different ranks, the last keeps its own copy
    of a tied weight (GPT-2's head: repro.adapters.torch_pipeline, repro.adapters.pipeline.untie)."""
    parts = split(cell.shape.layer_tensors(), sizes)
    elements, tensors = [0] * ranks, [0] * ranks
    for stage, part in enumerate(parts):
        elements[stage % ranks] += sum(map(sum, part))
        tensors[stage % ranks] += sum(map(len, part))
    last = (len(parts) - 1) % ranks
    if last != 0 and cell.shape.tied_elements():
        elements[last] += cell.shape.tied_elements()
        tensors[last] += 1
    return list(zip(elements, tensors))


def torch_pipeline(cell: Cell) -> Prediction:
    """PyTorch's pipeline schedules (torch.distributed.pipelining; repro.adapters.torch_pipeline): stages
    of contiguous layers balanced by parameter count (repro.partition.balance, where the recipe gives
    none), stage s on rank s % GPUs (the interleaved schedules: 2 stages a rank). Each rank holds its
    stages' weights, gradients and optimizer state. Per step the global batch (batch_per_gpu x GPUs)
    crosses every cut forward and its gradient crosses back, whatever the micro-batch count: a rank
    sends and receives, per stage, what its cuts carry (`stage_cuts`). Then the tied weight's gradient
    is all-reduced between the first and the last rank, and one fp32 (the sum of squared gradient
    norms, for the optimizer's global clip) over all ranks; with one rank nothing is sent."""
    schedule = cell.option("schedule", "1f1b")
    per_rank = cell.option("stages_per_rank", None) or (2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1)
    count, ranks = cell.gpus * per_rank, cell.gpus
    weights = [sum(layer) for layer in cell.shape.layer_tensors()]
    sizes = cell.option("balance", None) or balance(weights, count, cell.shape.stage_starts())
    elements, tensors = max(rank_shares(cell, sizes, ranks))
    comm: dict[str, int] = {}
    if ranks > 1:
        crossing = [FP32 * n for n in cut_outputs(cell.shape, sizes, cell.batch_per_gpu * cell.gpus)]
        moved = max(sum(sum(stage_cuts(crossing, stage)) for stage in range(rank, count, ranks)) for rank in range(ranks))
        comm = {"send": moved, "recv": moved, "all_reduce": FP32 * (cell.shape.tied_elements() + 1)}
    micro = cell.option("microbatches", None) or 2 * cell.gpus
    in_flight = {"1f1b": lambda stage: min(micro, count - stage), "gpipe": lambda stage: micro}.get(schedule)
    held = None
    if in_flight and isinstance(cell.shape, GPT2Shape):
        held = stage_activations(cell, sizes, cell.batch_per_gpu * cell.gpus // micro, in_flight, cell.batch_per_gpu * cell.gpus)
    return Prediction(FP32 * elements, FP32 * elements, optimizer_bytes(cell, elements, tensors), held, comm)


def stage_activations(cell: Cell, sizes: list[int], batch: int, in_flight: Any, whole: int | None = None) -> int:
    """The busiest stage's activations: what its layers save for backward at `batch` samples (the
    GPT-2 block of docs/memory.md), times the micro-batches it holds in flight at its peak,
    `in_flight(stage)` (1F1B: min(M, S - s), Narayanan et al. 2021; GPipe: all M; PipeDream: S - s).
    `whole`: micro-batches cut from a batch of `whole` samples are views, and the first layer's token
    ids and the loss's targets saved from them keep the whole batch's storage (counted once)."""
    element = ACTIVATION_ELEMENT[cell.precision]
    per_layer = cell.shape.layer_activations(batch, element, element if cell.device == "cpu" else 1)
    start, most = 0, 0
    for stage, size in enumerate(sizes):
        held = sum(per_layer[start : start + size]) * in_flight(stage)
        if whole is not None:
            views = cell.shape.batch_views(batch)
            whole_views = cell.shape.batch_views(whole)
            if stage == 0:
                held += whole_views[0] - views[0] * in_flight(stage)
            if stage == len(sizes) - 1:
                held += whole_views[1] - views[1] * in_flight(stage)
        most, start = max(most, held), start + size
    return most


def pipedream(cell: Cell) -> Prediction:
    """PipeDream (repro.adapters.pipedream): one stage per rank, from the start event's time-measured
    balance (a prediction without a run splits by parameter count instead: the time balance is known
    only once measured). Each stage holds its live weights, their gradients and optimizer state, and the
    stashed weight versions its in-flight forwards ran on, S - s on stage s (Narayanan et al. 2019,
    weight stashing; counted with the weights). The mini-batch is fixed
    (batch_per_gpu); per step a stage receives one activation, preceded by a header of HEADER int64,
    and sends one on, and passes one gradient back; stage clipping is local, so nothing else is sent."""
    stages = cell.gpus
    weights = [sum(layer) for layer in cell.shape.layer_tensors()]
    sizes = cell.option("balance", None) or balance(weights, stages, cell.shape.stage_starts())
    # weight stashing: stage s holds its live weights and S - s versions (one per forward in flight; the
    # newest, for the next forward, among them: repro.adapters.pipedream.stashed_bytes)
    states = [(FP32 * (1 + stages - stage) * elements, FP32 * elements, optimizer_bytes(cell, elements, tensors))
              for stage, (elements, tensors) in enumerate(rank_shares(cell, sizes, stages))]
    weights, grads, optimizer = max(states, key=sum)
    comm: dict[str, int] = {}
    if stages > 1:
        crossing = [FP32 * n for n in cut_outputs(cell.shape, sizes, cell.batch_per_gpu)]
        send = max(sum(stage_cuts(crossing, s)) + (PIPEDREAM_HEADER if s < stages - 1 else 0) for s in range(stages))
        recv = max(sum(stage_cuts(crossing, s)) + (PIPEDREAM_HEADER if s > 0 else 0) for s in range(stages))
        comm = {"send": send, "recv": recv}
    held = None
    if isinstance(cell.shape, GPT2Shape):
        held = stage_activations(cell, sizes, cell.batch_per_gpu, lambda stage: stages - stage)
    return Prediction(weights, grads, optimizer, held, comm)


def even_balance(layers: int, parts: int) -> list[int]:
    return [layers // parts + (1 if index < layers % parts else 0) for index in range(parts)]


def split(items: list, balance: list[int]) -> list[list]:
    out, start = [], 0
    for size in balance:
        out.append(items[start : start + size])
        start += size
    return out


MODELS = {"ddp": ddp, "zero": zero, "fsdp": fsdp, "megatron": megatron, "torchgpipe": torchgpipe,
          "torch-pipeline": torch_pipeline, "pipedream": pipedream}


def predict(cell: Cell) -> Prediction:
    """The model of `cell`'s framework; KeyError naming the modelled ones when it has none."""
    if cell.framework not in MODELS:
        raise KeyError(f"no cost model for {cell.framework!r}; modelled: {', '.join(MODELS)}")
    return MODELS[cell.framework](cell)


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


def cell_of(recipe: Any, facts: dict[str, Any] | None = None) -> Cell:
    """The model's view of a resolved recipe (repro.recipe.Recipe); `facts`: what the adapter decided at
    setup (the start event's `adapter`: torchgpipe's computed balance), where the recipe leaves it open."""
    options = recipe.options()
    section = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options or {})
    section["grad_clip"] = recipe.train.grad_clip
    optimizer = recipe.optimizer()
    section["momentum"], section["weight_decay"] = optimizer.momentum, optimizer.weight_decay
    if facts and facts.get("balance"):
        section["balance"] = facts["balance"]
    shape = shape_of(recipe.workload, recipe.model, recipe.data.dataset)
    device = "cuda" if recipe.run.device == "cuda" or (recipe.run.device == "auto" and recipe.scale == "paper") else "cpu"
    return Cell(shape, recipe.run.framework, recipe.run.gpus, recipe.train.batch_per_gpu, optimizer.name,
                recipe.train.precision, section, device)


def measured_of(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The counted figures of an epoch event's ranks, as the model states them: the busiest rank's model
    state and activation peak, and per kind the busiest rank's payload per step."""
    comm: dict[str, int] = {}
    for rank in ranks:
        for kind, value in (rank.get("comm") or {}).get("bytes", {}).items():
            comm[kind] = max(comm.get(kind, 0), value)
    activations = [r["activation_peak_bytes"] for r in ranks if r.get("activation_peak_bytes") is not None]
    return {"model_state": max(r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks),
            "activations": max(activations) if activations else None,
            "comm": sum(comm.values()) if any(r.get("comm") for r in ranks) else None, "comm_kinds": comm}


def compare(prediction: Prediction, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per quantity: measured, modelled, relative error, bound and whether it holds (None where
    either side is missing: not counted, or not modelled)."""
    modelled = {"model_state": prediction.model_state, "activations": prediction.activations,
                "comm": prediction.comm_bytes}
    rows = []
    for quantity, bound in BOUNDS.items():
        have, want = measured.get(quantity), modelled[quantity]
        error = None
        if have is not None and want is not None:
            error = 0.0 if have == want else abs(have - want) / max(abs(want), 1)
        rows.append({"quantity": quantity, "measured": have, "modelled": want, "error": error, "bound": bound,
                     "within": None if error is None else error <= bound})
    return rows
