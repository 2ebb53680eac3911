"""A one-process run's rank, started before its run folder is ready (`python -m repro.warm.primed MODULE...`).

It imports the loop and `MODULE`s (the run's adapter, workload and frameworks) while the parent makes the
run's folder and MLflow record, then reads the run folder's path from stdin and trains it, as
`python -m repro.loop RUN_DIR` would. Without a line (the parent stopped before the job), it ends at once.
"""
from __future__ import annotations

import importlib
import sys


def main(modules: list[str]) -> None:
    from repro import loop

    for module in modules:
        importlib.import_module(module)
    run_dir = sys.stdin.readline().strip()
    if run_dir:
        loop.main(run_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
