"""Start N ranks of a function, forked from a warm fork server, through torch's own process API.

The ranks are started by `torch.distributed.elastic.multiprocessing.start_processes` (the API torchrun's
agent uses: torch/distributed/elastic/multiprocessing/__init__.py), which for a function entry point
builds a `MultiprocessContext` (api.py): each rank runs `_wrap`, which sets the rank's environment,
redirects its stdout/stderr to RUN_DIR/ranks/.../<rank>/ (tee'd to our stdout with a `[default<rank>]:`
prefix, as torchrun's --tee does) and records an uncaught exception in the rank's error file. With
start_method "forkserver" the processes are forked by Python's fork server (multiprocessing/forkserver.py),
a process that imported the modules of `set_forkserver_preload` once and then only forks: no process
group, no threads, no CUDA (repro.warm.fork_check checks this), so every rank starts from a clean state.

Each rank gets the environment torchrun gives its workers (local_elastic_agent.py, `_start_workers`),
and, as there, connects to a TCPStore hosted by the launching process (TORCHELASTIC_USE_AGENT_STORE):
the store binds a free port itself, so no port is guessed.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, RunProcsResult, Std, start_processes
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from repro.launch import root_cause
from repro.warm.fork_server import preload

START_METHOD = "forkserver"
ROLE = "default"  # torchrun's role name: rank output is prefixed "[default<rank>]:" as under torchrun
STOP_GRACE_S = 30  # after a stop signal, how long ranks have to save before SIGKILL (torchrun's shutdown timeout)
PIDS_FILE = "pids.json"  # in a job's log folder: {rank: pid}
POLL_S = 0.1  # how often a waiting launcher checks its ranks (elastic's TailLog reads at the same pace)


def rank_env(rank: int, world: int, store_port: int, run_id: str) -> dict[str, str]:
    """What torchrun's agent sets for a worker of a one-node job (local_elastic_agent.py, _start_workers)."""
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": ROLE,
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    if world > 1:  # torchrun sets it for several workers a node (run.py), unless the user did
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return env


class Ranks:
    """N ranks started together; they end together (the first failure stops the others, as under torchrun)."""

    def __init__(self, context: PContext, store: dist.TCPStore):
        self.context, self.store = context, store
        self.result: RunProcsResult | None = None
        self.stopped_by: signal.Signals | None = None

    @property
    def pids(self) -> dict[int, int]:
        return self.context.pids()

    def poll(self) -> bool:
        """Whether all ranks have ended."""
        if self.result is None and self.stopped_by is None:
            self.result = self.context.wait(0)
        return self.result is not None or self.stopped_by is not None

    def wait(self, timeout: float = -1) -> bool:
        """Until all ranks have ended or `timeout` seconds have passed (forever when negative)."""
        if not self.poll():
            self.result = self.context.wait(timeout, period=POLL_S)
        return self.poll()

    def stop(self, signum: int, grace_s: float = STOP_GRACE_S) -> None:
        """Send `signum` to every rank; SIGKILL what still runs after `grace_s` (PContext.close)."""
        self.stopped_by = signal.Signals(signum)
        self.context.close(self.stopped_by, timeout=int(grace_s))

    def exit_codes(self) -> dict[int, int | None]:
        """Each rank's exit code (None while it runs); negative: killed by that signal."""
        processes = self.context._pc.processes  # MultiprocessContext keeps torch's ProcessContext here (api.py)
        return {rank: process.exitcode for rank, process in enumerate(processes)}

    def returncode(self) -> int:
        """The launcher's exit code, as torchrun's: 0 when every rank succeeded, else 1."""
        return 0 if self.result is not None and not self.result.is_failed() and self.stopped_by is None else 1

    def failure_summary(self) -> str | None:
        """torchrun's failure summary (ChildFailedError.format_msg: the root cause rank and exit code), or None."""
        if self.result is None or not self.result.is_failed():
            return None
        return ChildFailedError(name=ROLE, failures=self.root_failure()).format_msg()

    def root_failure(self) -> dict[int, ProcessFailure]:
        """The failure to blame (launch.root_cause): torch's MultiprocessContext reports the lowest failed
        rank, which is a killed rank's peer when both are found ended in the same poll."""
        failed = {rank: code for rank, code in self.exit_codes().items() if code}
        reported = self.result.failures
        rank = root_cause({**{r: failed[r] for r in reported if r in failed}, **failed})
        if rank in reported:
            return {rank: reported[rank]}
        process = self.context._pc.processes[rank]
        return {rank: ProcessFailure(local_rank=rank, pid=process.pid, exitcode=process.exitcode,
                                     error_file=self.context.error_files[rank])}


def start(
    entry: Callable[..., Any], nprocs: int, args: tuple = (), log_dir: Path | None = None,
    preload_modules: Sequence[str] = (),
) -> Ranks:
    """Start `nprocs` ranks of `entry(*args)` (a module-level function), forked from the warm fork server
    (started with `preload_modules` if this process has none yet). Each rank's output goes to
    `log_dir` (a temporary folder if None) and, prefixed with its rank, to this process's stdout/stderr;
    `log_dir`/pids.json says which process is which rank."""
    preload(preload_modules)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_id = uuid.uuid4().hex[:12]
    envs = {rank: rank_env(rank, nprocs, store.port, run_id) for rank in range(nprocs)}
    logs = DefaultLogsSpecs(log_dir=str(log_dir) if log_dir else None, tee=Std.ALL)
    context = start_processes(ROLE, entry, dict.fromkeys(range(nprocs), args), envs, logs, start_method=START_METHOD)
    if log_dir:  # a forked rank's /proc/PID/environ is its fork server's: this says which process is which rank
        (log_dir / PIDS_FILE).write_text(json.dumps(context.pids()))
    return Ranks(context, store)


def run(entry: Callable[..., Any], nprocs: int, args: tuple = (), log_dir: Path | None = None,
        preload_modules: Sequence[str] = ()) -> dict[int, int | None]:
    """Start `nprocs` ranks of `entry(*args)`, wait for them, and return each rank's exit code."""
    ranks = start(entry, nprocs, args, log_dir, preload_modules)
    ranks.wait()
    return ranks.exit_codes()


def loop_rank(run_dir: str) -> None:
    """A rank of the training loop (repro.loop); its exit code is the loop's (128 + signal after a stop)."""
    from repro import loop

    code = loop.train(run_dir)
    sys.stdout.flush()
    if code:
        sys.exit(code)

