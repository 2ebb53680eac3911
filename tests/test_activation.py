"""The activation counter (repro.activation) against the hand derivation in docs/memory.md."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from repro.activation import Counter, PartitionCounters
from repro.workloads.gpt2 import Block, GPT2Spec, build_gpt2

pytestmark = pytest.mark.units

SMOKE = GPT2Spec(n_layer=4, d_model=64, n_head=4, seq_len=64, tokenizer="bytes", dropout=0.0)  # configs/gpt2-smoke.yaml
FLOAT, INT64 = 4, 8


def block_bytes(tokens: int, spec: GPT2Spec) -> int:
    """One block with its input, saved for backward: 16 N d + (4 + h) N floats (docs/memory.md)."""
    return FLOAT * (16 * tokens * spec.d_model + (4 + spec.n_head) * tokens)


def head_bytes(tokens: int, spec: GPT2Spec) -> int:
    """ln_f (its input, mean, rstd) and the linear head's input."""
    return FLOAT * (tokens * spec.d_model + 2 * tokens) + FLOAT * tokens * spec.d_model


def loss_bytes(tokens: int, spec: GPT2Spec) -> int:
    """Log-softmax output, int64 targets, NLL's total weight."""
    return FLOAT * tokens * spec.vocab_size + INT64 * tokens + FLOAT


def model_bytes(batch: int, spec: GPT2Spec) -> int:
    tokens = batch * spec.seq_len
    embedding = INT64 * tokens + INT64 * spec.seq_len  # token ids, positions
    return embedding + spec.n_layer * block_bytes(tokens, spec) + head_bytes(tokens, spec) + loss_bytes(tokens, spec)


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def test_one_block_matches_the_derivation():
    counter = Counter()
    block = Block(SMOKE)
    with counter.hooks():
        block(torch.randn(8, SMOKE.seq_len, SMOKE.d_model)).sum().backward()
    assert block_bytes(8 * SMOKE.seq_len, SMOKE) == 2_113_536
    assert counter.peak_bytes == pytest.approx(2_113_536, rel=0.05)
    assert counter.current == 0  # every storage released after backward


def test_smoke_gpt2_at_batch_8_matches_the_derivation():
    torch.manual_seed(0)
    model, counter = build_gpt2(SMOKE), Counter()
    tokens, targets = (torch.randint(0, SMOKE.vocab_size, (8, SMOKE.seq_len)) for _ in range(2))
    with counter.hooks():
        loss = loss_of(model, tokens, targets)
        at_end_of_forward = counter.current
        loss.backward()
    assert model_bytes(8, SMOKE) == 9_253_380
    assert counter.peak_bytes == at_end_of_forward == pytest.approx(9_253_380, rel=0.05)
    assert counter.current == 0 and not counter.held


def test_a_graph_kept_alive_keeps_its_activations_counted():
    """PipeDream's in-flight mini-batches: two forwards before any backward hold twice the bytes."""
    model, counter = build_gpt2(SMOKE), Counter()
    tokens = torch.randint(0, SMOKE.vocab_size, (8, SMOKE.seq_len))
    with counter.hooks():
        first, second = loss_of(model, tokens, tokens), loss_of(model, tokens, tokens)
        both = counter.current
        first.backward()
        one_left = counter.current
        del second
    shared = 3 * INT64 * 8 * SMOKE.seq_len  # one storage of token ids, saved as input and target by both
    assert both == pytest.approx(2 * model_bytes(8, SMOKE) - shared, rel=1e-6)
    assert one_left == pytest.approx(model_bytes(8, SMOKE) - INT64 * 8 * SMOKE.seq_len, rel=1e-6)  # ids once
    assert counter.current == 0


def test_torchgpipe_counts_each_partition_on_its_worker_thread():
    """Two partitions, two micro-batches of 4, no checkpointing: each partition holds both micro-batches."""
    from torchgpipe import GPipe

    from repro.adapters import pipeline

    torch.manual_seed(0)
    model = build_gpt2(SMOKE)
    ties = pipeline.untie(model, pipeline.group_of_layers([3, 3]))
    assert ties
    gpipe = GPipe(model, [3, 3], devices=["cpu", "cpu"], chunks=2, checkpoint="never")
    counters = PartitionCounters(gpipe.partitions)
    tokens, targets = (torch.randint(0, SMOKE.vocab_size, (8, SMOKE.seq_len)) for _ in range(2))
    with counters.hooks():
        loss_of(gpipe, tokens, targets).backward()
    micro = 4 * SMOKE.seq_len
    # the first partition saves views of the whole batch's token ids (one storage), positions per micro-batch;
    # the loss is computed on the gathered output, on the main thread, and counts to the last partition
    first = INT64 * 8 * SMOKE.seq_len + 2 * (INT64 * SMOKE.seq_len + 2 * block_bytes(micro, SMOKE))
    last = 2 * (2 * block_bytes(micro, SMOKE) + head_bytes(micro, SMOKE)) + loss_bytes(8 * SMOKE.seq_len, SMOKE)
    assert [c.peak_bytes for c in counters.counters] == [pytest.approx(first, rel=0.05), pytest.approx(last, rel=0.05)]
    assert counters.peak_bytes == max(c.peak_bytes for c in counters.counters)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_full_recompute_counts_the_recomputed_block_and_changes_no_bit(dropout: float):
    """torch.utils.checkpoint stores the recomputed block through a hook of its own; the counter sees it
    (Counter.recomputation): the peak is the embedding, every block's input and one block's whole set, at
    the last block's recomputation (docs/memory.md, "Recompute"), and the loss and gradients are the same
    to the bit, dropout included (checkpoint restores the RNG state)."""
    from repro.adapters.recompute import checkpoint_blocks
    from repro.shapes import GPT2Shape

    spec = GPT2Spec(4, 64, 4, 64, "bytes", dropout)
    torch.manual_seed(0)
    tokens, targets = torch.randint(256, (8, 64)), torch.randint(256, (8, 64))
    runs = []
    for recompute in (False, True):
        torch.manual_seed(1)
        model, counter = build_gpt2(spec), Counter()
        if recompute:
            checkpoint_blocks(model, GPT2Shape.from_model(spec).blocks(), counter)
        with counter.hooks():
            loss = loss_of(model, tokens, targets)
            loss.backward()
        runs.append((loss, [p.grad for p in model.parameters()], counter))
    (plain, plain_grads, _), (again, grads, counter) = runs
    assert torch.equal(plain, again) and all(torch.equal(a, b) for a, b in zip(plain_grads, grads))
    if not dropout:  # attention's dropout inside SDPA is not in the derivation
        tokens_n = 8 * 64
        block_input = FLOAT * tokens_n * spec.d_model
        embedding = INT64 * tokens_n + INT64 * spec.seq_len
        assert counter.peak_bytes == embedding + 4 * block_input + block_bytes(tokens_n, spec) - block_input == 2_511_360
    assert counter.current == 0  # every recomputed tensor released
