"""Names of the files in a run folder that more than one layer reads.

The runner writes them, the training loop and framework drivers (LBANN's) read them: the names live
here, below all three, so that no lower layer imports an upper one to learn a file name.
"""
from __future__ import annotations

from pathlib import Path

RUN_FILE = "run.json"  # the resolved recipe and where the data is: the input of every process of a run
RUNS_DIR = Path("runs")  # where `repro run` makes run folders, relative to where it runs
