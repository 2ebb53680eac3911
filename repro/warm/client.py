"""The parent's side of warm ranks (no torch): a warm launcher process, and the jobs run in it.

`Launcher` starts `python -m repro.warm` (repro.warm.__main__) with the modules its jobs need; the
launcher's fork server imports them once, and every job after that forks its ranks from it. `repro run`
starts one for its job; `repro table2` keeps one for the whole matrix. A `WarmJob` looks to whoever
supervises it like the launcher process of its job: it has an output stream, can be sent a stop
signal, polled and waited for, and names the processes of its ranks, to be killed if they linger.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence, TextIO

import psutil

from repro import launch
from repro.warm import channel as messages

CLOSE_WAIT_S = 10  # how long a closing launcher may take to end before it is killed


class LauncherGone(RuntimeError):
    """The warm launcher process ended (or closed its channel) while a job needed it."""


class WarmJob:
    """One job of a warm launcher, seen as a process: `stdout`, `poll`, `send_signal`, `returncode`."""

    def __init__(self, launcher: "Launcher", entry: str, nprocs: int, args: Sequence[str], log_dir: Path | None):
        self.launcher = launcher
        read_end, write_end = os.pipe()
        job = {"entry": entry, "args": list(args), "nprocs": nprocs, "log_dir": str(log_dir) if log_dir else None}
        messages.send(launcher.channel, {"job": job}, [write_end])
        os.close(write_end)  # the launcher holds the only write end: its end is the output's end
        self.stdout: TextIO = os.fdopen(read_end, "r", errors="replace")
        self.returncode: int | None = None
        self.exit_codes: dict[str, int | None] = {}
        self.ranks: list[psutil.Process] = []
        reply = self.next_message(timeout=None)
        if reply is not None and "pids" in reply:
            self.ranks = [psutil.Process(pid) for _, pid in sorted(reply["pids"].items(), key=lambda kv: int(kv[0]))]

    def next_message(self, timeout: float | None) -> dict | None:
        if self.returncode is not None:
            return None
        if timeout is not None and not select.select([self.launcher.channel], [], [], timeout)[0]:
            return None
        message, _ = messages.receive(self.launcher.channel)
        if message is None:  # the launcher is gone: so is the job
            self.returncode = self.launcher.process.wait() or 1
        elif "returncode" in message:
            self.returncode, self.exit_codes = message["returncode"], message["exit_codes"]
        return message

    def poll(self) -> int | None:
        while self.returncode is None and self.next_message(timeout=0) is not None:
            pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.next_message(timeout)
        return self.poll()

    def send_signal(self, signum: int) -> None:
        """Stop the job: the launcher sends `signum` to every rank, which has time to save (STOP_GRACE_S)."""
        if self.returncode is None:
            with contextlib.suppress(OSError):  # a launcher already gone: poll says so
                messages.send(self.launcher.channel, {"signal": int(signum)})

    def roots(self) -> list[psutil.Process]:
        """The processes at the top of the job: its ranks (the launcher outlives the job)."""
        return list(self.ranks)

    def exit_notice(self) -> int:
        """A descriptor of our own that becomes readable when the launcher has news of the job (its end)."""
        return os.dup(self.launcher.channel.fileno())

    def processes(self) -> list[psutil.Process]:
        """The job's ranks and everything under them that still runs."""
        found = []
        for rank in self.ranks:
            try:
                found += [rank, *rank.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return found


class Launcher:
    """A warm launcher process and the channel to it; jobs run in it one after another."""

    def __init__(self, preload: Sequence[str] = (), python: str = sys.executable):
        self.channel, theirs = messages.pair()
        self.command = launch.warm_launcher(theirs.fileno(), preload, python)
        self.process = subprocess.Popen(self.command, pass_fds=[theirs.fileno()], start_new_session=True)
        theirs.close()

    def start(self, entry: str, nprocs: int, args: Sequence[str] = (), log_dir: Path | None = None) -> WarmJob:
        """Start `nprocs` ranks of `entry` ("module:function") with `args`; their output is in the job's stdout
        and, per rank, under `log_dir` (a temporary folder if None)."""
        if self.process.poll() is not None:
            raise LauncherGone(f"the warm launcher exited with {self.process.returncode}")
        return WarmJob(self, entry, nprocs, args, log_dir)

    def close(self) -> None:
        """End the launcher (its channel's end tells it to), killing it if it does not end in time."""
        self.channel.close()
        try:
            self.process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
