"""The fork server that warm ranks are forked from (Python's multiprocessing/forkserver.py), without torch.

The server is a process of its own that imports the modules of `set_forkserver_preload` once and then
only forks. Starting it needs no torch here, so a launcher starts it first and imports torch itself
while the server imports torch and the frameworks: on two cores the two imports overlap.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
from typing import Sequence

# What every rank imports on its way to its first step, whatever its framework. Beyond the loop, found by
# profiling a forked rank (20 of its 23 s to the first step were imports, at load 13): the loop's
# torch.use_deterministic_algorithms imports torch._inductor (and with it dynamo, sympy), repro.optim's
# LAMB comes from timm.optim.
ALWAYS_WARM = ("torch", "torch.distributed", "torch.distributed.elastic.multiprocessing", "torch._inductor",
               "timm.optim", "repro.loop", "repro.warm.ranks")
PRELOAD_ENV = "REPRO_WARM_PRELOAD"  # the modules the fork server was asked to import (repro.warm.fork_check)
# Libraries that start a thread as they load, found by repro.warm.fork_check (and gdb): numpy (imported by
# torch) loads OpenBLAS, which starts a thread per core unless told not to (the ranks use one thread each on
# CPU anyway, repro.loop); DeepSpeed imports pyarrow, whose jemalloc starts a background purging thread.
FORK_SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}


def preload(modules: Sequence[str] = ()) -> list[str]:
    """Start this process's fork server with `modules` (and torch and the loop) imported; returns the list.

    The server is started at most once per process (multiprocessing keeps one); its modules are fixed
    from then on. The check module goes last: it fails the fork server if importing left threads or
    CUDA behind (repro.warm.fork_check)."""
    wanted = list(dict.fromkeys([*ALWAYS_WARM, *modules]))
    multiprocessing.set_forkserver_preload([*wanted, "repro.warm.fork_check"])
    saved = dict(os.environ)
    os.environ.update({PRELOAD_ENV: ",".join(wanted), **FORK_SERVER_ENV})
    try:
        multiprocessing.forkserver.ensure_running()  # the fork server starts with this environment
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return wanted


def stop_helpers() -> None:
    """End this process's fork server and resource tracker, and wait for both: reaped here, neither outlives
    this process (an orphan that ends becomes a zombie where PID 1 reaps nothing, as in a container). Each
    `_stop` closes the helper's "alive" pipe and waits for it (Lib/multiprocessing/forkserver.py and
    resource_tracker.py); the standard library's own tests stop them so. A helper not started is left alone."""
    multiprocessing.forkserver._forkserver._stop()
    multiprocessing.resource_tracker._resource_tracker._stop()
