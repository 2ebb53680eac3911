"""The LBANN job: `python -m repro.adapters.lbann_driver RUN_DIR` (LBANNPlan.command).

It writes LBANN's inputs into RUN_DIR/lbann (label lists of the same ImageFolder samples the other
frameworks read, plan.json, experiment.prototext), launches the `lbann` ranks with srun or mpirun,
echoes their output, and turns each finished epoch of trainer 0 (the reporting trainer) into the
same STEP and EPOCH events repro.loop writes, so the runner, MLflow and the tables work unchanged.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from repro import events, launch, registry
from repro.adapters import lbann as translation
from repro.adapters.lbann_log import GIB, Epoch, parse, trainer_epochs
from repro.recipe import Recipe
from repro.runfiles import RunFolder

WORK_DIR = "lbann"
EXPERIMENT_SCRIPT = Path(__file__).with_name("lbann_experiment.py")
# The memory method recorded with every run (tag repro.memory_method): LBANN's callback reads the
# device's used memory (total - free), which includes other processes and the CUDA context.
MEMORY_METHOD = "lbann_gpu_memory_usage_device_wide"
POLL_S = 1.0


def lbann_program() -> str:
    return shutil.which("lbann") or "lbann"


def lbann_python() -> str:
    """LBANN's own Python: $LBANN_PYTHON, else the python3 beside the `lbann` program (a Spack view)."""
    return os.environ.get("LBANN_PYTHON") or str(Path(lbann_program()).parent / "python3")


def export_prototext(plan_file: Path, prototext: Path) -> None:
    """Build the plan with LBANN's front end, under LBANN's own Python (lbann_experiment.py says why)."""
    subprocess.run([lbann_python(), "-I", str(EXPERIMENT_SCRIPT), str(plan_file), str(prototext)], check=True)


def metric(values: dict[str, float], *names: str) -> float | None:
    """The value of the first of `names` that the epoch printed (nan and inf included: a diverged run)."""
    return next((values[n] for n in names if n in values), None)


def epoch_events(epoch: Epoch, elapsed_s: float, steps_per_epoch: int, samples: int,
                 state_bytes: dict[str, int]) -> list[dict[str, Any]]:
    """One LBANN epoch as the loop's STEP and EPOCH event fields (missing numbers become NaN)."""
    step = (epoch.epoch + 1) * steps_per_epoch
    epoch_s = metric(epoch.training, "run time")
    epoch_s = math.nan if epoch_s is None else epoch_s
    train_loss = metric(epoch.training, "cross_entropy", "objective function")
    val = {"val/loss": metric(epoch.validation, "cross_entropy"), "val/accuracy": metric(epoch.validation, "accuracy")}
    train = {"train/objective": epoch.training.get("objective function"), "train/accuracy": epoch.training.get("accuracy")}
    percent = ("val/accuracy", "train/accuracy")  # LBANN prints percentages; the kit records fractions
    peak_gib = epoch.memory_gib.get("max")
    rank = {"rank": 0, "method": MEMORY_METHOD, "peak_bytes": math.nan if peak_gib is None else round(peak_gib * GIB),
            **state_bytes}
    return [
        {"event": events.STEP, "step": step, "epoch": epoch.epoch, "loss": train_loss},
        {
            "event": events.EPOCH, "epoch": epoch.epoch, "step": step, "epoch_s": epoch_s,
            "elapsed_s": elapsed_s + epoch_s, "samples": samples, "samples_per_s": samples / epoch_s,
            "val": {k: v / 100 if k in percent else v for k, v in val.items() if v is not None},
            "train": {k: v / 100 if k in percent else v for k, v in train.items() if v is not None},
            "ranks": [rank], "memory_gib": epoch.memory_gib,
        },
    ]


class Job:
    """LBANN's inputs for one run, its launch, and the events of its output."""

    def __init__(self, recipe: Recipe, run_dir: Path, data_dir: Path):
        self.recipe, self.run_dir, self.data_dir = recipe, run_dir, data_dir
        self.work = run_dir / WORK_DIR
        self.work.mkdir(exist_ok=True)
        workload = registry.workload_class(recipe.workload)(recipe.model, recipe.data, data_dir)
        train, val = workload.datasets()
        self.train_samples, self.val_samples = len(train), len(val)
        self.write_label_list(train, data_dir / "train", self.work / "train.txt")
        self.write_label_list(val, data_dir / "val", self.work / "val.txt")
        self.plan = translation.plan(recipe, data_dir, self.work, workload.num_classes)
        (self.work / "plan.json").write_text(json.dumps(self.plan, indent=2))
        # LBANN's epochs visit every sample: the last mini-batch is a partial one.
        self.global_batch = self.plan["mini_batch_size"]
        self.steps_per_epoch = -(-self.train_samples // self.global_batch)
        self.writer = events.EventWriter(RunFolder(run_dir).events_file)

    @staticmethod
    def write_label_list(dataset: Any, split_dir: Path, path: Path) -> None:
        """The samples an ImageFolder (or its first-N Subset) yields, in its order."""
        indices = getattr(dataset, "indices", None)
        folder = getattr(dataset, "dataset", dataset)
        samples = [folder.samples[i] for i in indices] if indices is not None else folder.samples
        path.write_text("\n".join(translation.label_lines(samples, split_dir)) + "\n")

    def write_prototext(self) -> Path:
        prototext = self.work / "experiment.prototext"
        export_prototext(self.work / "plan.json", prototext)
        return prototext

    def command(self, prototext: Path) -> list[str]:
        run = self.recipe.run
        choice = launch.lbann_launcher(self.recipe.options().launcher, dict(os.environ))
        return launch.LBANN_LAUNCHERS[choice](run.nodes, run.gpus, lbann_program(), prototext)

    def run(self) -> int:
        prototext = self.write_prototext()
        command = self.command(prototext)
        (self.work / "command.json").write_text(json.dumps(command))
        self.writer.emit(
            events.START, seeds={"master": self.recipe.seed}, world=self.recipe.run.gpus, device="lbann",
            global_batch=self.global_batch, steps_per_epoch=self.steps_per_epoch, epochs=self.recipe.train.epochs,
            max_steps=None, train_samples=self.train_samples, val_samples=self.val_samples,
        )
        out_log = self.work / "out.log"
        with open(out_log, "w") as out, open(self.work / "err.log", "w") as err:
            job = subprocess.Popen(command, stdout=out, stderr=err, cwd=self.work)
        returncode = self.follow(job, out_log)
        if returncode:
            sys.stdout.write((self.work / "err.log").read_text()[-4000:])
        return returncode

    def follow(self, job: subprocess.Popen, out_log: Path) -> int:
        """Echo out.log and emit each epoch once it is over (the next one began, or the job ended)."""
        emitted, echoed, elapsed = 0, 0, 0.0
        state = translation.model_state_bytes(self.plan)
        while True:
            finished = job.poll() is not None
            text = out_log.read_text()
            sys.stdout.write(text[echoed:])
            sys.stdout.flush()
            echoed = len(text)
            done = trainer_epochs(parse(text))
            done = done if finished else done[:-1]
            for epoch in done[emitted:]:
                for event in epoch_events(epoch, elapsed, self.steps_per_epoch, self.train_samples, state):
                    self.writer.emit(event.pop("event"), **event)
                    elapsed = event.get("elapsed_s", elapsed)
            emitted = max(emitted, len(done))
            if finished:
                self.writer.emit(events.END, step=emitted * self.steps_per_epoch, elapsed_s=elapsed)
                return job.returncode
            time.sleep(POLL_S)


def main(run_dir: str) -> None:
    folder = RunFolder(run_dir)
    job = Job(folder.recipe(), folder.path, Path(folder.read_spec().data_dir))
    try:
        sys.exit(job.run())
    finally:
        job.writer.close()


if __name__ == "__main__":
    main(sys.argv[1])
