"""The one implementation of each optimizer, shared by every framework of a comparison.

LAMB comes from timm (a maintained implementation); SGD, Adam and AdamW from PyTorch.
"""
from __future__ import annotations

from typing import Iterable

import torch

from repro.recipe import OptimizerSpec


def make_optimizer(
    spec: OptimizerSpec, params: Iterable[torch.nn.Parameter], foreach: bool | None = None,
) -> torch.optim.Optimizer:
    """`foreach`: PyTorch's optimizers' multi-tensor path (None: torch's default, which on CPU is the
    per-tensor loop; the same arithmetic either way, bit for bit). Not passed to timm's LAMB, whose
    multi-tensor path rounds differently from its loop (4.8e-7 apart after 50 steps)."""
    params = [p for p in params if p.requires_grad]
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay,
                               foreach=foreach)
    if spec.name in ("adam", "adamw"):
        cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
        return cls(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay,
                   foreach=foreach)
    from timm.optim import Lamb

    return Lamb(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
