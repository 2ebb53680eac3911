"""`make gpu-check`: each framework that runs on one GPU, at the paper's model sizes, for a few dozen
measured steps; one JSON report with throughput, MFU, peak memory (allocator and device-wide) and
any error. Synthetic samples of the paper's shapes stand in for ImageNet and WikiText-103 (a GPU
machine may have neither), which changes nothing in a step's arithmetic cost.

Megatron's entry trains megatron-core's GPTModel with its DistributedDataParallel and optimizer
(the adapter's GPU path) and compares its per-step loss with the plain GPT-2 in the same precision
(DDP on one GPU, Megatron's optimizer, the same global batch): on one GPU at tp=1, and where two
GPUs exist at tp=2 and at dp=2 with the distributed optimizer (half the batch per GPU each).

    python bench/gpu_check.py                      # on a GPU machine: reports/gpu_check.json
    python bench/gpu_check.py --only gpt2:megatron # Megatron's entry alone
    python bench/gpu_check.py --scale smoke --only gpt2:ddp --steps 4   # the CPU dry run of the plumbing
    python bench/gpu_check.py --cell-timeout 120 --budget 420 --log out/cells.log   # a lease's minutes

A cell that runs past --cell-timeout (or past what is left of --budget) is killed with every process
under it and recorded as an error; cells the budget no longer reaches are recorded as skipped. The
report is rewritten after every cell, so a check stopped from outside keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from repro.registry import Unavailable
from repro.schema import RecipeError

ROOT = Path(__file__).resolve().parent.parent
CELLS = [(w, f) for w in ("gpt2", "vgg16") for f in ("ddp", "zero", "megatron", "fsdp", "torchgpipe", "pipedream")
         if (w, f) != ("vgg16", "megatron")]
WARMUP = 5
FP32_FRAMEWORKS = ("torchgpipe", "pipedream")  # the paper ran both in fp32 (repro.adapters.plan.require_fp32)
FUSED_BUILD_S = 90  # --fused-ops last builds only with at least this much of --budget left (an nvcc build)
KILL_WAIT_S = 30  # after a timed-out cell's processes are killed, how long its output may take to close
MIN_CELL_S = 15  # a cell is not started with less of --budget left
# Megatron's variants: (name, GPUs, overrides); two-GPU ones halve the batch per GPU to keep the global batch.
MEGATRON_VARIANTS = [
    ("megatron-tp1", 1, ()),
    ("megatron-tp2", 2, ("megatron.tp=2",)),
    ("megatron-dp2-distributed-optimizer", 2, ("megatron.tp=1", "megatron.distributed_optimizer=true")),
]


def build_fused_ops() -> dict[str, Any]:
    """DeepSpeed's fused Adam: prebuilt in the image, else JIT-built here (and timed)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {"status": "skipped: no CUDA device"}
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder import FusedAdamBuilder

        if installed_ops.get("fused_adam"):
            return {"status": "prebuilt"}
        start = time.perf_counter()
        FusedAdamBuilder().load()
        return {"status": "built", "seconds": time.perf_counter() - start}
    except Exception as error:  # the report records any failure instead of stopping the check
        return {"status": "failed", "error": f"{type(error).__name__}: {error}"}


class Limits:
    """Each cell's time limit (--cell-timeout, cut to what is left of --budget) and the log of every
    cell's output (--log)."""

    def __init__(self, cell_s: float | None = None, budget_s: float | None = None, log: Path | None = None):
        self.cell_s, self.budget_s, self.log = cell_s, budget_s, log
        self.started = time.monotonic()

    def spent(self) -> bool:
        """Whether under MIN_CELL_S of the budget is left: too little to start another run."""
        return bool(self.budget_s) and self.budget_s - (time.monotonic() - self.started) < MIN_CELL_S

    def left(self) -> float | None:
        """Seconds the next cell may run; None: no limit."""
        limits = [self.cell_s] if self.cell_s else []
        if self.budget_s:
            limits.append(self.budget_s - (time.monotonic() - self.started))
        return min(limits) if limits else None

    def record(self, command: list[str], returncode: int | None, stdout: str, stderr: str, wall_s: float) -> None:
        if self.log is None:
            return
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            log.write(f"\n===== {' '.join(command)}\n===== exit {returncode}, {wall_s:.1f} s\n")
            log.write(f"----- stdout\n{stdout}\n----- stderr\n{stderr}\n")


def kill_tree(pid: int) -> None:
    """The process and everything under it (repro run starts torchrun in a session of its own), waited
    for until each is gone or a zombie (SIGKILL lands when the kernel next runs the process: on a busy
    machine, after this returns unless waited for), at most KILL_WAIT_S."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        deadline = time.monotonic() + KILL_WAIT_S
        while any(map(running, tree)) and time.monotonic() < deadline:
            time.sleep(0.05)


def running(process: Any) -> bool:
    """Whether a psutil process still runs: not gone, not a zombie."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_cell(command: list[str], cwd: Path, timeout: float | None) -> tuple[int | None, str, str]:
    """(exit code, or None when it ran past `timeout` and was killed; stdout; stderr)."""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        try:
            stdout, stderr = process.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # a process outside the tree still holds the pipes
            process.kill()
            stdout, stderr = "", ""
        return None, stdout or "", (stderr or "") + f"\n[gpu_check] killed after {timeout:.0f} s (cell time limit)"


def skipped(workload: str, framework: str, why: str) -> dict[str, Any]:
    return {"workload": workload, "framework": framework, "wall_s": 0.0, "error": why}


def measure(workload: str, framework: str, scale: str, steps: int, scratch: Path, gpus: int = 1,
            extra: tuple[str, ...] = (), limits: Limits | None = None) -> dict[str, Any]:
    from repro.hardware import mfu
    from repro.recipe import load_file, recipe_path
    from repro.registry import adapter_class, workload_class

    precision = ("train.precision=fp32",) if framework in FP32_FRAMEWORKS else ()
    overrides = ["data.dataset=synthetic", "train.log_every=1", *precision, *extra]
    recipe = load_file(recipe_path(workload, scale), [f"run.framework={framework}", f"run.gpus={gpus}", *overrides])
    batch = adapter_class(framework).global_batch(recipe)
    samples = batch * (steps + 1)
    # one whole validation batch: a pipeline cuts it into its micro-batches (a short last batch breaks
    # torch-pipeline's fixed stage shapes)
    overrides.append(f"data.max_val_samples={batch}")
    command = [sys.executable, "-m", "repro.cli", "run", workload, "--framework", framework, "--gpus", str(gpus),
               "--scale", scale, "--epochs", "1", "--max-steps", str(steps), "--experiment", "gpu-check",
               "--tracking-uri", f"sqlite:///{scratch}/mlflow.db", "--set", f"data.max_train_samples={samples}"]
    for text in overrides:
        command += ["--set", text]
    limits = limits or Limits()
    if limits.spent():
        return skipped(workload, framework, "skipped: the check's time budget is spent")
    started = time.perf_counter()
    returncode, stdout, stderr = run_cell(command, scratch, limits.left())
    result: dict[str, Any] = {"workload": workload, "framework": framework, "gpus": gpus, "overrides": list(extra),
                              "wall_s": time.perf_counter() - started}
    limits.record(command, returncode, stdout, stderr, result["wall_s"])
    if returncode != 0:
        return {**result, "error": (stdout + stderr)[-3000:]}
    run_dir = Path(stderr.rsplit("files in ", 1)[1].split()[0])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    walls = [e["wall"] for e in events if e["event"] == "step"]
    step_s = statistics.median([b - a for a, b in zip(walls, walls[1:])][WARMUP:] or [float("nan")])
    per_s = start["global_batch"] / step_s
    epoch = next(e for e in events if e["event"] == "epoch")
    spec = workload_class(workload)(recipe.model, recipe.data, None)
    device = start["device_name"]
    return {
        **result, "device": device, "device_type": start["device"].split(":")[0], "precision": recipe.train.precision,
        "step_s": step_s,  # host wall between step events: a step's launch, not waited for (see epoch_step_s)
        # the loop's own step-time distribution (CUDA events on a GPU; its warm-up steps left out)
        "epoch_step_s": epoch.get("step_s"),
        "samples_per_s": per_s, "tokens_per_s": per_s * recipe.model.seq_len if workload == "gpt2" else None,
        "mfu": mfu(device, recipe.train.precision, spec.flops_per_sample() * per_s),
        "peak_allocated_bytes": max(r["peak_bytes"] for r in epoch["ranks"]),
        "device_used_bytes": max((r.get("device_used_bytes") or 0) for r in epoch["ranks"]) or None,
        "memory_method": epoch["ranks"][0]["method"], "implementation": start.get("effective", {}),
        "losses": [e["loss"] for e in events if e["event"] == "step"],
    }


def megatron_cells(scale: str, steps: int, scratch: Path, limits: Limits | None = None) -> list[dict[str, Any]]:
    """Megatron's variants that fit this machine's GPUs, each with its loss against the plain GPT-2."""
    import torch

    from repro.parity import TOLERANCE
    from repro.recipe import load_file, recipe_path

    recipe = load_file(recipe_path("gpt2", scale), ["run.framework=megatron"])
    optimizer = recipe.optimizer()
    same_optimizer = "train.optimizer=" + json.dumps(
        {"name": optimizer.name, "lr": optimizer.lr, "weight_decay": optimizer.weight_decay})
    plain = measure("gpt2", "ddp", scale, steps, scratch, extra=(same_optimizer,), limits=limits)
    cells = [{**plain, "framework": "ddp (plain GPT-2, Megatron's reference)"}]
    half = f"train.batch_per_gpu={recipe.train.batch_per_gpu // 2}"
    found = torch.cuda.device_count() if torch.cuda.is_available() else 2  # CPU dry run: processes stand in
    for name, gpus, extra in MEGATRON_VARIANTS:
        if gpus > found:
            cells.append({"workload": "gpt2", "framework": name, "gpus": gpus, "wall_s": 0.0,
                          "error": f"needs {gpus} GPUs, found {found}"})
            continue
        cell = measure("gpt2", "megatron", scale, steps, scratch, gpus, (*extra, *((half,) if gpus == 2 else ())), limits)
        cells.append({**cell, "framework": name, **loss_against(cell, plain, TOLERANCE)})
    return cells


def loss_against(cell: dict[str, Any], plain: dict[str, Any],
                 tolerance: dict[tuple[str, str], float]) -> dict[str, Any]:
    """The largest per-step loss difference from the plain run, judged with repro parity's GPU bands."""
    if "error" in cell or "error" in plain or not cell["losses"]:
        return {}
    gap = max(abs(a - b) for a, b in zip(cell["losses"], plain["losses"]))
    limit = tolerance.get((cell["device_type"], cell["precision"]))
    verdict = "measured (no band)" if limit is None else "pass" if gap <= limit else "FAIL"
    return {"max_loss_diff_vs_plain": gap, "tolerance": limit, "verdict": verdict}


def summary(cell: dict[str, Any]) -> str:
    if "error" in cell:
        return "error: " + cell["error"].strip().splitlines()[-1]
    utilisation = "n/a (device not in the peak table)" if cell["mfu"] is None else f"{cell['mfu']:.1%}"
    loss = (f", loss vs plain {cell['max_loss_diff_vs_plain']:.2e} ({cell['verdict']})"
            if "verdict" in cell else "")
    return (f"{cell['samples_per_s']:.1f} samples/s, MFU {utilisation}, "
            f"peak {cell['peak_allocated_bytes'] / 2**30:.2f} GiB{loss}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="paper", choices=["paper", "smoke"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", help="comma-separated workload:framework[:steps] cells, run in this order (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu_check.json")
    parser.add_argument("--cell-timeout", type=float, help="seconds a cell may run before it is killed (default: no limit)")
    parser.add_argument("--budget", type=float, help="seconds for all cells together; later cells get what is left")
    parser.add_argument("--log", type=Path, help="append each cell's command line and full output to this file")
    parser.add_argument("--fused-ops", choices=["first", "last", "skip"], default="first",
                        help="when to build DeepSpeed's fused Adam (the kit's ZeRO steps torch's Adam, not it)")
    args = parser.parse_args()
    # WORKLOAD:FRAMEWORK[:STEPS]: a cell may take fewer steps than --steps (an fp32 pipeline's, say)
    wanted = [(*c.split(":")[:2], int(c.split(":")[2]) if c.count(":") == 2 else args.steps)
              for c in args.only.split(",")] if args.only else [(*c, args.steps) for c in CELLS]
    limits = Limits(args.cell_timeout, args.budget, args.log)
    fused = {"first": build_fused_ops, "last": lambda: {"status": "not built yet"},
             "skip": lambda: {"status": "skipped (--fused-ops skip)"}}[args.fused_ops]()
    report: dict[str, Any] = {"scale": args.scale, "steps": args.steps, "fused_ops": fused, "cells": []}

    def write() -> None:  # after every cell: a check stopped from outside keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))

    write()
    with tempfile.TemporaryDirectory() as tmp:
        for workload, framework, steps in wanted:
            try:
                if (workload, framework) == ("gpt2", "megatron"):
                    cells = megatron_cells(args.scale, steps, Path(tmp), limits)
                else:
                    cells = [measure(workload, framework, args.scale, steps, Path(tmp), limits=limits)]
            except (RecipeError, Unavailable) as error:  # not applicable or not installed: say so, go on
                cells = [skipped(workload, framework, str(error))]
            except Exception as error:  # a cell whose output the check cannot read: record it, go on
                cells = [skipped(workload, framework, f"gpu_check could not read the run: {type(error).__name__}: {error}")]
            for cell in cells:
                cell["steps"] = steps
                report["cells"].append(cell)
                print(f"{workload:<6} {cell['framework']:<11} {cell['wall_s']:6.1f}s  {summary(cell)}", flush=True)
            write()
    if args.fused_ops == "last":
        left = limits.left()
        report["fused_ops"] = (build_fused_ops() if left is None or left > FUSED_BUILD_S
                               else {"status": f"skipped: under {FUSED_BUILD_S} s of the budget left"})
        write()
    print(f"fused ops: {report['fused_ops']}")
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
