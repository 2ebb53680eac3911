"""The harness overhead paired inside one job: the same ranks alternate between an epoch of the kit's
loop (repro.loop.Trainer.run: its step clock, its windowed loss reduction and events, its stop votes)
and as many steps of bench/minimal.py's loop on the framework's own API, in blocks a few seconds long.

Two `torchrun` jobs run a minute or more apart, and this machine's speed drifts by tens of percent
over minutes, so the side-by-side figure of bench/run.py scatters by more than the 2% it judges.
Here both sides of a pair run within seconds in the same processes, so drift cancels pair by pair.
Both sides train the same weights on the same batches (the model and data-order seeds of the kit's
seed table), so their arithmetic stays alike as training goes on; the warm-up pair's weight
difference shows it (0.0). On a CPU that matters: some hundreds of steps in, a step can take twice
as long for a while (denormal numbers, most likely), at the same step on both sides only if they
train alike.
What this cannot see, the processes beside the ranks (the follower, torchrun's `--tee`), bench/run.py
measures as the cores they keep busy. The first pair is warm-up and left out. Rank 0 writes each
pair's mean and median step times, the kit block's own loop time per step (`harness_us`) and the
load average after the pair, as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/paired.py ddp OUT.json PAIRS [WORKLOAD]

(WORKLOAD: gpt2, the default, or vgg16: each in its smoke recipe.)
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from minimal import STEP_BUILDERS, build_model, timed_steps

from repro import events, loop
from repro.adapters.fsdp import local
from repro.data.sets import dataset
from repro.recipe import load_file, recipe_path
from repro.runfiles import RunFolder

VAL_SAMPLES = 32  # validation runs between a kit block's steps and the next block, outside both sides' timing


def fresh_run(trainer: loop.Trainer, run_dir: Path) -> None:
    """Let the next Trainer.run start at step 0: no checkpoint to resume, an empty event file."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    dist.barrier()
    if trainer.writer:
        trainer.writer.close()
        RunFolder(run_dir).events_file.unlink(missing_ok=True)
        trainer.writer = events.EventWriter(RunFolder(run_dir).events_file)


def kit_block(trainer: loop.Trainer, run_dir: Path) -> tuple[float, int, float, float]:
    """One epoch through the kit's loop: its mean step time, step count, the loop's own time per step in
    microseconds (`loop_us.harness`) and the median step time (on the reporting rank)."""
    fresh_run(trainer, run_dir)
    trainer.run()
    if not trainer.writer:
        return 0.0, 0, 0.0, 0.0
    (epoch,) = [e for e in events.read_all(RunFolder(run_dir).events_file) if e["event"] == events.EPOCH]
    return epoch["step_s"]["mean"], epoch["step_s"]["count"], epoch["loop_us"]["harness"], epoch["step_s"]["median"]


def weight_difference(kit: torch.nn.Module, baseline: torch.nn.Module) -> float:
    """The largest difference between two models' parameters (this rank's shards of sharded ones, which
    both sides split alike): 0.0 where both trained alike."""
    return max((local(a.detach()) - local(b.detach())).abs().max().item()
               for a, b in zip(kit.parameters(), baseline.parameters()))


def main(framework: str, out: str, pairs: int, workload_name: str = "gpt2") -> None:
    world = int(os.environ["WORLD_SIZE"])  # torchrun's
    recipe = load_file(recipe_path(workload_name, "smoke"), [
        f"run.framework={framework}", f"run.gpus={world}", "train.epochs=1", f"data.max_val_samples={VAL_SAMPLES}",
    ])
    run_dir = Path(out).with_suffix(".run")
    run_dir.mkdir(exist_ok=True)
    trainer = loop.Trainer(recipe, run_dir, dataset(recipe.data.dataset).locate())  # joins the process group
    if dist.get_rank() == 0 and not trainer.reporting:
        raise SystemExit(f"paired.py: {framework} reports from another rank than 0")
    workload = trainer.ctx.workload
    baseline = build_model(workload, recipe)
    step, teardown = STEP_BUILDERS[framework](baseline, workload, recipe)
    block = len(trainer.train_loader(0))
    measured, warmed = [], {}
    for index in range(pairs + 1):
        order = ("kit", "minimal") if index % 2 else ("minimal", "kit")
        pair = {}
        for side in order:
            if side == "kit":
                pair["kit"], pair["kit_steps"], pair["harness_us"], pair["kit_median"] = kit_block(trainer, run_dir)
            else:
                steps_s = timed_steps(step, trainer.train_set, recipe, block)
                pair["minimal"], pair["minimal_median"] = statistics.fmean(steps_s), statistics.median(steps_s)
        pair["first"], pair["load"] = order[0], os.getloadavg()[0]
        if index:
            measured.append(pair)
        else:  # the first pair warms both sides up, each one epoch from the same weights on the same batches
            warmed = {"max_weight_difference": weight_difference(trainer.adapter.model, baseline)}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"framework": framework, "workload": workload_name, "world": world,
                                         "steps_per_block": block, "load_average": os.getloadavg(),
                                         "warm_up": warmed, "pairs": measured}))
    dist.barrier()
    teardown()
    trainer.close(clean=True)
    loop.leave(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
