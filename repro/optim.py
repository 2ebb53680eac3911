"""The one implementation of each optimizer, shared by every framework of a comparison.

LAMB comes from timm (a maintained implementation); SGD, Adam and AdamW from PyTorch.
"""
from __future__ import annotations

from typing import Iterable

import torch

from repro.recipe import OptimizerSpec


def make_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.name in ("adam", "adamw"):
        cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
        return cls(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
    from timm.optim import Lamb

    return Lamb(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
