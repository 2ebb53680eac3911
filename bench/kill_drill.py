"""The kill drill: SIGKILL one rank of a running job; when `repro run` returns, is any of its processes left?

Each try starts `repro run gpt2 --framework ddp --gpus 2 --epochs 50` in a scratch folder, waits for its
first step, kills rank 1, waits for `repro run` to return, and lists the job's processes (the launcher, its
fork server and resource tracker, the ranks: every descendant seen before the kill) that still exist at
that moment, running or zombie. tests/test_faults.py asserts the same for one try.

    python bench/kill_drill.py --tries 10          # one JSON line per try, then the count of clean tries
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["run", "gpt2", "--framework", "ddp", "--gpus", "2", "--epochs", "50", "--run-dir", "runs/drill"]


def first_step(run_dir: Path, job: subprocess.Popen, timeout_s: float = 180) -> None:
    events = run_dir / "events.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (events.exists() and '"event": "step"' in events.read_text()):
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or did not reach its first step (exit {job.poll()})")
        time.sleep(0.2)


def one_try(scratch: Path) -> dict:
    env = {**os.environ, "REPRO_DATA": str(ROOT / "data"), "MLFLOW_TRACKING_URI": f"sqlite:///{scratch}/mlflow.db"}
    job = subprocess.Popen([sys.executable, "-m", "repro.cli", *COMMAND], cwd=scratch, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = scratch / "runs" / "drill"
    first_step(run_dir, job)
    processes = psutil.Process(job.pid).children(recursive=True)
    pids = json.loads(next(run_dir.rglob("pids.json")).read_text())
    os.kill(int(pids["1"]), signal.SIGKILL)
    killed = time.monotonic()
    returncode = job.wait(timeout=120)
    returned_s = time.monotonic() - killed
    left = [{"pid": p.pid, "status": p.status(), "name": p.name()} for p in processes if p.is_running()]
    return {"returncode": returncode, "returned_after_kill_s": round(returned_s, 2), "processes": len(processes),
            "left": left, "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=10)
    args = parser.parse_args()
    clean = 0
    for _ in range(args.tries):
        scratch = Path(tempfile.mkdtemp(prefix="kill-drill-"))
        try:
            result = one_try(scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        clean += result["returncode"] != 0 and not result["left"]
        print(json.dumps(result), flush=True)
    print(f"{clean} of {args.tries} tries: the run failed and left no process behind")


if __name__ == "__main__":
    main()
