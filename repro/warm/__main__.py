"""The warm launcher process: `python -m repro.warm --channel FD --preload MODULE,...`.

It starts the fork server with MODULES (and torch and the training loop) imported, imports torch's
process API itself meanwhile, and then runs one job at a time for the parent at the other end of its
channel (repro.warm.channel): N ranks of a function, forked from the server (repro.warm.ranks). A job's
output (the ranks' lines with their `[default<rank>]:` prefix, this process's own messages, and
torchrun's failure summary when a rank fails) goes to the pipe handed over with the job. A stop signal
from the parent reaches every rank, which has STOP_GRACE_S to save before it is killed, as under
torchrun. When the parent goes, the launcher stops its ranks and ends. It ends its fork server, and
reaps any rank left to it, before it exits: when the parent's wait for it returns, no process of its jobs is left.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import select
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Iterator

from repro.launch import TORCHRUN_SIGNALS
from repro.warm import channel as messages
from repro.warm.fork_server import preload, stop_helpers


@contextlib.contextmanager
def output_to(fd: int) -> Iterator[None]:
    """This process's stdout and stderr (Python's and C's) go to `fd` until the block ends; then `fd` is closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    for stream in (sys.stdout, sys.stderr):  # torch's TailLog writes the ranks' tee'd lines without a flush
        stream.reconfigure(line_buffering=True)  # (elastic/multiprocessing/tail_log.py, tail_logfile)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BrokenPipeError):
                stream.flush()
        for target, original in zip((1, 2), saved):
            os.dup2(original, target)
            os.close(original)
        os.close(fd)


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def adopt_orphans() -> None:
    """Become the reaper of our orphaned descendants (Linux's PR_SET_CHILD_SUBREAPER): a rank whose fork server
    has ended is re-parented here rather than to PID 1, which in a container often reaps nothing, so that
    `end_children` can reap it. Elsewhere (no prctl) the system's init does."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_children() -> None:
    """Kill and reap whatever is still a child of ours: the parent's wait for this process then covers every
    process of its jobs."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)


def say(text: str) -> None:
    """A line of the job's output; none when nobody reads it any more (the parent has gone)."""
    with contextlib.suppress(BrokenPipeError):
        print(text, file=sys.stderr, flush=True)


def entry_point(dotted: str):
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


def run_job(channel: socket.socket, job: dict) -> bool:
    """Run one job to its end; False when the parent has gone (the launcher should end)."""
    from torch.distributed.elastic.multiprocessing import SignalException

    from repro.warm import ranks

    parent_here, group = True, None
    try:
        group = ranks.start(entry_point(job["entry"]), job["nprocs"], tuple(job["args"]),
                             Path(job["log_dir"]) if job["log_dir"] else None)
        messages.send(channel, {"pids": group.pids})
        while not group.poll():
            if not select.select([channel], [], [], ranks.POLL_S)[0]:
                continue
            message, _ = messages.receive(channel)
            parent_here = message is not None
            if not parent_here or "signal" in message:
                group.stop(message["signal"] if parent_here else signal.SIGTERM)
    except SignalException as stop:  # this process itself was told to stop (elastic's handler, api.py)
        if group is not None:
            group.stop(stop.sigval)
        parent_here = False
    except Exception:
        traceback.print_exc()
    if group is not None and group.failure_summary():
        say(group.failure_summary())
    if group is not None and group.stopped_by:
        say(f"repro.warm: ranks stopped by {group.stopped_by.name}")
    returncode = group.returncode() if group is not None else 1
    exit_codes = group.exit_codes() if group is not None else {}
    if parent_here:
        messages.send(channel, {"returncode": returncode, "exit_codes": exit_codes})
    return parent_here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channel", type=int, required=True, help="descriptor of this launcher's end of the channel")
    parser.add_argument("--preload", default="", help="modules the fork server imports, comma-separated")
    args = parser.parse_args()
    adopt_orphans()  # before the fork server starts: the ranks it forks are our descendants
    preload([name for name in args.preload.split(",") if name])  # the fork server imports while we do
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = TORCHRUN_SIGNALS  # as torchrun's, with SIGUSR1
    from repro.warm import ranks  # noqa: F401  (torch's process API, imported while the fork server starts)

    channel = socket.socket(fileno=args.channel)
    try:
        serve(channel)
    finally:  # the ranks have ended: their fork server, and any rank it left, go before we do
        stop_helpers()
        end_children()


def serve(channel: socket.socket) -> None:
    """Run the parent's jobs one after another until it closes the channel or goes."""
    while True:
        message, fds = messages.receive(channel)
        if message is None:
            return
        if "job" in message:
            with output_to(fds[0]):
                if not run_job(channel, message["job"]):
                    return


if __name__ == "__main__":
    main()
