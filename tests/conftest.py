"""Shared test helpers: run the real `repro` command in a scratch folder and read what it recorded."""
from __future__ import annotations

import json
import os
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

    def run_dirs(self) -> list[Path]:
        return sorted((self.cwd / "runs").glob("*"), key=lambda p: p.stat().st_mtime)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dirs()[-1] / "events.jsonl").read_text().splitlines()]

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
