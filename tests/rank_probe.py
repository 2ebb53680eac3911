"""Functions that warm ranks run in tests/test_warm.py (a small module: each rank imports it)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")


def report(out: str) -> None:
    """Write what this rank was given and how it started, then sum its rank over a gloo group."""
    import torch
    import torch.distributed as dist

    from repro.warm import fork_check

    started = {"env": {k: os.environ.get(k) for k in ENV_KEYS}, "unsafe": fork_check.problems(),
               "threads": len(os.listdir("/proc/self/task")), "cuda": torch.cuda.is_initialized()}
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    dist.destroy_process_group()
    print(f"rank {os.environ['RANK']} summed {total.item():g}", flush=True)
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps({**started, "sum": total.item()}))


def fail_on_rank_one(code: str) -> None:
    """Rank 1 exits with `code` at once; the others wait to be stopped."""
    if os.environ["RANK"] == "1":
        sys.exit(int(code))
    time.sleep(120)


def save_on_stop(out: str) -> None:
    """Like the training loop: a stop signal is noted, the rank 'saves' and exits with 128 + the signal."""
    stopped = []
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, lambda number, frame: stopped.append(number))
    print(f"rank {os.environ['RANK']} ready", flush=True)
    while not stopped:
        time.sleep(0.05)
    Path(out, f"rank{os.environ['RANK']}.saved").write_text(signal.Signals(stopped[0]).name)
    sys.exit(128 + stopped[0])
