"""Command lines, built by pure functions so they can be printed (--dry-run) and tested."""
from __future__ import annotations

import sys
from pathlib import Path

LOOP_MODULE = "repro.loop"


def torchrun_local(processes: int, run_dir: Path, python: str = sys.executable) -> list[str]:
    """PyTorch's own launcher on this machine: `processes` workers, rendezvous on a free local port."""
    return [
        python, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes), "--max-restarts", "0",
        "-m", LOOP_MODULE, str(run_dir),
    ]
