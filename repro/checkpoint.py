"""What a rank writes into a checkpoint beside its framework's state: torch files written atomically, RNG states.

Layout (repro.runfiles.RunFolder owns it): RUN_DIR/checkpoints/step-000120/ holds what the adapter
saves (in its framework's own format) and one loop-rank{r}.pt per rank (position in the data,
elapsed time, RNG states); RUN_DIR/checkpoints/latest.json names the last complete folder. Every file
is written to a temporary name and renamed, and the pointer moves only after every rank has finished
writing, so a save interrupted at any point (a killed rank, a full disk) leaves the previous
checkpoint current.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repro.runfiles import temporary_name


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename it over `path`."""
    temporary = temporary_name(path)
    torch.save(obj, temporary)
    os.replace(temporary, path)


def rng_state() -> dict[str, Any]:
    """Every random stream a rank draws from (Python, NumPy, torch CPU and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
