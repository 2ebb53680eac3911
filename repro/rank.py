"""This process as one rank of a run: its device, its process group, and its quick end.

The environment is torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR), or a warm launcher's,
which sets the same (repro.warm); without MASTER_ADDR the process trains alone.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from repro import hardware
from repro.recipe import Recipe, check


def pick_device(recipe: Recipe, local_rank: int) -> torch.device:
    wanted = recipe.run.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def resolve_precision(recipe: Recipe, device: torch.device) -> Recipe:
    """The recipe with `train.precision: auto` decided for `device` (repro.hardware.automatic_precision) and
    checked again as the parent checked it, so that a framework refusing what auto became (torch-pipeline
    fp16 on a GPU without bf16) says so in its one line before anything is built; any other recipe as is."""
    if recipe.train.precision != "auto":
        return recipe
    capability = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
    precision = hardware.automatic_precision(device.type, capability)
    resolved = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, precision=precision))
    check(resolved, f"{recipe.source} (train.precision auto -> {precision} on {device.type})")
    return resolved


def init_distributed(device: torch.device, timeout_s: int) -> tuple[int, int, int]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return rank, world, local_rank


def leave(code: int) -> None:
    """End the process now that the run is closed: events and checkpoints are written and closed, the
    process group is gone. Python's own teardown with torch loaded takes about 0.5 s a process
    (measured here), paid at the end of every cell of the matrix, and does nothing the run needs."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
