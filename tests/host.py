"""What the tests need from this host: Debian's programs (tests/debian-packages.txt) and free ports.

A test whose program is missing fails in one line that names the package, never a traceback or a skip:
a service test that cannot run has not passed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path

import pytest

PACKAGES_FILE = Path(__file__).with_name("debian-packages.txt")
# PostgreSQL's server programs live outside PATH (Debian's postgresql-common wraps them per version).
PG_BIN = Path("/usr/lib/postgresql/15/bin")


def package_of(program: str) -> str:
    """The Debian package that provides `program`, from tests/debian-packages.txt."""
    for line in PACKAGES_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, *programs = line.split()
            if program in programs:
                return package
    raise KeyError(f"{program} is not listed in {PACKAGES_FILE.name}")


def search_path() -> str:
    """Where the tests look for Debian's programs: $REPRO_TEST_PROGRAMS_PATH where set, else PostgreSQL's
    bin (first: /usr/bin/createdb is postgresql-common's wrapper, which picks a cluster of its own), PATH and
    /usr/sbin (the daemons, outside an ordinary user's PATH)."""
    return os.environ.get("REPRO_TEST_PROGRAMS_PATH") or f"{PG_BIN}:{os.environ.get('PATH', '')}:/usr/sbin"


def need(*names: str) -> None:
    """Fails the test in one line naming the Debian packages to install when any program of `names` is missing."""
    missing = [name for name in names if not shutil.which(name, path=search_path())]
    if missing:
        packages = " ".join(dict.fromkeys(package_of(name) for name in missing))
        pytest.fail(f"needs {', '.join(missing)}: install Debian's {packages} "
                    f"(`make test-deps`, or apt-get install {packages})", pytrace=False)


def program(name: str) -> str:
    """Path of Debian program `name`; fails the test in one line naming its package when it is missing."""
    need(name)
    return shutil.which(name, path=search_path())


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (held together while picking, so they differ)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    return free_ports(1)[0]
