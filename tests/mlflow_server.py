"""A real MLflow tracking server on Debian's PostgreSQL, for the tracking tests.

PostgreSQL: a cluster made by `initdb` in a temporary folder, run by `pg_ctl` as an unprivileged
user (`postgres` when the tests run as root), listening on 127.0.0.1 and a socket in that folder.
MLflow: `mlflow server` on it through the driver pinned in requirements.txt (psycopg 3, which
SQLAlchemy 2.1 picks for a plain postgresql:// URI), artifacts in the same folder. Both on ports
picked free at start; `stop` and `start` make an outage of the server while the database stays.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from host import free_port, program

POSTGRESQL = ("initdb", "pg_ctl", "createdb")  # the server programs this fixture runs
PG_USER = "postgres"  # initdb refuses to run as root
START_TIMEOUT_S = 600  # minutes on a loaded machine: the server imports its whole app
STOP_TIMEOUT_S = 20


def as_cluster_owner(command: list[str]) -> list[str]:
    return ["runuser", "-u", PG_USER, "--", *command] if os.geteuid() == 0 else command


class PostgresCluster:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="repro-pg-"))
        self.port = free_port()
        if os.geteuid() == 0:
            shutil.chown(self.folder, PG_USER, PG_USER)
        self.data = self.folder / "data"
        self.run([program("initdb"), "-D", str(self.data), "-A", "trust", "-U", "repro", "--no-sync",
                  "-E", "UTF8"])
        self.run([program("pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "postgres.log"), "-w",
                  "-o", f"-h 127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off", "start"])
        self.run([program("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "repro", "mlflow"])
        self.uri = f"postgresql://repro@127.0.0.1:{self.port}/mlflow"

    def run(self, command: list[str]) -> None:
        subprocess.run(as_cluster_owner(command), check=True, capture_output=True, cwd=self.folder)

    def stop(self) -> None:
        self.run([program("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        shutil.rmtree(self.folder, ignore_errors=True)


class MlflowServer:
    """`mlflow server` on a PostgreSQL store; `stop` then `start` again on the same port is an outage."""

    def __init__(self, store_uri: str, folder: Path, start: bool = True):
        self.store_uri, self.folder = store_uri, folder
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        if start:  # else its address is known before it answers: a server that is down
            self.start()

    def start(self) -> None:
        log = open(self.folder / "mlflow-server.log", "a")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", self.store_uri,
             "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # GenAI jobs: not needed here
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.folder / "mlflow-server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"mlflow server on {self.uri} not up in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        """Stop the server and every process it started (uvicorn workers), as a whole."""
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # uvicorn's graceful shutdown can take long on a loaded machine
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None


@pytest.fixture(scope="session")
def tracking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One PostgreSQL-backed MLflow server for the session; at the end it must hold no RUNNING run."""
    from conftest import running_runs

    cluster = PostgresCluster()
    server = None
    try:
        server = MlflowServer(cluster.uri, tmp_path_factory.mktemp("mlflow-server"))
        yield server
        left = running_runs(server.uri)
        assert not left, f"RUNNING runs left behind in {server.uri}: {left}"
    finally:
        try:
            if server:
                server.stop()
        finally:
            cluster.stop()
