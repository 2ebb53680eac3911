"""Checkpoints of a run: one folder per save, made current by an atomically replaced pointer file.

Layout: RUN_DIR/checkpoints/step-000120/ holds what the adapter saves (in its framework's own
format) and one loop-rank{r}.pt per rank (position in the data, elapsed time, RNG states);
RUN_DIR/checkpoints/latest.json names the last complete folder. Every file is written to a
temporary name and renamed, and the pointer moves only after every rank has finished writing, so
a save interrupted at any point (a killed rank, a full disk) leaves the previous checkpoint current.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest.json"


@dataclass
class Position:
    """Where training stands: enough, with the per-epoch seeded sampler, to continue bit for bit."""

    epoch: int = 0  # the epoch in progress, or the next one to start
    epoch_step: int = 0  # batches of that epoch already trained
    step: int = 0  # optimizer steps since the start of the run
    elapsed_s: float = 0.0  # training time of the finished epochs
    epoch_s: float = 0.0  # training time already spent in the epoch in progress


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename it over `path`."""
    temporary = temporary_name(path)
    torch.save(obj, temporary)
    os.replace(temporary, path)


def atomic_write_text(path: Path, text: str) -> None:
    temporary = temporary_name(path)
    temporary.write_text(text)
    os.replace(temporary, path)


def folder_for(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS_DIR / f"step-{step:09d}"


def latest(run_dir: Path) -> tuple[Path, Position] | None:
    """The last complete checkpoint folder and its position, or None when the run has none."""
    pointer = run_dir / CHECKPOINTS_DIR / LATEST_FILE
    if not pointer.exists():
        return None
    record = json.loads(pointer.read_text())
    return run_dir / CHECKPOINTS_DIR / record["folder"], Position(**record["position"])


def publish(run_dir: Path, folder: Path, position: Position) -> None:
    """Make `folder` the current checkpoint, then delete the older ones."""
    pointer = run_dir / CHECKPOINTS_DIR / LATEST_FILE
    atomic_write_text(pointer, json.dumps({"folder": folder.name, "position": asdict(position)}, indent=2))
    for old in folder.parent.glob("step-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


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
