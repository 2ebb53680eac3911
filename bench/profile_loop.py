"""Where the loop's time between the frameworks' steps goes: cProfile on rank 0 over the kit's loop
(repro.loop.Trainer.run, 3 epochs of the smoke GPT-2: 192 steps) and over as many steps of
bench/minimal.py's loop, on the same ranks. Prints, per step, the cumulative time of every function
the two loops call directly, and writes the full profiles beside OUT (OUT.kit.prof, OUT.minimal.prof)
for `python -m pstats` or snakeviz. The profiler adds its own cost to every Python call, so the
figures are larger than without it; the unprofiled total is the epoch event's `loop_us.harness`.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_loop.py ddp OUT
"""
from __future__ import annotations

import cProfile
import contextlib
import os
import pstats
import sys
from pathlib import Path

import torch.distributed as dist
from minimal import STEP_BUILDERS, build_model, timed_steps

from repro import loop
from repro.data.sets import dataset
from repro.recipe import load_file, recipe_path

VAL_SAMPLES = 32  # validation runs between epochs, outside the steps


def direct_callees(profile: cProfile.Profile, module: str, caller: str) -> list[tuple[float, str]]:
    """(cumulative seconds, name) of every function that `caller` of file `module` called, from the
    calls it made itself, plus `caller`'s own time."""
    stats = pstats.Stats(profile).stats

    def is_caller(file: str, name: str) -> bool:
        return name == caller and file.endswith(module)

    rows = []
    for (file, line, name), (_, _, own, _, callers) in stats.items():
        cumulative = sum(entry[3] for (f, _, func), entry in callers.items() if is_caller(f, func))
        if cumulative:
            rows.append((cumulative, f"{name} ({Path(file).name}:{line})"))
        if is_caller(file, name):
            rows.append((own, f"{caller}'s own lines"))
    return sorted(rows, reverse=True)


def report(title: str, rows: list[tuple[float, str]], steps: int) -> None:
    print(f"{title}: microseconds per step over {steps} steps (profiled)")
    for seconds, name in rows:
        if seconds * 1e6 / steps >= 0.5:
            print(f"  {seconds * 1e6 / steps:10.1f}  {name}")


def main(framework: str, out: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    recipe = load_file(recipe_path("gpt2", "smoke"), [
        f"run.framework={framework}", f"run.gpus={world}", f"data.max_val_samples={VAL_SAMPLES}",
    ])
    run_dir = Path(out).with_suffix(".run")
    run_dir.mkdir(exist_ok=True)
    trainer = loop.Trainer(recipe, run_dir, dataset(recipe.data.dataset).locate())
    steps = len(trainer.train_loader(0)) * recipe.train.epochs
    profiles = {"kit": cProfile.Profile(), "minimal": cProfile.Profile()}
    with profiles["kit"] if dist.get_rank() == 0 else contextlib.nullcontext():
        trainer.run()
    workload = trainer.ctx.workload
    step, teardown = STEP_BUILDERS[framework](build_model(workload, recipe), workload, recipe)
    with profiles["minimal"] if dist.get_rank() == 0 else contextlib.nullcontext():
        timed_steps(step, trainer.train_set, recipe, steps)
    if dist.get_rank() == 0:
        for side, profile in profiles.items():
            profile.dump_stats(f"{out}.{side}.prof")
        for caller in ("run", "counted_step", "log_losses", "stop_agreed"):
            report(f"kit loop, {framework}, Trainer.{caller}", direct_callees(profiles["kit"], "repro/loop.py", caller), steps)
        report(f"minimal loop, {framework}, timed_steps", direct_callees(profiles["minimal"], "minimal.py", "timed_steps"), steps)
    dist.barrier()
    teardown()
    trainer.close(clean=True)
    loop.leave(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
