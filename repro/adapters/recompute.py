"""Activation recompute with torch.utils.checkpoint around the workload's blocks: the mechanism of the
adapters that run the kit's own nn.Sequential of layers themselves (DDP).

Non-reentrant checkpoint (use_reentrant=False, PyTorch's recommended form): it keeps each block's input
through a saved tensor (which the activation counter sees), runs the block's forward again when backward
reaches it, and restores the RNG state first (preserve_rng_state), so dropout draws the same masks and
the loss is unchanged bit for bit.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from repro.activation import Counter


def checkpoint_blocks(model: nn.Sequential, blocks: list[tuple[int, int]], counter: Counter) -> None:
    """Make `model` run each of `blocks` (layer ranges start..stop-1) under torch.utils.checkpoint, the
    recomputation counted by `counter`. The forward is replaced on the instance only: the modules, their
    order and the state dict are the model's own, so DDP's buckets and the checkpoint files are unchanged."""
    stops = dict(blocks)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), counter.recomputation()

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
