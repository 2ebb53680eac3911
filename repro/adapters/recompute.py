"""Activation recompute with torch.utils.checkpoint around the workload's blocks: the mechanism of the
adapters that run the kit's own nn.Sequential of layers themselves (DDP, DeepSpeed ZeRO).

Non-reentrant checkpoint (use_reentrant=False, PyTorch's recommended form): it keeps each block's input
through a saved tensor (which the activation counter sees), runs the block's forward again when backward
reaches it, and restores the RNG state first (preserve_rng_state), so dropout draws the same masks and
the loss is unchanged bit for bit.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from repro.activation import Counter
from repro.flops import FlopCounter
from repro.recipe import Recipe
from repro.shapes import shape_of


def apply_recompute(model: nn.Sequential, recipe: Recipe, mode: str, counter: Counter,
                    flops: FlopCounter | None = None) -> list[tuple[int, int]]:
    """Apply `mode` (the framework's effective recompute) to `model`: under full recompute the first
    train.recompute_layers of the workload's blocks (all by default) run under checkpoint. Returns those
    blocks' layer ranges (for the start event's facts)."""
    if mode != "full":
        return []
    blocks = shape_of(recipe.workload, recipe.model, recipe.data.dataset).blocks()[: recipe.train.recompute_layers]
    checkpoint_blocks(model, blocks, counter, flops)
    return blocks


def checkpoint_blocks(model: nn.Sequential, blocks: list[tuple[int, int]], counter: Counter,
                      flops: FlopCounter | None = None) -> None:
    """Make `model` run each of `blocks` (layer ranges start..stop-1) under torch.utils.checkpoint, the
    recomputation counted by `counter` (and its FLOPs by `flops`). The forward is replaced on the instance
    only: the modules, their order and the state dict are the model's own, so DDP's buckets and the
    checkpoint files are unchanged."""
    stops = dict(blocks)

    @contextlib.contextmanager
    def recomputation() -> Iterator[None]:
        with counter.recomputation(), flops.recomputing() if flops else contextlib.nullcontext():
            yield

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), recomputation()

    def forward(x: torch.Tensor) -> Any:
        index = 0
        while index < len(model):
            stop = stops.get(index)
            if stop is None:
                x, index = model[index](x), index + 1
            else:
                x = checkpoint(model[index:stop], x, use_reentrant=False, context_fn=contexts)
                index = stop
        return x

    model.forward = forward
