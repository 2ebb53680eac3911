"""One rank of an fp16 run that meets an overflow: a good step, then a step in which rank 1 alone finds an
inf in one element of its gradients (written there just before the loss scaler unscales them). Each rank
writes to OUT/rank{RANK}.json whether its weights came out of that step unchanged, bit for bit, and the
loss scale before and after it. Started by tests/test_fp16.py in the ranks tier (tests/ranks.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from repro.loop import Trainer
from repro.recipe import resolve
from repro.runfiles import RUN_FILE

POISONED_RANK = 1


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (D)Tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def poison_before_unscaling(scaler: Any, parameters: list[torch.nn.Parameter]) -> None:
    """On POISONED_RANK, the first element of the first gradient this rank holds becomes inf just before
    the scaler looks for infs: only one rank of the group sees it."""
    unscale = scaler.unscale_

    def poisoned(optimizer: torch.optim.Optimizer) -> None:
        if int(os.environ["RANK"]) == POISONED_RANK:
            grad = next(local(p.grad) for p in parameters if p.grad is not None and local(p.grad).numel())
            grad.view(-1)[0] = float("inf")
        unscale(optimizer)

    scaler.unscale_ = poisoned


def main(run_dir: str | Path, out: str | Path) -> None:
    run_dir = Path(run_dir)
    spec = json.loads((run_dir / RUN_FILE).read_text())
    trainer = Trainer(resolve(spec["recipe"], spec["recipe"]["source"]), run_dir, Path(spec["data_dir"]))
    adapter = trainer.adapter
    try:
        batches = iter(trainer.train_loader(0))
        adapter.train_step(*next(batches))  # a good step: Adam's state exists, the scale is the initial one
        parameters = list(adapter.model.parameters())
        before, scale = [local(p).detach().clone() for p in parameters], adapter.scaler.get_scale()
        poison_before_unscaling(adapter.scaler, parameters)
        loss = adapter.train_step(*next(batches))
        unchanged = all(torch.equal(old, local(p).detach()) for old, p in zip(before, parameters))
        result = {"unchanged": unchanged, "scale_before": scale, "scale_after": adapter.scaler.get_scale(),
                  "loss_finite": bool(torch.isfinite(loss).all())}
        Path(out, f"rank{trainer.ctx.rank}.json").write_text(json.dumps(result))
    finally:
        trainer.close(True)
