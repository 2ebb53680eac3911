"""Floating-point operations of one training step on the busiest GPU, in closed form from the recipe
(docs/flops.md). No torch.

What is counted is what torch's FlopCounterMode counts (torch/utils/flop_counter.py: `flop_registry`):
matrix multiplies (mm, addmm, bmm, baddbmm: 2 m n k), convolutions (2 x output positions x kernel x
Cin x Cout; bias left out) and scaled-dot-product attention (its two batched products, the full s x s
square even where causal; backward five). The run's counter (repro.flops) counts the same formulas on
the real step, so forward, backward and recompute are held exact against it (costs.compare). The
optimizer's elementwise work is not a matrix product: it is modelled here (OPTIMIZER_FLOPS) and not
counted.

Per layer (the shapes' layers, repro.shapes):
- GPT-2, N = b s tokens, width d: a block's four linears 24 N d^2, attention 4 b s^2 d; the head
  2 N d V. Backward: every linear twice (input and weight gradients), attention's backward five
  products where its forward has two (torch's `sdpa_backward_flop_count`: it recomputes the scores).
- VGG-16: a convolution 2 x B x (its weight's elements) x (output positions), a linear 2 x B x (its
  weight's elements). Backward twice, but the first convolution's input (the images) needs no gradient.
- Megatron (tp ranks, local layer spec): the block's linears and the heads split over tp; attention as
  baddbmm and bmm, whose backward is two products each; the head over the tp-padded vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

from repro.model.costs import dim0_sharded, megatron_elements, zero_partition
from repro.model.pipelines import CHECKPOINTED, rank_shares, stage_sizes, stages_per_rank
from repro.model.terms import Cell, even_balance, split
from repro.shapes import GPT2Shape, VGG16Shape, flat_sharded, parameters

# elementwise FLOPs an optimizer spends per parameter element in one step (docs/flops.md), from
# torch/optim/adam.py, sgd.py (_single_tensor_*) and timm/optim/lamb.py (_single_tensor_lamb), counting
# an add, multiply, divide or square root 1, an add with alpha, a norm's square-and-sum 2, lerp, addcmul
# and addcdiv 3: (without weight decay, what weight decay adds)
OPTIMIZER_FLOPS = {
    # lerp_ 3, exp_avg_sq mul_ + addcmul_ 4, sqrt / + eps 3, addcdiv_ 3; L2 decay grad.add(p, alpha) 2
    "adam": (13, 2),
    # the same, decoupled decay p.mul_(1 - lr wd) 1
    "adamw": (13, 1),
    # the global clip norm 2, grad / clip 1, lerp_ 3, exp_avg_sq 4, denom 3, update 2; decay: update.add_
    # 2, the two trust-ratio norms 4, update.mul_ 1
    "lamb": (17, 7),
    # with momentum: buf.mul_ + add_ 2, p.add_(buf, alpha) 2 (plain SGD: the last 2 only); decay 2
    "sgd": (4, 2),
}


@dataclass(frozen=True)
class StepFlops:
    """Floating-point operations of the busiest rank in one training step."""

    forward: int  # matmul/conv/attention FLOPs of the forward pass(es) of all micro-batches
    backward: int  # their backward (about 2x forward)
    recompute: int  # forward work redone in backward by activation recompute
    optimizer: int  # the optimizer step's elementwise FLOPs on the rank's (sharded) parameters

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.recompute + self.optimizer

    @property
    def counted(self) -> int:
        """What the run's counter sees: all but the optimizer's elementwise work."""
        return self.forward + self.backward + self.recompute


def layer_forward(shape: GPT2Shape | VGG16Shape, batch: int) -> list[int]:
    """Forward FLOPs of each layer (shapes' layer order) at `batch` samples."""
    if isinstance(shape, GPT2Shape):
        n, d, s = batch * shape.seq_len, shape.d_model, shape.seq_len
        return [0, *[24 * n * d * d + 4 * batch * s * s * d] * shape.n_layer, 2 * n * d * shape.vocab]
    flops = []
    for kind, tensors, out in shape.layers():
        rows, row = tensors[0] if tensors else (1, 0)  # the weight: (output channels, inputs per output)
        flops.append(2 * batch * rows * row * (out // rows) if kind in ("conv", "linear") else 0)
    return flops


def layer_backward(shape: GPT2Shape | VGG16Shape, batch: int) -> list[int]:
    """Backward FLOPs of each layer at `batch` samples: twice the forward (input and weight gradients);
    GPT-2's fused attention kernel five products for two (SDPA's math path, which CPU takes with dropout:
    `shape.math_attention`, two batched matmuls whose backward is two each); the model's first layer
    computes no input gradient."""
    forward = layer_forward(shape, batch)
    if isinstance(shape, GPT2Shape):
        attention = 4 * batch * shape.seq_len**2 * shape.d_model
        products = 4 if shape.dropout and shape.math_attention else 5  # backward's, for the forward's 2
        return [0, *[2 * (f - attention) + attention * products // 2 for f in forward[1:-1]], 2 * forward[-1]]
    return [f if index == 0 else 2 * f for index, f in enumerate(forward)]


def optimizer_flops(cell: Cell, elements: int) -> int:
    """The optimizer step's elementwise FLOPs over `elements` parameter elements (OPTIMIZER_FLOPS)."""
    plain, decay = OPTIMIZER_FLOPS[cell.optimizer]
    if cell.optimizer == "sgd" and not cell.option("momentum", 0.9):
        plain = 2
    return elements * (plain + (decay if cell.option("weight_decay", 0.0) else 0))


def recomputed_forward(cell: Cell, batch: int) -> int:
    """Forward FLOPs done again in backward by torch's non-reentrant checkpoint of the first
    Cell.recomputed blocks (repro.adapters.recompute): each block's forward but what `early_stopped` skips."""
    forward = layer_forward(cell.shape, batch)
    blocks = cell.shape.blocks()[: cell.recomputed]
    return sum(sum(forward[start:stop]) - early_stopped(cell, batch) for start, stop in blocks)


def early_stopped(cell: Cell, batch: int) -> int:
    """FLOPs at a block's end that torch's non-reentrant checkpoint does not redo: its recomputation
    stops once the last tensor the block saved for backward is back (torch/utils/checkpoint.py, early
    stop, on by default), and a matrix product saves its inputs before it runs (autograd's generated
    VariableType kernels), so a block ending in one skips it: GPT-2's MLP output projection (2 N 4d d).
    Not with dropout, whose mask after that projection is the last tensor saved; nor under ZeRO-3, whose
    linears are an autograd Function that saves its inputs after the product (deepspeed/runtime/zero/
    linear.py: LinearFunctionForZeroStage3.setup_context). A VGG-16 block ends in a max-pool, which saves
    the indices it outputs: it runs (no matmul after it)."""
    zero3 = cell.framework == "zero" and cell.option("stage", 2) == 3
    if zero3 or not isinstance(cell.shape, GPT2Shape) or cell.shape.dropout:
        return 0
    return 8 * batch * cell.shape.seq_len * cell.shape.d_model**2


def data_parallel(cell: Cell, elements: int) -> StepFlops:
    """DDP, ZeRO, FSDP: the whole model on batch_per_gpu samples a rank (micro-batches add up to it);
    the optimizer over the rank's `elements`."""
    batch = cell.batch_per_gpu
    return StepFlops(sum(layer_forward(cell.shape, batch)), sum(layer_backward(cell.shape, batch)),
                     recomputed_forward(cell, batch), optimizer_flops(cell, elements))


def megatron(cell: Cell) -> StepFlops:
    """A tp rank of Megatron: the tp group's batch_per_gpu x tp sequences through its shard of every
    matmul (docstring above); attention's backward two products per forward product."""
    shape, tp = cell.shape, cell.option("tp", 1)
    if not isinstance(shape, GPT2Shape):
        raise KeyError("megatron applies to gpt2 only")
    b = cell.batch_per_gpu * tp
    n, d, s = b * shape.seq_len, shape.d_model, shape.seq_len
    linears, attention = 24 * n * d * d // tp, 4 * b * s * s * d // tp
    head = 2 * n * d * (-(-shape.vocab // tp))
    forward = shape.n_layer * (linears + attention) + head
    # megatron-core's full recompute (CheckpointFunction, reentrant) redoes whole layers, its selective one
    # attention's core (the scores' and the context's products) in every layer
    recompute = cell.recomputed * (linears + attention) + (shape.n_layer * attention if cell.selective else 0)
    return StepFlops(forward, 2 * forward, recompute, optimizer_flops(cell, megatron_elements(shape, tp)))


def stage_flops(cell: Cell, sizes: list[int], batch: int, recomputed: int = 0) -> list[tuple[int, int, int]]:
    """(forward, backward, recompute) of each stage of `sizes` layers at `batch` samples a step, where
    `recomputed` of those samples' forwards are done again in backward."""
    forward, backward = layer_forward(cell.shape, 1), layer_backward(cell.shape, 1)
    out = []
    for part_forward, part_backward in zip(split(forward, sizes), split(backward, sizes)):
        out.append((batch * sum(part_forward), batch * sum(part_backward), recomputed * sum(part_forward)))
    return out


def rank_flops(cell: Cell, stages: list[tuple[int, int, int]], elements: list[int]) -> list[StepFlops]:
    """Each rank's FLOPs where stage s runs on rank s % ranks, rank r holding `elements[r]`."""
    ranks = len(elements)
    return [StepFlops(*(sum(stage[i] for stage in stages[rank::ranks]) for i in range(3)),
                      optimizer_flops(cell, elements[rank])) for rank in range(ranks)]


def most_flops(per_rank: list[StepFlops]) -> StepFlops:
    """The rank of `per_rank` with the most counted FLOPs: the one the FLOP check compares."""
    return max(per_rank, key=lambda flops: flops.counted)


def torchgpipe_partitions(cell: Cell) -> list[StepFlops]:
    """torchgpipe, per partition (a GPU at paper scale): chunks_per_gpu x k micro-batches of
    batch_per_gpu samples through it, the checkpointed ones (CHECKPOINTED) recomputed in backward; the
    optimizer over its parameters (the last partition also a copy of the tied weight: the adapter unties it).
    torchgpipe's `depend` joins each micro-batch's input after the first to its predecessor's graph
    (torchgpipe/pipeline.py, dependency.py: Join), so a floating-point input requires a gradient and the
    first layer computes it for chunks - 1 micro-batches (VGG-16's first convolution; GPT-2's first
    layer is a lookup: no FLOPs)."""
    k, layers, b = cell.gpus, len(cell.shape.layer_tensors()), cell.batch_per_gpu
    sizes = cell.option("balance", None) or even_balance(layers, k)
    chunks = cell.option("chunks_per_gpu", 4) * k
    recomputed = CHECKPOINTED[cell.option("checkpoint", "except_last")](chunks) * b
    stages = stage_flops(cell, sizes, chunks * b, recomputed)
    forward, backward, recompute = stages[0]
    stages[0] = (forward, backward + (chunks - 1) * layer_forward(cell.shape, b)[0], recompute)
    elements = [sum(map(sum, part)) for part in split(cell.shape.layer_tensors(), sizes)]
    elements[-1] += cell.shape.tied_elements()
    return [rank_flops(cell, [stage], [held])[0] for stage, held in zip(stages, elements)]


def torch_pipeline_ranks(cell: Cell) -> list[StepFlops]:
    """torch's schedules, per rank: the global batch (batch_per_gpu x GPUs) through every stage, stage s on rank s % GPUs."""
    count = cell.gpus * stages_per_rank(cell)
    sizes = stage_sizes(cell, count)
    stages = stage_flops(cell, sizes, cell.batch_per_gpu * cell.gpus)
    return rank_flops(cell, stages, [elements for elements, _ in rank_shares(cell, sizes, cell.gpus)])


def pipedream_ranks(cell: Cell) -> list[StepFlops]:
    """PipeDream, per rank: in its steady state a stage runs one mini-batch's forward and one's backward a step."""
    sizes = stage_sizes(cell, cell.gpus)
    stages = stage_flops(cell, sizes, cell.batch_per_gpu)
    return rank_flops(cell, stages, [elements for elements, _ in rank_shares(cell, sizes, cell.gpus)])


def process_flops(cell: Cell) -> StepFlops:
    """The FLOPs of one training step of the busiest process: what the run's counter sees (repro.flops).
    A GPU's (`step_flops`) but under torchgpipe, whose one process drives every partition: their sum."""
    if cell.framework != "torchgpipe":
        return step_flops(cell)
    partitions = torchgpipe_partitions(cell)
    phases = ("forward", "backward", "recompute", "optimizer")
    return StepFlops(*(sum(getattr(part, phase) for part in partitions) for phase in phases))


def step_flops(cell: Cell) -> StepFlops:
    """The FLOPs of one training step on `cell`'s busiest GPU."""
    framework = cell.framework
    if framework == "ddp":
        return data_parallel(cell, parameters(cell.shape))
    if framework == "zero" and cell.option("stage", 2) == 3:
        return data_parallel(cell, flat_sharded(cell.shape, cell.gpus))
    if framework == "zero":
        return data_parallel(cell, zero_partition(parameters(cell.shape), cell.gpus))
    if framework == "fsdp":
        replicas = cell.option("replicas", 2) if cell.option("sharding", "full") == "hybrid" else 1
        return data_parallel(cell, dim0_sharded(cell.shape, cell.gpus // replicas))
    if framework == "megatron":
        return megatron(cell)
    if framework in PIPELINE_RANKS:
        return most_flops(pipeline_ranks(cell))
    raise KeyError(f"no FLOP model for {framework!r}")


PIPELINE_RANKS = {"torchgpipe": torchgpipe_partitions, "torch-pipeline": torch_pipeline_ranks, "pipedream": pipedream_ranks}


def pipeline_ranks(cell: Cell) -> list[StepFlops]:
    """Each rank's FLOPs a step under torchgpipe (a partition a GPU), torch's schedules or PipeDream."""
    return PIPELINE_RANKS[cell.framework](cell)
