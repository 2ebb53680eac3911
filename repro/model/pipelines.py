"""The cost model of the pipelines (repro.model.costs): torchgpipe, PyTorch's pipeline schedules and
PipeDream. Per stage the layers it holds; per step what crosses each cut between stages. No torch.
"""
from __future__ import annotations

import heapq

from repro.model.terms import (
    ACTIVATION_ELEMENT, FP32, Cell, Prediction, autocasts, even_balance, optimizer_bytes, split,
)
from repro.partition import balance
from repro.shapes import GPT2Shape, VGG16Shape

PIPEDREAM_HEADER = 8 * 8  # repro.adapters.pipedream.HEADER int64 slots before each activation


def torchgpipe(cell: Cell) -> Prediction:
    """torchgpipe (one process, k partitions): per partition the layers it holds, their `.grad` and
    optimizer state (the busiest partition); every micro-batch hands its activation across each
    boundary and its gradient back, chunks_per_gpu x k micro-batches of batch_per_gpu samples; a
    partition's count holds both of its boundaries (repro.communication.BoundaryCounter). Activations:
    `gpipe_activations`, on CPU stand-ins."""
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
    # on GPUs each device's autograd thread recomputes as gradients arrive: an order set by timing, not modelled
    held = gpipe_activations(cell, balance, chunks) if cell.device == "cpu" else None
    return Prediction(FP32 * busiest, FP32 * busiest, optimizer_bytes(cell, busiest, tensors), held, comm)


CHECKPOINTED = {"always": lambda m: m, "except_last": lambda m: m - 1, "never": lambda m: 0}  # torchgpipe/gpipe.py


def gpipe_activations(cell: Cell, sizes: list[int], m: int) -> int:
    """The busiest partition's activation peak under torchgpipe, all partitions driven by one process
    on CPU stand-ins (torchgpipe/pipeline.py, checkpoint.py, dependency.py, worker.py).

    Forward: a checkpointed micro-batch (the first m - 1 with `except_last`) runs under no_grad and
    keeps only its input (Checkpoint saves it); the others keep everything; the loss, on the
    gathered output of the whole batch, counts to the last partition.
    Backward: the loss goes first, then a checkpointed micro-batch is recomputed (Recompute.backward,
    which keeps its activations until its Checkpoint.backward) as soon as its output's gradient has
    arrived and, where `depend` ties micro-batch i - 1 behind i, micro-batch i + 1 of that partition
    is done. `depend` forks from the previous micro-batch's output and joins into the input: an
    integer input (GPT-2's token ids) cannot carry it, so the first partition's micro-batches are
    not ordered. Autograd's CPU queue runs the node with the highest sequence number first, and
    sequence numbers count per thread: Recompute's nodes come from the main thread (Pipeline.compute's
    finalize), so every ready recomputation runs before any partition's backward, which come from the
    one worker thread of all CPU partitions in creation order, micro-batch i of partition j at clock
    i + j, partitions in order within a clock (`clock_cycles`): the latest first. So one partition
    recomputes all of its micro-batches at once where nothing orders them (one partition: every
    micro-batch's activations at the same time)."""
    k, b = len(sizes), cell.batch_per_gpu
    element = ACTIVATION_ELEMENT[cell.precision]
    mask = element if cell.device == "cpu" else 1
    starts = [sum(sizes[:j]) for j in range(k + 1)]
    outputs = cell.shape.output_elements(b)
    first_view = cell.shape.batch_views(b)[0]
    full = [cell.shape.stage_activation_bytes(starts[j], starts[j + 1], b, element, mask, keep_input=True) for j in range(k)]
    full[0] -= first_view  # the micro-batch's input is a view of the whole batch: held once
    full[-1] -= cell.shape.loss_bytes(b)  # the loss runs outside the partitions, on the whole batch
    kept = [0] + [element * outputs[starts[j] - 1] for j in range(1, k)]  # a checkpointed micro-batch's input
    once = [cell.shape.batch_views(m * b)[0]] + [0] * (k - 1)
    checkpointed = CHECKPOINTED[cell.option("checkpoint", "except_last")](m)
    ordered = [j > 0 or not isinstance(cell.shape, GPT2Shape) for j in range(k)]

    holding = [[kept[j] if i < checkpointed else full[j] for i in range(m)] for j in range(k)]
    total = [sum(column) + once[j] for j, column in enumerate(holding)]
    peak = total[:-1] + [total[-1] + cell.shape.loss_bytes(m * b)]  # the end of the forward
    arrived, done, queued, ready = {(i, k - 1) for i in range(m)}, set(), set(), []
    left = [m] * k  # micro-batches whose backward has not run: any of them keeps the batch's storage

    def release(i: int, j: int) -> None:
        """Micro-batch i of partition j is ready for its backward: recomputed (or never checkpointed)."""
        if (i, j) in arrived and (i, j) not in queued and (not ordered[j] or i == m - 1 or (i + 1, j) in done):
            queued.add((i, j))
            total[j] += full[j] - holding[j][i]
            holding[j][i] = full[j]
            peak[j] = max(peak[j], total[j])
            heapq.heappush(ready, (-(i + j), -j, i))

    for i in range(m):
        release(i, k - 1)
    while ready:  # the latest-created backward first
        _, negative_j, i = heapq.heappop(ready)
        j = -negative_j
        done.add((i, j))
        total[j] -= holding[j][i]
        holding[j][i], left[j] = 0, left[j] - 1
        if not left[j]:
            total[j] -= once[j]
        if j:
            arrived.add((i, j - 1))
            release(i, j - 1)
        if i:
            release(i - 1, j)
    return max(peak)


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
    norms, for the optimizer's global clip) over all ranks; with one rank nothing is sent. The figure is
    the busiest rank's (a middle rank, which holds no tied weight, where its cuts outweigh it). Activations:
    the busiest rank's peak over its stages' micro-batches in flight (`schedule_actions`, `peak_held`),
    micro-batches of the global batch cut into `microbatches`."""
    schedule, per_rank = cell.option("schedule", "1f1b"), stages_per_rank(cell)
    count, ranks = cell.gpus * per_rank, cell.gpus
    sizes = stage_sizes(cell, count)
    elements, tensors = max(rank_shares(cell, sizes, ranks))
    comm: dict[str, int] = {}
    if ranks > 1:
        width = cell.shape.block_output_width(ACTIVATION_ELEMENT[cell.precision], autocasts(cell))  # what a cut carries
        crossing = [width * n for n in cut_outputs(cell.shape, sizes, cell.batch_per_gpu * cell.gpus)]
        comm = busiest([pipeline_rank_comm(cell, crossing, rank, ranks, count) for rank in range(ranks)])
    whole = cell.batch_per_gpu * cell.gpus
    micro = schedule_microbatches(cell)
    per_micro, once, tails = stage_activations(cell, sizes, whole // micro, whole)
    held = max(peak_held(schedule_actions(schedule, rank, ranks, per_rank, micro), per_micro, once, tails)
               for rank in range(ranks))
    return Prediction(FP32 * elements, FP32 * elements, optimizer_bytes(cell, elements, tensors), held, comm)


# torch's schedules that loop over several stages a rank (the others hold one)
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")


def microbatch_count(counted: int | None, micro_batch: int | None, batch_per_gpu: int, gpus: int) -> int:
    """Micro-batches a step of torch's schedules, the one rule the plan (repro.adapters.torch_pipeline_plan) and
    the model both read: `counted` (torch_pipeline.microbatches), else the global batch in micro-batches of
    `micro_batch` samples (train.micro_batch: a count that follows the GPU count, as one recipe file needs),
    else 2 x GPUs."""
    if counted:
        return counted
    return batch_per_gpu * gpus // micro_batch if micro_batch else 2 * gpus


def stage_count(schedule: str, stages_per_rank: int | None) -> int:
    """Stages a rank of torch's schedules holds: `stages_per_rank` where the recipe sets it, else two for the
    looped schedules (MULTI_STAGE) and one for the others."""
    return stages_per_rank or (2 if schedule in MULTI_STAGE else 1)


def schedule_microbatches(cell: Cell) -> int:
    """Micro-batches a step of torch's schedules for the model's cell (`microbatch_count`)."""
    return microbatch_count(cell.option("microbatches", None), cell.micro_batch, cell.batch_per_gpu, cell.gpus)


def stages_per_rank(cell: Cell) -> int:
    """Stages a rank of torch's schedules holds, for the model's cell (`stage_count`)."""
    return stage_count(cell.option("schedule", "1f1b"), cell.option("stages_per_rank", None))


def stage_sizes(cell: Cell, count: int) -> list[int]:
    """Layers of each of `count` stages of torch's schedules and PipeDream: the recipe's balance, or
    contiguous layers balanced by parameter count (repro.partition.balance)."""
    weights = [sum(layer) for layer in cell.shape.layer_tensors()]
    return cell.option("balance", None) or balance(weights, count, cell.shape.stage_starts())


def pipeline_rank_comm(cell: Cell, crossing: list[int], rank: int, ranks: int, count: int) -> dict[str, int]:
    """What rank `rank` of torch's schedules hands over per step: what its stages' cuts carry, each way;
    the tied weight's gradient where it holds the first or the last stage (they all-reduce it); one fp32."""
    moved = sum(sum(stage_cuts(crossing, stage)) for stage in range(rank, count, ranks))
    tied = cell.shape.tied_elements() if rank in (0, (count - 1) % ranks) else 0
    return {"send": moved, "recv": moved, "all_reduce": FP32 * (tied + 1)}


def busiest(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """The payload of the rank that hands over the most per step, by kind (the first such rank: as counted)."""
    return max(per_rank, key=lambda kinds: sum(kinds.values()))


def schedule_actions(schedule: str, rank: int, ranks: int, per_rank: int, micro: int) -> list[tuple[str, int]]:
    """Rank `rank`'s compute actions up to its activation peak, or all of them (`looped_actions`): 1F1B's
    stage s holds min(M, S - s) micro-batches at its peak (Narayanan et al. 2021), GPipe's all M."""
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        return looped_actions(rank, ranks, per_rank, micro, schedule == "zero-bubble")
    return [("F", rank)] * (min(micro, ranks - rank) if schedule == "1f1b" else micro)


def stage_activations(cell: Cell, sizes: list[int], batch: int, whole: int | None = None) -> tuple[list[int], dict[int, int], list[int]]:
    """What each stage of `sizes` layers saves for backward per micro-batch of `batch` samples
    (shapes' `stage_activation_bytes`: docs/memory.md); what a stage holds once while any of its
    micro-batches is held: with `whole`, micro-batches cut from a batch of `whole` samples are views,
    and the first layer's input and the loss's targets saved from them keep the whole batch's storage;
    and the part of each micro-batch's bytes that the layers after the stage's last layer with
    parameters save (the last stage: the loss), which an input-only backward frees (`peak_held`)."""
    element = ACTIVATION_ELEMENT[cell.precision]
    mask = element if cell.device == "cpu" else 1
    starts = [sum(sizes[:stage]) for stage in range(len(sizes) + 1)]
    weights = [sum(layer) for layer in cell.shape.layer_tensors()]

    autocast = autocasts(cell)

    def saved(start: int, stop: int) -> int:
        return cell.shape.stage_activation_bytes(start, stop, batch, element, mask, autocast=autocast)

    per_micro = [saved(starts[s], starts[s + 1]) for s in range(len(sizes))]
    tails = []
    for s in range(len(sizes)):
        last = max((index for index in range(starts[s], starts[s + 1]) if weights[index]), default=starts[s] - 1)
        tails.append(per_micro[s] - saved(starts[s], last + 1) + (cell.shape.loss_bytes(batch) if s == len(sizes) - 1 else 0))
    once: dict[int, int] = {}
    if autocast:  # one autocast context around the whole schedule: its cached weight copies serve every micro-batch
        for s in range(len(sizes)):
            copies = cell.shape.weight_copy_bytes(starts[s], starts[s + 1], element)
            per_micro[s] -= copies
            once[s] = copies
    if whole is not None:
        views, whole_views = cell.shape.batch_views(batch, autocast), cell.shape.batch_views(whole, autocast)
        for stage, index in ((0, 0), (len(sizes) - 1, 1)):
            per_micro[stage] -= views[index]
            once[stage] = once.get(stage, 0) + whole_views[index]
        tails[-1] -= views[1]
    return per_micro, once, tails


def peak_held(actions: list[tuple[str, int]], per_micro: list[int], once: dict[int, int], tails: list[int]) -> int:
    """The most bytes a rank holds over its compute `actions` in order: a forward ("F") adds a micro-batch
    of its stage; a full backward ("B") or a weight backward ("W") frees one; an input backward ("I")
    frees only its tail (torch's stage_backward_input computes the input gradient with
    retain_graph=True, keeps the nodes where the weights' gradients branch off, and all below them,
    for the weight backward, and detaches the stage's output, so the nodes above them go:
    torch/distributed/pipelining/_backward.py)."""
    held: dict[int, int] = {}
    halved: dict[int, int] = {}  # micro-batches whose input backward ran and weight backward not yet
    most = 0
    for kind, stage in actions:
        held[stage] = held.get(stage, 0) + {"F": 1, "B": -1, "W": -1, "I": 0}[kind]
        halved[stage] = halved.get(stage, 0) + {"I": 1, "W": -1}.get(kind, 0)
        most = max(most, sum(n * per_micro[s] - halved[s] * tails[s] + (once.get(s, 0) if n else 0) for s, n in held.items()))
    return most


def looped_actions(rank: int, ranks: int, local: int, micro: int, zero_bubble: bool) -> list[tuple[str, int]]:
    """The compute actions of `rank` in order under torch's interleaved schedules, `local` stages a rank
    (stage l x ranks + rank), as torch/distributed/pipelining/schedules.py orders them:
    ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble's `_calculate_single_rank_operations`,
    `_get_warmup_ops` and `_get_1f1b_rank_ops`. Micro-batches go in rounds of `per_round`; the warm-up
    runs (local - 1) rounds of forwards plus 2 per rank after this one (zero bubble: 1); then one
    forward and one backward a step until every forward has run, then the remaining backwards. Zero
    bubble splits each backward into its input part (I) and, from the rank's (rank + 1)th backward on,
    one weight part (W) of the oldest pending backward after it; the rest at the end."""
    rounds = max(1, micro // ranks)
    per_round, total = micro // rounds, micro * local
    warmup = min((local - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - rank), total)

    def forward_stage(step: int) -> int:
        return step // per_round % local * ranks + rank

    def backward_stage(step: int) -> int:
        return (local - 1 - (step - warmup) // per_round % local) * ranks + rank

    actions = [("F", forward_stage(step)) for step in range(warmup)]
    pending: list[int] = []  # stages of input backwards whose weight backward has not run
    for step in range(warmup, total + warmup):
        if step < total:
            actions.append(("F", forward_stage(step)))
        actions.append(("I" if zero_bubble else "B", backward_stage(step)))
        if zero_bubble:
            pending.append(backward_stage(step))
            if step - warmup >= rank:
                actions.append(("W", pending.pop(0)))
    return actions + [("W", stage) for stage in pending]


def pipedream(cell: Cell) -> Prediction:
    """PipeDream (repro.adapters.pipedream): one stage per rank, from the start event's time-measured
    balance (a prediction without a run splits by parameter count instead: the time balance is known
    only once measured). Each stage holds its live weights, their gradients and optimizer state, and the
    stashed weight versions its in-flight forwards ran on, S - s on stage s (Narayanan et al. 2019,
    weight stashing; counted with the weights). The mini-batch is fixed
    (batch_per_gpu); per step a stage receives one activation, preceded by a header of HEADER int64,
    and sends one on, and passes one gradient back; stage clipping is local, so nothing else is sent."""
    stages = cell.gpus
    sizes = stage_sizes(cell, stages)
    # weight stashing: stage s holds its live weights and S - s versions (one per forward in flight; the
    # newest, for the next forward, among them: repro.adapters.pipedream.stashed_bytes)
    states = [(FP32 * (1 + stages - stage) * elements, FP32 * elements, optimizer_bytes(cell, elements, tensors))
              for stage, (elements, tensors) in enumerate(rank_shares(cell, sizes, stages))]
    weights, grads, optimizer = max(states, key=sum)
    comm: dict[str, int] = {}
    if stages > 1:
        crossing = [FP32 * n for n in cut_outputs(cell.shape, sizes, cell.batch_per_gpu)]
        comm = busiest([{"send": sum(stage_cuts(crossing, s)) + (PIPEDREAM_HEADER if s < stages - 1 else 0),
                         "recv": sum(stage_cuts(crossing, s)) + (PIPEDREAM_HEADER if s > 0 else 0)} for s in range(stages)])
    # in flight on stage s at its peak: S - s mini-batches of their own (no views of a shared batch)
    per_micro, _, _ = stage_activations(cell, sizes, cell.batch_per_gpu)
    held = max((stages - stage) * per_micro[stage] for stage in range(stages))
    return Prediction(weights, grads, optimizer, held, comm)


def rank_traffic(cell: Cell, sizes: list[int], rank: int, ranks: int, micro: int, batch: int) -> tuple[int, int]:
    """(activation bytes, model state bytes) rank `rank` moves through memory a step, where stage s of
    `sizes` runs on rank s % ranks, `micro` micro-batches of `batch` samples (repro.model.time's
    memory-bound term): what its stages save for backward, once for every micro-batch, and its live
    weights, gradients and optimizer state; PipeDream also copies its weights once a step, the version
    its next forward runs on (repro.adapters.pipedream `snapshot`). Not what the rank holds at its peak
    (`peak_held`, PipeDream's stashed versions): held bytes are written once and read once, however
    long they stay."""
    element = ACTIVATION_ELEMENT[cell.precision]
    mask = element if cell.device == "cpu" else 1
    starts = [sum(sizes[:stage]) for stage in range(len(sizes) + 1)]
    saved = sum(cell.shape.stage_activation_bytes(starts[s], starts[s + 1], batch, element, mask, autocast=autocasts(cell))
                for s in range(rank, len(sizes), ranks))
    elements, tensors = rank_shares(cell, sizes, ranks)[rank]
    versions = 2 if cell.framework == "pipedream" else 1
    return micro * saved, (versions + 1) * FP32 * elements + optimizer_bytes(cell, elements, tensors)


def schedule_slots(schedule: str, ranks: int, per_rank: int, micro: int) -> float:
    """A step's length in a rank's micro-batch slots (one micro-batch's forward and backward through
    the rank's stages), the busiest rank's `micro` slots of work included: GPipe and 1F1B fill and drain
    the pipeline in ranks - 1 slots (Huang et al. 2019; Narayanan et al. 2021, section 2.2); with
    `per_rank` stages a rank (interleaved 1F1B, zero bubble) each slot of the fill is 1/per_rank as long
    (Narayanan et al. 2021, section 2.2: the bubble shrinks by the number of model chunks; zero bubble's
    further split of the backward is not modelled); PipeDream's steady state has none (Narayanan et al.
    2019, 1F1B in steady state: every stage busy)."""
    if schedule == "pipedream":
        return float(micro)
    return micro + (ranks - 1) / per_rank
