"""Where the loop's time between the frameworks' steps goes, two ways, on the smoke GPT-2:

- direct: the kit's loop (repro.loop.Trainer.run, 3 epochs: 192 steps), its own time per step
  (`loop_us.harness`) in wall time and in CPU time of the thread (the loop's stopwatch, reading
  `thread_time_ns` too: on a loaded machine wall time holds the waits for a core, CPU time not); then
  192 more steps with the pieces it calls between steps wrapped in a stopwatch each (the next batch,
  the step clock, the loss window, the stop vote, the max-steps check): microseconds per step,
  without a profiler's cost;
- profiled: cProfile on rank 0 over another 192 steps of the kit's loop and as many of
  bench/minimal.py's loop, on the same ranks: per step, the cumulative time of every function the
  loops call directly (inflated by the profiler's cost per Python call). The full profiles are
  written beside OUT (OUT.kit.prof, OUT.minimal.prof) for `python -m pstats` or snakeviz.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_loop.py ddp OUT [--direct-only]

(--direct-only: the direct budget alone, without the profiles.)
"""
from __future__ import annotations

import cProfile
import gc
import contextlib
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from minimal import STEP_BUILDERS, build_model, timed_steps
from paired import fresh_run

from repro import events, loop, metrics
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


# What the loop calls between steps, by owner and attribute name (the loader's iterator: both loops')
PIECES = {
    "next batch (sampler, fetch, collate)": (loop.InProcessBatches, "__iter__"),
    "loss window, started (start_losses)": (loop.Trainer, "start_losses"),
    "loss window, read and written (finish_losses)": (loop.Trainer, "finish_losses"),
    "stop vote (stop_agreed)": (loop.Trainer, "stop_agreed"),
    "max-steps check (done)": (loop.Trainer, "done"),
    "step clock (StepClock.mark)": (metrics.StepClock, "mark"),
}


def timed_pieces() -> dict[str, list[int]]:
    """Wrap every piece in a stopwatch: name -> [wall nanoseconds, calls, CPU nanoseconds of this thread]
    during the timed steps (on a loaded machine the wall time holds the waits for a core; the CPU time not)."""
    spent = {name: [0, 0, 0] for name in PIECES}
    for name, (owner, attribute) in PIECES.items():
        original = getattr(owner, attribute)

        def timed(*args, _original=original, _spent=spent[name], **kwargs):
            if getattr(args[0], "phase", "steps") != "steps":  # a Trainer's call between epochs
                return _original(*args, **kwargs)
            started, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return _original(*args, **kwargs)
            finally:
                _spent[0] += time.perf_counter_ns() - started
                _spent[1] += 1
                _spent[2] += time.thread_time_ns() - cpu

        def timed_batches(batches: loop.InProcessBatches, _original=original, _spent=spent[name]) -> Iterator:
            inner = _original(batches)
            while True:
                started, cpu = time.perf_counter_ns(), time.thread_time_ns()
                batch = next(inner, None)
                _spent[0] += time.perf_counter_ns() - started
                _spent[1] += 1
                _spent[2] += time.thread_time_ns() - cpu
                if batch is None:
                    return
                yield batch

        setattr(owner, attribute, timed_batches if attribute == "__iter__" else timed)
    return spent


def gc_time(trainer: loop.Trainer) -> Callable:
    """Time Python's garbage collections that run during the timed steps (in a step or between steps;
    those between epochs are not the steps' cost) into GC_SPENT; returns the callback to remove."""
    spent = GC_SPENT

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            spent[2] = time.perf_counter_ns()
        elif trainer.phase == "steps":
            spent[0] += time.perf_counter_ns() - spent[2]
            spent[1] += 1

    gc.callbacks.append(callback)
    return callback


GC_SPENT = [0, 0, 0]  # nanoseconds, collections, start of the one running


class CPUStopwatch(metrics.Stopwatch):
    """The loop's stopwatch, also summing the CPU time of this thread over its stretches (`cpu_ns`):
    the part of the wall time that is the loop's own work, not a wait for a core or a peer."""

    made: list["CPUStopwatch"] = []  # in the order Trainer.run makes them: (harness, counters) per epoch

    def __init__(self) -> None:
        super().__init__()
        self.cpu_ns = self.cpu_started = 0
        CPUStopwatch.made.append(self)

    def start(self) -> None:
        self.cpu_started = time.thread_time_ns()
        super().start()

    def stop(self) -> None:
        super().stop()
        self.cpu_ns += time.thread_time_ns() - self.cpu_started


def harness_run(trainer: loop.Trainer, run_dir: Path) -> tuple[int, float, float, float] | None:
    """Run the kit's loop from step 0 with its stopwatch also reading CPU time; on the reporting rank
    (steps, the loop's own wall and CPU microseconds per step, mean step in ms) from its epoch events."""
    fresh_run(trainer, run_dir)
    CPUStopwatch.made.clear()
    loop.Stopwatch = CPUStopwatch
    try:
        trainer.run()
    finally:
        loop.Stopwatch = metrics.Stopwatch
    if not trainer.writer:
        return None
    trainer.writer.close()
    epochs = [e for e in events.read_all(run_dir / events.EVENTS_FILE) if e["event"] == events.EPOCH]
    steps = epochs[-1]["step"]
    wall = sum(e["loop_us"]["harness"] * e["samples"] / trainer.global_batch for e in epochs) / steps
    cpu = sum(watch.cpu_ns for watch in CPUStopwatch.made[::2]) / 1e3 / steps
    step_ms = sum(e["step_s"]["mean"] for e in epochs) / len(epochs) * 1e3
    return steps, wall, cpu, step_ms


def direct_budget(trainer: loop.Trainer, run_dir: Path) -> None:
    """The loop's own time per step twice: as the loop measures it, then with each of its pieces timed
    (their wrappers add a little); printed on the reporting rank."""
    measured = harness_run(trainer, run_dir)
    originals = {name: getattr(owner, attribute) for name, (owner, attribute) in PIECES.items()}
    spent = timed_pieces()
    collecting = gc_time(trainer)
    try:
        pieced = harness_run(trainer, run_dir)
    finally:
        gc.callbacks.remove(collecting)
        for name, (owner, attribute) in PIECES.items():
            setattr(owner, attribute, originals[name])
    if measured is None or pieced is None:
        return
    steps, wall, cpu, step_ms = measured
    print(f"direct: microseconds per step over {steps} steps, load average {os.getloadavg()[0]:.1f}")
    print(f"  {wall:10.1f}  the loop's own time (loop_us.harness), of a {step_ms:.2f} ms mean step "
          f"({wall / step_ms / 10:.2f}%; {cpu:.1f} us of CPU: {cpu / step_ms / 10:.2f}%)")
    steps, wall, cpu, step_ms = pieced
    print(f"  {wall:10.1f}  the same, its pieces timed ({cpu:.1f} us of CPU; {step_ms:.2f} ms mean step):")
    for name, (ns, calls, cpu_ns) in spent.items():
        print(f"  {ns / 1e3 / steps:10.1f}  {name}: {calls} calls ({cpu_ns / 1e3 / steps:.1f} us of CPU)")
    counted = sum(ns for ns, _, _ in spent.values()) / 1e3 / steps
    counted_cpu = sum(cpu_ns for _, _, cpu_ns in spent.values()) / 1e3 / steps
    print(f"  {wall - counted:10.1f}  the rest (Trainer.run's own lines, stopwatches, wrappers; "
          f"{cpu - counted_cpu:.1f} us of CPU)")
    print(f"  ({GC_SPENT[0] / 1e3 / steps:8.1f}  garbage collection during the timed steps, in the pieces or the "
          f"framework's steps: {GC_SPENT[1]} collections)")


def report(title: str, rows: list[tuple[float, str]], steps: int) -> None:
    print(f"{title}: microseconds per step over {steps} steps (profiled)")
    for seconds, name in rows:
        if seconds * 1e6 / steps >= 0.5:
            print(f"  {seconds * 1e6 / steps:10.1f}  {name}")


def main(framework: str, out: str, direct_only: bool) -> None:
    world = int(os.environ["WORLD_SIZE"])
    recipe = load_file(recipe_path("gpt2", "smoke"), [
        f"run.framework={framework}", f"run.gpus={world}", f"data.max_val_samples={VAL_SAMPLES}",
    ])
    run_dir = Path(out).with_suffix(".run")
    run_dir.mkdir(exist_ok=True)
    trainer = loop.Trainer(recipe, run_dir, dataset(recipe.data.dataset).locate())
    steps = len(trainer.train_loader(0)) * recipe.train.epochs
    direct_budget(trainer, run_dir)
    if direct_only:
        dist.barrier()
        trainer.close(clean=True)
        loop.leave(0)
    fresh_run(trainer, run_dir)
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
        for caller in ("run", "counted_step", "start_losses", "finish_losses", "stop_agreed"):
            report(f"kit loop, {framework}, Trainer.{caller}", direct_callees(profiles["kit"], "repro/loop.py", caller), steps)
        report(f"minimal loop, {framework}, timed_steps", direct_callees(profiles["minimal"], "minimal.py", "timed_steps"), steps)
    dist.barrier()
    teardown()
    trainer.close(clean=True)
    loop.leave(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["--direct-only"])
