"""Step time per framework on a platform (repro.model.platforms): the busiest rank's compute, plus the
communication its framework does not hide, plus a pipeline's bubble. No torch.

Compute: the rank's FLOPs (repro.model.flops) at the platform's matrix rate for operations of the
step's mean size, the bytes memory-bound operations move at its memory bandwidth, and the operations it
dispatches at the platform's cost each (on a GPU the host runs ahead of the device: the larger of the
two; on a CPU one thread does both: their sum). Communication: each kind's payload per step
(repro.model.costs) as bytes on the wire (costs.wire_bytes) over the link of its scope (a node's, or the
network's shared by the node's groups), hidden behind backward where the framework overlaps it. Every
term and its source: docs/time.md.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass

from repro.model import costs, pipelines
from repro.model.flops import StepFlops, pipeline_ranks, process_flops, step_flops
from repro.model.platforms import Platform
from repro.model.terms import Cell, even_balance
from repro.shapes import GPT2Shape, parameters, tensor_count, tensors

# Operations a layer dispatches (aten ops, counted with TorchDispatchMode: bench/count_ops.py, which
# tests/test_time.py reruns): GPT-2 (forward, backward) for the embedding, a block and the head with
# its loss; VGG-16's whole model spread evenly over its layers (its layers are one or two ops each).
GPT2_OPS = {"embedding": (4, 7), "block": (32, 68), "head": (10, 16)}
VGG16_OPS = (56 + 5, 106 + 6)  # the model's 40 layers and the loss
# an optimizer's ops per parameter tensor and per step (the per-tensor loops torch and timm run on CPU)
OPTIMIZER_OPS = {"adam": (9, 4), "adamw": (9, 4), "lamb": (21, 11), "sgd": (3, 0)}
# matrix-multiply operations a pass dispatches per layer: a block's 4 linear layers and attention's 2
# batched products (q k^T, p v), the tied head's projection; VGG-16's convolutions and linear layers
GPT2_MATMULS = {"embedding": 0, "block": 6, "head": 1}
# the checked bounds (issue 40): each cell's predicted step time within 20% of the measured median, and
# the median of those errors at most 10%, on the machine's own calibrated profile
BOUND, MEDIAN_BOUND = 0.20, 0.10
OPTIMIZER_TRAFFIC = 3  # model state read and written once per step: weights, gradients, optimizer state (bytes x 3)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step on the busiest rank."""

    compute_s: float
    comm_s: float  # every collective and hand-over of the step
    exposed_s: float  # the part of comm_s not hidden behind compute
    bubble_s: float = 0.0  # a pipeline's fill and drain
    framework_s: float = 0.0  # the framework's own time beyond these terms, where the profile measured it

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_s + self.bubble_s + self.framework_s


def layer_ops(shape: object, layers: list[int] | range) -> tuple[float, float, int]:
    """(forward ops, backward ops, matrix multiplies) the layers `layers` dispatch per pass."""
    if isinstance(shape, GPT2Shape):
        kinds = ["embedding" if i == 0 else "head" if i == shape.n_layer + 1 else "block" for i in layers]
        return (sum(GPT2_OPS[k][0] for k in kinds), sum(GPT2_OPS[k][1] for k in kinds),
                sum(GPT2_MATMULS[k] for k in kinds))
    count = len(shape.layers())
    matmuls = sum(1 for i in layers if shape.layers()[i][0] in ("conv", "linear"))
    return VGG16_OPS[0] * len(layers) / count, VGG16_OPS[1] * len(layers) / count, matmuls


def workload_of(cell: Cell) -> str:
    return "gpt2" if isinstance(cell.shape, GPT2Shape) else "vgg16"


def all_layers(cell: Cell) -> range:
    return range(len(cell.shape.layer_tensors()))


def mean_matmul_flops(cell: Cell, flops: StepFlops, layers: list[int] | range, passes: int) -> float:
    """FLOPs of the step's mean matrix operation: forward FLOPs over the forward's matrix operations."""
    return flops.forward / max(1, passes * layer_ops(cell.shape, layers)[2])


def compute_seconds(cell: Cell, platform: Platform, flops: StepFlops, layers: list[int] | range, passes: int,
                    moved: tuple[int, int] | None = None) -> float:
    """The compute of a rank running `layers`, `passes` forward-backward passes a step (docs/time.md,
    "Compute"): matrix FLOPs at the rate of the step's mean operation, memory-bound bytes (activations
    written in forward and read in backward, each pass's; the model state once through the optimizer:
    `moved`, else what the cost model says the rank holds, one micro-batch's activations a pass), dispatch. A measured
    profile's own rates of the workload (WorkloadRates) stand in for its generic ones."""
    forward, backward, _ = layer_ops(cell.shape, layers)
    recomputed = flops.recompute / flops.forward if flops.forward else 0.0
    size = mean_matmul_flops(cell, flops, layers, passes)
    if moved is None:
        prediction = costs.predict(cell)
        moved = passes * (prediction.activations or 0), prediction.model_state
    activations, state = 2 * moved[0], OPTIMIZER_TRAFFIC * moved[1]
    rates = platform.rates(workload_of(cell), cell.precision)
    if rates:
        matrix = flops.counted / rates.matmul_rate(size)
        memory = activations / rates.activation_bandwidth + state / rates.state_bandwidth
    else:
        matrix = flops.counted / platform.matmul.rate(cell.precision, size)
        memory = (activations + state) / (platform.memory.bandwidth * platform.memory.efficiency)
    per_tensor, fixed = OPTIMIZER_OPS[cell.optimizer]
    tensors = tensor_count(cell.shape) * len(layers) / len(all_layers(cell))
    ops = passes * (forward * (1 + recomputed) + backward) + per_tensor * tensors + fixed
    device = matrix + memory
    dispatch = ops * platform.dispatch(workload_of(cell))
    return max(device, dispatch) if platform.dispatch_overlaps else device + dispatch


def collective_seconds(platform: Platform, kind: str, payload: float, group: int, calls: int = 1,
                       per_node: int | None = None) -> float:
    """Seconds a rank spends in `calls` operations of `kind` handing `payload` bytes in all over `group`
    ranks, `per_node` of them on each node (all of them where the group fits a node): inside a node the
    node's link; across nodes the network, a node's bandwidth shared by the ranks_per_node / per_node
    groups of the same kind that run at once (docs/time.md, "Topology")."""
    if group <= 1 or payload <= 0:
        return 0.0
    nccl = platform.backend == "nccl"
    kind = "reduce_scatter" if kind == "reduce_scatter_as_all_reduce" and nccl else kind.replace("reduce_scatter_as_", "")
    wire = costs.wire_bytes(kind, payload, group)
    per_node = per_node or min(group, platform.ranks_per_node)
    if group <= platform.ranks_per_node and per_node == group:
        link = platform.link("intra", kind)
        return calls * link.latency_s + wire / (link.bandwidth * link.efficiency)
    link = platform.link("inter", kind)
    share = per_node / platform.ranks_per_node
    return calls * link.latency_s + wire / (link.bandwidth * link.efficiency * share)


def overlapped(platform: Platform, comm: float, hidden_behind: float, tail: float) -> float:
    """Communication left exposed when it runs beside `hidden_behind` seconds of compute: what does not
    fit behind it, and at least the `tail` issued after the compute ends. A platform whose ranks fill
    every core (a CPU) overlaps nothing: gloo's reduction needs the cores backward is using."""
    if not platform.comm_overlaps:
        return comm
    return max(comm - hidden_behind, tail)


def data_parallel(cell: Cell, platform: Platform) -> StepTime:
    """DDP, ZeRO, FSDP: the whole model on every rank, batch_per_gpu samples a step (docs/time.md)."""
    flops = step_flops(cell)
    passes = cell.accumulation_steps
    compute = compute_seconds(cell, platform, flops, all_layers(cell), passes)
    backward = compute * flops.backward / max(flops.total, 1)
    comm_by_kind = costs.predict(cell).comm
    n, fw = cell.gpus, cell.framework
    psi_bytes = 4 * parameters(cell.shape)
    if fw == "ddp":
        bucket = min(psi_bytes, DDP_BUCKET)
        buckets = -(-psi_bytes // bucket)
        comm = collective_seconds(platform, "all_reduce", comm_by_kind["all_reduce"], n, buckets)
        tail = collective_seconds(platform, "all_reduce", bucket, n)
        return StepTime(compute, comm, overlapped(platform, comm, backward, tail))
    if fw == "zero" and cell.option("stage", 2) < 3:
        # overlap_comm is off as the kit sets it (repro.adapters.zero_plan): each reduction waits where it is issued,
        # stage 2's inside backward; the bucket's flushes, then the gradient norm's all-reduce (one fp32 of the payload)
        reduce = collective_seconds(platform, "reduce_scatter_as_all_reduce", comm_by_kind["all_reduce"] - costs.FP32, n,
                                    zero_flushes(cell))
        norm = collective_seconds(platform, "all_reduce", costs.FP32, n)
        gather = collective_seconds(platform, "all_gather", comm_by_kind.get("all_gather", 0), n)
        return StepTime(compute, reduce + norm + gather, reduce + norm + gather)
    reductions, gathers, norms = sharded_calls(cell)
    norm_bytes = costs.FP32 * costs.sharded_norms(cell, tensor_count(cell.shape))[0] if norms else 0
    gather = collective_seconds(platform, "all_gather", comm_by_kind.get("all_gather", 0), n, gathers)
    reduce = collective_seconds(platform, "reduce_scatter_as_all_reduce", comm_by_kind.get("all_reduce", 0) - norm_bytes,
                                n, reductions)
    norm_s = collective_seconds(platform, "all_reduce", norm_bytes, n, norms)
    comm = gather + reduce + norm_s
    # prefetch hides each unit's gather behind the unit before it, the reduce-scatter behind the backward
    # after it: the first gather and the last reduce-scatter wait, and the optimizer's norm reductions
    # come after backward (docs/time.md, "FSDP and ZeRO-3")
    return StepTime(compute, comm, overlapped(platform, comm, compute, gather / gathers + reduce / reductions + norm_s))


def zero_reductions(cell: Cell) -> list[int]:
    """Elements of each gradient all-reduce of a ZeRO-1/2 pass on gloo, as DeepSpeed 0.19 issues them
    (deepspeed/runtime/zero/stage_1_and_2.py). The gradients, in the order they are handed over (stage 2:
    as backward finishes them, the parameters in reverse; stage 1: the parameters' own order after
    backward, `reduce_gradients`), fill a bucket of `reduce_bucket_size` elements that is flushed when the
    next would overflow it, so one larger than the bucket is flushed alone, and what is left after
    backward (`reduce_independent_p_g_buckets_and_remove_grads`). A flush cuts its gradients where the
    ranks' partitions of the flat buffer meet and all-reduces the pieces in runs of more than the bucket
    and the rest (`average_tensor`, `allreduce_and_scatter`): one call, or two where a gradient larger
    than the bucket straddles a partition's edge."""
    size = cell.option("reduce_bucket_size", 500_000_000)
    numels = tensors(cell.shape)
    starts = [0, *itertools.accumulate(numels)]
    order = range(len(numels) - 1, -1, -1) if cell.option("stage", 2) == 2 else range(len(numels))
    flushes, held, elements = [], [], 0
    for index in order:
        if held and elements + numels[index] > size:
            flushes.append(held)
            held, elements = [], 0
        held.append(index)
        elements += numels[index]
    partition = -(-starts[-1] // cell.gpus)
    calls = []
    for flush in [*flushes, held]:
        pending = 0
        for piece in (piece for i in flush for piece in partition_pieces(starts[i], numels[i], partition)):
            pending += piece
            if pending > size:
                calls.append(pending)
                pending = 0
        calls += [pending] if pending else []
    return calls


def zero_flushes(cell: Cell) -> int:
    """Gradient all-reduces a ZeRO-1/2 step issues: stage 2's in every pass's backward, stage 1's once,
    after the last (`reduce_ready_partitions_and_remove_grads`: at the accumulation boundary)."""
    return len(zero_reductions(cell)) * (cell.accumulation_steps if cell.option("stage", 2) == 2 else 1)


def partition_pieces(start: int, numel: int, partition: int) -> list[int]:
    """A tensor at `start` of a flat buffer cut where partitions of `partition` elements meet."""
    pieces, end = [], start + numel
    while start < end:
        cut = min(end, (start // partition + 1) * partition)
        pieces.append(cut - start)
        start = cut
    return pieces


def sharded_calls(cell: Cell) -> tuple[int, int, int]:
    """Collectives a step of ZeRO-3 or FSDP2: (gradient reductions, all-gathers, norm all-reduces). FSDP2
    reduces the gradients once a step, a unit at a time (sync is off for all but the last micro-batch),
    gathers each unit before its forward and again before its backward in every micro-batch
    (`reshard_after_forward`; grad-op sharding: once), and completes the norms of sharded tensors with an
    all-reduce a use (costs.sharded_norms): GPT-2 smoke at 2 processes 10 all-gathers and 214
    all-reduces, VGG-16's 16 and 8, as counted (docs/measurement.md, "Where an FSDP2 step's time goes").
    ZeRO-3 gathers and reduces each unit once a pass."""
    passes = cell.accumulation_steps
    if cell.framework != "fsdp":
        units = len(cell.shape.blocks()) + 1
        return passes * units, passes * units, 0
    units = cell.shape.shard_units()
    per_pass = 1 if cell.option("sharding", "full") == "grad-op" else 2
    return units, passes * units * per_pass, costs.sharded_norms(cell, tensor_count(cell.shape))[1]


DDP_BUCKET = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb (25 MiB) as the adapter leaves it


def megatron(cell: Cell, platform: Platform) -> StepTime:
    """Megatron: tp all-reduces on the critical path (inside a node where tp fits one), the dp
    all-reduce of the shard's gradients beside backward (overlap_grad_reduce: repro.adapters.megatron)
    across nodes, one dp group per node's tp rank sharing the node's network."""
    tp = cell.option("tp", 1)
    flops = step_flops(cell)
    compute = compute_seconds(cell, platform, flops, all_layers(cell), cell.accumulation_steps)
    within, across = costs.megatron_reduced(cell)
    calls = 4 * cell.shape.n_layer + 2 + 2 * cell.recomputed if tp > 1 else 3  # costs.megatron_reduced's operations
    tp_comm = collective_seconds(platform, "all_reduce", within, tp, calls)
    dp = cell.gpus // tp
    per_node = max(1, platform.ranks_per_node // tp) if tp <= platform.ranks_per_node else 1
    dp_comm = collective_seconds(platform, "all_reduce", across, dp, per_node=min(per_node, dp))
    backward = compute * flops.backward / max(flops.total, 1)
    tail = dp_comm / max(1, len(cell.shape.blocks()))
    return StepTime(compute, tp_comm + dp_comm, tp_comm + overlapped(platform, dp_comm, backward, tail))


def rank_layers(sizes: list[int], rank: int, ranks: int) -> list[int]:
    """The layers of rank `rank` where stage s of `sizes` layers runs on rank s % ranks."""
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    return [layer for stage in range(rank, len(sizes), ranks) for layer in range(starts[stage], starts[stage] + sizes[stage])]


def pipeline_plan(cell: Cell) -> tuple[str, int, int, int, list[int]]:
    """(schedule, stages a rank, micro-batches a step, samples a micro-batch, layers a stage) of a pipeline
    as its plan runs it (repro.model.flops and repro.model.pipelines hold the same rules)."""
    ranks = cell.gpus
    if cell.framework == "torchgpipe":
        layers = len(cell.shape.layer_tensors())
        return "gpipe", 1, cell.option("chunks_per_gpu", 4) * ranks, cell.batch_per_gpu, \
            cell.option("balance", None) or even_balance(layers, ranks)
    if cell.framework == "pipedream":
        return "pipedream", 1, 1, cell.batch_per_gpu, pipelines.stage_sizes(cell, ranks)
    per_rank = pipelines.stages_per_rank(cell)
    micro = pipelines.schedule_microbatches(cell)
    return cell.option("schedule", "1f1b"), per_rank, micro, cell.batch_per_gpu * ranks // micro, \
        pipelines.stage_sizes(cell, ranks * per_rank)


def pipeline(cell: Cell, platform: Platform) -> StepTime:
    """torchgpipe, torch's pipeline schedules, PipeDream: the busiest rank's compute on its stages' layers
    over the step's micro-batches (repro.model.flops), its hand-overs on the critical path, and the
    schedule's fill and drain (pipelines.schedule_slots): every other rank's micro-batch slot once, as in
    the makespan of a flow shop of identical jobs, sum of the stages' times plus (M - 1) times the
    slowest's (docs/time.md, "Pipeline bubbles"). torchgpipe drives every partition from one process: on
    CPU stand-ins one host runs all of them, one after another, and hands nothing over."""
    schedule, per_rank, micro, samples, sizes = pipeline_plan(cell)
    ranks = cell.gpus
    if cell.framework == "torchgpipe" and not platform.dispatch_overlaps:
        traffic = [pipelines.rank_traffic(cell, sizes, rank, ranks, micro, samples) for rank in range(ranks)]
        moved = sum(saved for saved, _ in traffic), sum(state for _, state in traffic)
        return StepTime(compute_seconds(cell, platform, process_flops(cell), all_layers(cell), micro, moved), 0.0, 0.0)
    computes = rank_computes(cell, platform, sizes, micro, samples)
    compute = max(computes)
    comm = sum(collective_seconds(platform, kind, payload, 2, 2 * micro)
               for kind, payload in costs.predict(cell).comm.items() if kind in ("send", "all_reduce"))
    fill = (pipelines.schedule_slots(schedule, ranks, per_rank, micro) - micro) / max(1, ranks - 1)
    return StepTime(compute, comm, comm, fill * (sum(computes) - compute) / micro)


def rank_computes(cell: Cell, platform: Platform, sizes: list[int], micro: int, samples: int) -> list[float]:
    """Each pipeline rank's compute seconds a step: its stages' layers, FLOPs and moved bytes."""
    ranks = cell.gpus
    per_rank = pipeline_ranks(cell)
    return [compute_seconds(cell, platform, per_rank[rank], rank_layers(sizes, rank, ranks), micro,
                            pipelines.rank_traffic(cell, sizes, rank, ranks, micro, samples)) for rank in range(ranks)]


def step_time(cell: Cell, platform: Platform) -> StepTime:
    """The model's step time of `cell` on `platform`, with the framework's own time where the profile measured
    it for the cell's framework and settings (`framework_key`); KeyError for a framework it does not model."""
    terms = model_terms(cell, platform)
    if not platform.frameworks:
        return terms
    own = platform.framework_seconds(framework_key(cell), own_time_scale(cell))
    return dataclasses.replace(terms, framework_s=own)


def model_terms(cell: Cell, platform: Platform) -> StepTime:
    """The step time of `cell` from the model's counted terms alone: compute, communication, bubble."""
    if cell.framework in ("ddp", "zero", "fsdp"):
        return data_parallel(cell, platform)
    if cell.framework == "megatron":
        return megatron(cell, platform)
    if cell.framework in ("torchgpipe", "torch-pipeline", "pipedream"):
        return pipeline(cell, platform)
    raise KeyError(f"no step-time model for {cell.framework!r}")


def own_time_scale(cell: Cell) -> float:
    """Where a framework's own time is read on the line through its two measured sizes: ZeRO-1/2's bucket
    flushes a step where it has peers, each of which waits for them inside backward, about 2 ms on 2 CPU
    cores, so that its own time follows them, not its model state (docs/time.md, "A framework's own
    time"); every other framework's, and one rank's, model state a rank."""
    if cell.framework == "zero" and cell.option("stage", 2) < 3 and cell.gpus > 1:
        return float(zero_flushes(cell))
    return float(costs.predict(cell).model_state)


def framework_key(cell: Cell) -> str:
    """The name a profile keeps a framework's own time under (Platform.frameworks): the workload, framework and
    process count, and a digest of every other setting but the model's size (torchgpipe's balance follows
    the size), so that the time measured at two sizes applies to the same cell at a third."""
    settings = sorted((name, value) for name, value in cell.options.items() if name != "balance")
    fields = [cell.framework, cell.gpus, cell.batch_per_gpu, cell.optimizer, cell.precision, cell.device,
              cell.micro_batch, cell.recomputed, cell.selective, settings]
    digest = hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()[:10]
    return f"{workload_of(cell)} {cell.framework} {cell.gpus}g {digest}"


def samples_per_step(cell: Cell) -> int:
    """The global batch of one optimizer step, as each framework's plan sets it (repro.adapters.*_plan:
    `global_batch`): torchgpipe chunks_per_gpu x GPUs micro-batches of batch_per_gpu, PipeDream a fixed
    mini-batch of batch_per_gpu, every other framework batch_per_gpu x GPUs."""
    if cell.framework == "torchgpipe":
        return cell.batch_per_gpu * cell.option("chunks_per_gpu", 4) * cell.gpus
    if cell.framework == "pipedream":
        return cell.batch_per_gpu
    return cell.batch_per_gpu * cell.gpus


# Training samples an epoch of the paper's datasets: ImageNet-1k's 1,281,167 training images (Russakovsky
# et al. 2015); WikiText-103's 103,227,021 training tokens (Merity et al. 2016, word level) in windows of
# the recipe's seq_len: GPT-2's BPE splits words further, so this undercounts its epoch (docs/time.md)
PAPER_TRAIN = {"imagenet": 1_281_167, "wikitext-103": 103_227_021}


def epoch_steps(cell: Cell, dataset: str) -> int | None:
    """Optimizer steps in an epoch of `dataset` (None: its size is not known to the model)."""
    samples = PAPER_TRAIN.get(dataset)
    if samples is None:
        return None
    if isinstance(cell.shape, GPT2Shape):
        samples //= cell.shape.seq_len
    return -(-samples // samples_per_step(cell))
