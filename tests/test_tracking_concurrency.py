"""Two runs logging to one sqlite MLflow store at the same time lose no metric of either."""
from __future__ import annotations

import collections
import json

import pytest

from conftest import read_events
from repro.tracking import event_metrics

pytestmark = pytest.mark.end_to_end


def test_two_runs_at_once_lose_no_metric(repro):
    from mlflow.tracking import MlflowClient

    args = ("run", "gpt2", "--gpus", "1", "--epochs", "2", "--set", "data.max_train_samples=256",
            "--set", "data.max_val_samples=32")
    jobs = {name: repro.start(*args, "--seed", str(seed), "--run-dir", f"runs/{name}", log=f"{name}.txt")
            for seed, name in enumerate(("a", "b"))}
    for name, job in jobs.items():
        assert job.wait(timeout=300) == 0, (repro.cwd / f"{name}.txt").read_text()

    client = MlflowClient(repro.tracking_uri)
    for name in jobs:
        run_dir = repro.cwd / "runs" / name
        run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
        expected = collections.defaultdict(list)
        for event in read_events(run_dir):
            for key, value, step in event_metrics(event):
                expected[key].append((step, float(value)))
        assert len(expected["train/loss"]) == 2 * 256 // 8
        logged = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in expected}
        assert logged == {key: sorted(values) for key, values in expected.items()}
