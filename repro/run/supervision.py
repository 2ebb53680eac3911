"""The job's process tree, from start to the last process gone: output kept, stop signals forwarded.

A `Job` starts the launcher (torchrun, or srun's steps) in a session of its own and stops it as a
whole: stop signals sent to `repro run` (Ctrl-C, SIGTERM, SIGUSR1) are forwarded to the launcher,
which forwards them to the workers: they save a checkpoint and stop. Whatever still runs after the
grace period, or after the launcher has exited, is killed, so no process outlives the run.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, TextIO

import psutil

POLL_S = 0.5  # the follower's loop: new events, heartbeat, grace periods (the launcher's exit wakes it at once)
# How often the follower lists the job's processes, to kill any left behind at the end (torchrun starts
# its workers in sessions of their own, beyond the reach of the launcher's process group). A listing
# reads all of /proc (about 1 ms of CPU here): every loop it would steal from the ranks it watches.
SCAN_EVERY_S = 2.0
STOP_GRACE_S = 45  # after a stop signal, torchrun gives its workers 30 s to save before killing them
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class OutputPump(threading.Thread):
    """Copies the job's output to the terminal and the run folder."""

    def __init__(self, stream: TextIO, log: Path, echo: Callable[[str], None]):
        super().__init__(daemon=True)
        self.stream, self.log, self.echo = stream, log, echo

    def run(self) -> None:
        with open(self.log, "a") as log:
            for line in self.stream:
                log.write(line)
                log.flush()
                self.echo(line.rstrip("\n"))


def exit_notice(pid: int) -> int | None:
    """A descriptor that becomes readable when process `pid` exits (Linux's pidfd), so that waiting for
    it needs no polling; None where the system has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class LauncherProcess(subprocess.Popen):
    """The job's launcher (torchrun, srun's steps, a single rank) with its output piped, in a session of its
    own: a terminal's Ctrl-C reaches only us; we stop the job in order."""

    def __init__(self, command: list[str], stdin: int | None = None):
        super().__init__(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         start_new_session=True)

    def roots(self) -> list[psutil.Process]:
        """The processes at the top of the job: the launcher, whose tree holds the rest."""
        return [psutil.Process(self.pid)]

    def exit_notice(self) -> int | None:
        return exit_notice(self.pid)


class Job:
    """The launcher and every process under it, stopped as a whole.

    The launcher is a process started here from a command line, or one already running that looks like one
    (repro.warm.client.WarmJob: a job of a warm launcher, whose roots are its ranks)."""

    def __init__(self, launched: list[str] | LauncherProcess, output: Path, echo: Callable[[str], None]):
        self.process = LauncherProcess(launched) if isinstance(launched, list) else launched
        self.output = output
        self.pump = OutputPump(self.process.stdout, output, echo)
        self.pump.start()
        self.roots = self.process.roots()
        self.seen: set[psutil.Process] = set()
        self.scanned_at = -SCAN_EVERY_S
        self.exited = self.process.exit_notice()
        self.stop_signal: signal.Signals | None = None
        self.stop_sent_at = 0.0
        self.returncode: int | None = None

    def forward(self, signum: int, frame: object) -> None:
        self.stop_signal = signal.Signals(signum)
        self.stop_sent_at = self.stop_sent_at or time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)

    @contextlib.contextmanager
    def forwarding_signals(self) -> Iterator[None]:
        previous = {signum: signal.signal(signum, self.forward) for signum in FORWARDED_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.kill_leftovers()

    def wait(self, seconds: float) -> None:
        """Until the launcher exits or `seconds` pass."""
        if self.exited is None:
            time.sleep(seconds)
        else:
            select.select([self.exited], [], [], seconds)

    def finished(self) -> bool:
        if time.monotonic() - self.scanned_at >= SCAN_EVERY_S:
            self.scanned_at = time.monotonic()
            for root in self.roots:
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.seen.update(root.children(recursive=True))
        if self.stop_sent_at and time.monotonic() - self.stop_sent_at > STOP_GRACE_S:
            self.kill_leftovers()
        if self.process.poll() is None:
            return False
        self.returncode = self.process.returncode
        if self.exited is not None:
            os.close(self.exited)
            self.exited = None
        self.kill_leftovers()
        self.pump.join(timeout=10)
        return True

    def kill_leftovers(self) -> None:
        for process in [*self.roots, *self.seen]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def run_to_end(self) -> int:
        """Wait out the job, forwarding stop signals; its exit code."""
        with self.forwarding_signals():
            while not self.finished():
                self.wait(POLL_S)
        return self.returncode
