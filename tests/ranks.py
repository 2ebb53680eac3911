"""The ranks tier's launcher: a run folder's ranks, as gloo processes started by the kit's warm launcher.

Each rank of a run folder runs the real training loop (repro.warm.ranks.loop_rank, as `repro run`'s
warm executor starts it, or a probe built on its Trainer) on the recipe in RUN_DIR/run.json, with the
environment torchrun gives its workers; the reporting rank writes RUN_DIR/events.jsonl as in any run.
Forking skips the cold start of a launcher and of N
interpreters importing torch and the frameworks: what `repro run` adds around the loop (pre-flight,
MLflow, the follower, signals) is the end-to-end tier's to test.

`start_ranks` is the one place that starts ranks here: issue 30's warm launcher (repro.warm), the one
launcher of the kit, forks them from its fork server.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from repro import registry
from repro.recipe import Recipe
from repro.runfiles import RUN_FILE
from repro.run.preflight import verify_data
from repro.warm import ranks as warm_ranks


def start_ranks(world: int, main: Callable[..., None], *args: object) -> None:
    """Run `main(*args)` (a module-level function) in `world` ranks started by the kit's warm launcher
    (repro.warm.ranks: forked from a fork server that imported torch once, each with torchrun's
    environment, so a gloo group starts from env://); raises naming the ranks that failed."""
    codes = warm_ranks.run(main, world, args)
    failed = {rank: code for rank, code in codes.items() if code}
    if failed:
        raise RuntimeError(f"ranks failed (rank: exit code): {failed}; their output is above")


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
    start_ranks(registry.plan_class(recipe.run.framework).processes(recipe), warm_ranks.loop_rank, str(run_dir))
    return read_events(run_dir)
