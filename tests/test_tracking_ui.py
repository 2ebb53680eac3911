"""The MLflow UI as users meet it: `make mlflow-ui` prints the runs view's address, and headless
Chromium finds a run's dataset digest and git commit on the pages it opens."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request

import pytest

from conftest import REPO, Repro
from host import free_port, program
from mlflow_server import POSTGRESQL, START_TIMEOUT_S
from test_tracking_server import isolate_caches

pytestmark = [pytest.mark.services, pytest.mark.programs(*POSTGRESQL, "chromium")]

PAGE_BUDGET_MS = 30000  # Chromium's virtual time for the single-page app to fetch and render
WINDOW = "3000,1400"  # wide enough for the runs table to show its Dataset, Source and Version columns


def page_text(url: str) -> str:
    """The visible text of `url` once headless Chromium has rendered it."""
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            [program("chromium"), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
             f"--window-size={WINDOW}", f"--virtual-time-budget={PAGE_BUDGET_MS}", "--dump-dom", url],
            capture_output=True, text=True, timeout=300,
        ).stdout
    without_code = re.sub(r"<script.*?</script>|<style.*?</style>", "", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", without_code))


@pytest.fixture
def ui(tracking_server) -> str:
    """`make mlflow-ui` on the PostgreSQL store; the runs view address it printed."""
    port = free_port()
    process = subprocess.Popen(
        ["make", "--no-print-directory", "mlflow-ui", f"MLFLOW_STORE={tracking_server.store_uri}",
         f"MLFLOW_PORT={port}", "EXPERIMENT=ui"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        first = process.stdout.readline()
        address = first.removeprefix("runs view: ").strip()
        assert first.startswith("runs view: http://127.0.0.1:"), first
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "mlflow ui did not start"
                time.sleep(0.5)
        yield address
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_runs_view_shows_dataset_digest_and_commit(repro: Repro, tracking_server, request) -> None:
    repro.env["MLFLOW_TRACKING_URI"] = tracking_server.uri
    isolate_caches(repro)
    done = repro("run", "gpt2", "--max-steps", "2", "--experiment", "ui", "--set", "data.max_train_samples=32",
                 "--set", "data.max_val_samples=8", "--run-dir", "runs/ui")
    assert done.returncode == 0, done.stderr[-3000:]
    spec = json.loads((repro.cwd / "runs" / "ui" / "run.json").read_text())
    address = request.getfixturevalue("ui")
    experiment_id = spec_experiment(tracking_server.uri, spec["mlflow_run_id"])
    assert address.endswith(f"/#/experiments/{experiment_id}/runs")

    text = page_text(address)
    assert f"wikitext-2 ({spec['data_sha256'][:36]})" in text
    commit = run_commit(tracking_server.uri, spec["mlflow_run_id"])
    # the runs table shows no Version column in headless Chromium; the run's own page shows the commit
    run_page = page_text(f"{address}/{spec['mlflow_run_id']}")
    assert commit[:6] in run_page
    assert "No data available for the selected time range" not in text


def spec_experiment(uri: str, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id


def run_commit(uri: str, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id).data.tags["mlflow.source.git.commit"]
