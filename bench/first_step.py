"""How long a standalone `repro run` on CPU stand-ins takes to reach its first step, next to how long
importing what its ranks need takes (issue 30's goal: within 1 s more).

The first step is the reporting rank's start event (written after imports, process group, model and
framework setup, just before the first step), measured from the moment the command is started. The
import is a fresh `python -c "import ..."` of the modules a warm fork server imports for the run
(repro.warm.fork_server.ALWAYS_WARM and repro.warm.plan.preload), made right after each run.

    python bench/first_step.py [--repeats 3] -- gpt2 --framework ddp --gpus 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from repro import events
from repro.recipe import load_file, recipe_path
from repro.runfiles import RunFolder
from repro.warm import plan
from repro.warm.fork_server import ALWAYS_WARM


def run_once(args: list[str], folder: Path) -> dict[str, float]:
    run_dir = folder / f"run-{time.monotonic_ns()}"
    begun = time.time()
    subprocess.run([sys.executable, "-m", "repro.cli", "run", *args, "--max-steps", "3", "--run-dir", str(run_dir)],
                   check=True, capture_output=True, cwd=folder)
    (start,) = [e for e in events.read_all(RunFolder(run_dir).events_file) if e["event"] == events.START]
    return {"first_step_s": start["wall"] - begun, "load": os.getloadavg()[0]}


def import_s(modules: list[str]) -> float:
    begun = time.time()
    subprocess.run([sys.executable, "-c", "import " + ", ".join(modules)], check=True, capture_output=True)
    return time.time() - begun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("run", nargs="+", help="the arguments of `repro run` (model and options)")
    args = parser.parse_args()
    model, framework = args.run[0], args.run[args.run.index("--framework") + 1] if "--framework" in args.run else "ddp"
    modules = list(dict.fromkeys([*ALWAYS_WARM, *plan.preload([load_file(recipe_path(model, "smoke"),
                                                                         [f"run.framework={framework}"])])]))
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{folder}/mlflow.db")
        run_once(args.run, folder)  # makes the store: its first use creates MLflow's tables
        rows = [{**run_once(args.run, folder), "import_s": import_s(modules)} for _ in range(args.repeats)]
    for row in rows:
        print(json.dumps({k: round(v, 2) for k, v in row.items()}))
    first, imported = statistics.median(r["first_step_s"] for r in rows), statistics.median(r["import_s"] for r in rows)
    print(f"median first step {first:.2f} s, import {imported:.2f} s: {first - imported:+.2f} s "
          f"(goal: at most +1 s); load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
