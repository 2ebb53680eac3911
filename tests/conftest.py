"""Shared test helpers: run the real `repro` command in a scratch folder and read what it recorded."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    cwd: Path

    @property
    def run_dir(self) -> Path:
        """The run folder that this command reported (`files in ...` or `output kept in ...`)."""
        found = re.search(r"(?:files in|output kept in) (\S+)", self.stderr)
        assert found, f"no run folder reported:\n{self.stderr[-2000:]}"
        return Path(found.group(1))

    def events(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.events() if e["event"] == "step"]


class Repro:
    """Runs `python -m repro.cli ...` in a scratch folder with its own MLflow store."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.env = {**os.environ, "REPRO_DATA": str(REPO / "data"), "MLFLOW_TRACKING_URI": f"sqlite:///{cwd}/mlflow.db"}
        self.env.pop("REPRO_CONFIGS", None)

    def __call__(self, *args: str, timeout: int = 600) -> Result:
        out = subprocess.run(
            [sys.executable, "-m", "repro.cli", *args], cwd=self.cwd, env=self.env,
            capture_output=True, text=True, timeout=timeout,
        )
        return Result(out.returncode, out.stdout, out.stderr, self.cwd)

    @property
    def tracking_uri(self) -> str:
        return self.env["MLFLOW_TRACKING_URI"]


@pytest.fixture
def repro(tmp_path: Path) -> Repro:
    return Repro(tmp_path)


@pytest.fixture(scope="module")
def shared_repro(tmp_path_factory: pytest.TempPathFactory) -> Repro:
    """One scratch folder and MLflow store for all tests of a module (to share expensive runs)."""
    return Repro(tmp_path_factory.mktemp("repro"))


def mlflow_runs(uri: str, experiment: str = "repro") -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []
