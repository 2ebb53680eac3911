"""The ranks tier's launcher: a run folder's ranks, as gloo processes forked from pytest's own process.

Each rank of a run folder runs the real training loop (`repro.loop.main`, or a probe built on its
Trainer) on the recipe in RUN_DIR/run.json, with the environment torchrun gives its workers; the reporting rank
writes RUN_DIR/events.jsonl as in any run. Forking skips the cold start of a launcher and of N
interpreters importing torch and the frameworks: what `repro run` adds around the loop (pre-flight,
MLflow, the follower, signals) is the end-to-end tier's to test.

`start_ranks` is the one place that starts ranks here: issue 30's warm launcher takes its place when
it lands on main.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from host import free_port
from repro import loop, registry
from repro.recipe import Recipe
from repro.runfiles import RUN_FILE
from repro.run.preflight import verify_data


def rank_main(rank: int, world: int, port: int, main: Callable[..., None], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    main(*args)


def start_ranks(world: int, main: Callable[..., None], *args: object) -> None:
    """Run `main(*args)` in `world` ranks, each with the environment torchrun gives its workers (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT of a free port: a gloo group starts from env://); raises when one fails."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank sets it: no OpenMP team of this process outlives the fork
    try:
        mp.start_processes(rank_main, (world, free_port(), main, args), nprocs=world, start_method="fork")
    finally:
        torch.set_num_threads(threads)


def write_run_file(recipe: Recipe, run_dir: Path) -> Path:
    """RUN_DIR/run.json as the runner writes it for its ranks (the recipe and the verified data)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"recipe": recipe.to_dict(), "data_dir": str(verify_data(recipe).root.resolve())}
    (run_dir / RUN_FILE).write_text(json.dumps(spec, indent=2))
    return run_dir


def train(recipe: Recipe, run_dir: Path) -> list[dict]:
    """The events of `recipe` trained by the real loop in its run.gpus ranks (one process per stand-in GPU)."""
    from conftest import read_events

    write_run_file(recipe, run_dir)
    start_ranks(registry.adapter_class(recipe.run.framework).processes(recipe), loop.main, str(run_dir))
    return read_events(run_dir)
