"""Imported last by the fork server (repro.warm.fork_server.preload): fails it unless it is safe to fork ranks from.

Forking copies a process's memory, not its threads: a lock held by a thread that the child does not
have stays held forever, and a CUDA context does not survive a fork at all. So the server must have
imported what the ranks need and initialised nothing: one thread, no CUDA. It must also have imported
every module it was asked to: Python's fork server skips the rest of its list silently at the first
ImportError (multiprocessing/forkserver.py, `main`), and a rank would then import it from cold.
Any of these fails the fork server at its start, with the reason, rather than ranks that may hang.
"""
from __future__ import annotations

import os
import sys

from repro.warm.fork_server import PRELOAD_ENV


def problems() -> list[str]:
    """Why this process is not safe to fork ranks from (empty when it is)."""
    found = []
    wanted = [name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name]
    missing = [name for name in wanted if name not in sys.modules]
    if missing:
        found.append(f"not imported: {', '.join(missing)} (an ImportError in the list stops the rest)")
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        found.append(f"{threads} threads after importing (a fork keeps only the calling one)")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        found.append("CUDA is initialised (a CUDA context does not survive a fork)")
    return found


if found := problems():
    raise RuntimeError("repro.warm: the fork server is not safe to fork ranks from: " + "; ".join(found))
