"""The cost model of the pipelines (repro.costmodel): torchgpipe, PyTorch's pipeline schedules and
PipeDream. Per stage the layers it holds; per step what crosses each cut between stages. No torch.
"""
from __future__ import annotations

from typing import Any

from repro.costmodel_terms import (
    ACTIVATION_ELEMENT, FP32, Cell, Prediction, even_balance, optimizer_bytes, split,
)
from repro.partition import balance
from repro.shapes import GPT2Shape, VGG16Shape

PIPEDREAM_HEADER = 8 * 8  # repro.adapters.pipedream.HEADER int64 slots before each activation


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
