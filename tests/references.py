"""Reference runs, trained once per pytest session and shared by every test that compares against them.

The store is keyed by recipe fingerprint: two tests asking for the same resolved recipe, however they
spelled it, share one run. The GPT-2 recipes are `repro parity`'s (repro/parity.py: its reduced model,
global batch GLOBAL_BATCH, the same Adam for every framework), so the equivalence tests of DDP, ZeRO,
FSDP and the pipeline schedules check what parity checks, against one plain process trained once.

The store lives in a folder that every pytest process of the session shares (pytest-xdist's workers
included): the first process to ask for a run trains it under a lock on that run, and the others wait
for it and read its events from disk, so a run is trained once per session however many lanes run.
"""
from __future__ import annotations

from pathlib import Path

import lanes
from ranks import train
from repro.parity import Config, recipe_for
from repro.recipe import Recipe

STEPS = 4  # one epoch of parity's data (STEPS x GLOBAL_BATCH samples)
# 30 validation samples: a 2-GPU pipeline's last evaluation batch (6) must be padded to its micro-batches
VALIDATION = "data.max_val_samples=30"


def gpt2(framework: str, gpus: int, *sets: str) -> Recipe:
    """GPT-2 smoke as `repro parity` trains `framework` on `gpus`, with `sets` (e.g. zero.stage=3)."""
    config = Config(f"{framework}-{gpus}", framework, gpus, tuple(sets))
    return recipe_for(config, "gpt2", "smoke", STEPS, [VALIDATION])


def plain_gpt2() -> Recipe:
    """Parity's reference: one process of plain PyTorch on the same global batch."""
    return gpt2("ddp", 1)


class References:
    """Runs in the ranks tier (tests/ranks.py), each trained on first use; fingerprint -> events.

    `folder` is shared by the session's processes: each run is a folder named by its fingerprint."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.runs: dict[str, list[dict]] = {}

    def events(self, recipe: Recipe) -> list[dict]:
        """The run's events, trained here unless another process of the session trained it (tests/lanes.py)."""
        from conftest import read_events

        key = recipe.fingerprint()
        if key not in self.runs:
            run_dir = lanes.once(self.folder / f"{recipe.run_name()}-{key[:12]}", lambda folder: train(recipe, folder))
            self.runs[key] = read_events(run_dir)
        return self.runs[key]

    def losses(self, recipe: Recipe) -> list[float]:
        return [e["loss"] for e in self.events(recipe) if e["event"] == "step"]

    def epoch(self, recipe: Recipe) -> dict:
        return next(e for e in self.events(recipe) if e["event"] == "epoch")
