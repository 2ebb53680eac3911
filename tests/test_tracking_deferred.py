"""A run folder whose MLflow calls were kept while the server did not answer (repro.deferred): delivery
creates the run with them, then delivers its events once each; `repro settle` finds such folders."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import wait_for_event
from host import free_port
from mlflow_server import MlflowServer
from repro import deferred, events, names, settle, tracking
from repro.delivery import Delivery
from repro.runfiles import DEFERRED_FILE, Outcome, RunFolder, Spec

STEPS = 12


def folder_started_while_away(run_dir: Path, uri: str) -> None:
    """What the parent leaves when the server does not answer: run.json without a run id, the kept calls, events."""
    run_dir.mkdir(parents=True)
    folder = RunFolder(run_dir)
    folder.write_spec(Spec({}, "/data", tracking_uri=uri))
    folder.recipe_file.write_text("workload: gpt2\n")
    run = deferred.DeferredRun.create(folder, "the server did not answer", "repro", "gpt2-ddp-1gpu",
                                      {"repro.framework": "ddp"}, {"train.epochs": "1"}, ("digits", "ab" * 32, "/data"),
                                      "RUNNING")
    run.log_artifact(folder.recipe_file)
    run.log_dict({"python": "3.11"}, "environment.json")
    run.set_tag("repro.resumed", "true")
    writer = events.EventWriter(folder.events_file)
    for step in range(1, STEPS + 1):
        writer.emit(events.STEP, step=step, epoch=0, loss=1.0 / step)
    writer.close()


@pytest.mark.units
def test_delivery_creates_a_run_started_while_the_server_was_away_and_delivers_each_step_once(tmp_path: Path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "runs" / "late"
    folder_started_while_away(run_dir, uri)
    RunFolder(run_dir).write_outcome(Outcome("FINISHED"))
    assert Delivery(run_dir).deliver() and Delivery(run_dir).deliver()  # the second finds nothing left

    run_id = RunFolder(run_dir).read_spec().mlflow_run_id
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("repro").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED" and run.info.run_name == "gpt2-ddp-1gpu"
    assert run.data.tags["repro.framework"] == "ddp" and run.data.tags["repro.resumed"] == "true"
    assert run.data.params == {"train.epochs": "1"}
    assert sorted(a.path for a in client.list_artifacts(run_id)) == ["environment.json", "events.jsonl", "recipe.yaml"]
    assert sorted(m.step for m in client.get_metric_history(run_id, names.TRAIN_LOSS)) == list(range(1, STEPS + 1))
    assert not (run_dir / DEFERRED_FILE).exists()


@pytest.mark.units
def test_a_server_that_does_not_answer_defers_the_creation_and_settle_finds_the_run(tmp_path: Path, monkeypatch):
    closed = f"http://127.0.0.1:{free_port()}"
    run_dir = (tmp_path / "runs" / "away").resolve()
    run_dir.mkdir(parents=True)
    folder = RunFolder(run_dir)
    started = time.monotonic()
    run = deferred.create_or_defer(folder, closed, "repro", "away", {}, {}, None, "RUNNING")
    assert isinstance(run, deferred.DeferredRun) and run.run_id is None and time.monotonic() - started < 60
    assert deferred.pending(folder)[0][0] == "create"
    assert tracking.server_unanswered(RuntimeError("database is locked")) is False

    # its job is gone (no heartbeat for long); the store answers now: settle creates the run and ends it
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    folder.write_spec(Spec({}, tracking_uri=uri))
    writer = events.EventWriter(folder.events_file)
    writer.emit(events.STEP, step=1, epoch=0, loss=0.5)
    writer.close()
    old = time.time() - 3600
    os.utime(folder.spec_file, (old, old))
    monkeypatch.chdir(tmp_path)
    (line,) = settle.settle(uri, [])
    assert line.startswith(f"{run_dir}: ended FAILED"), line
    run_id = folder.read_spec().mlflow_run_id
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"


@pytest.mark.end_to_end
def test_a_run_started_while_the_server_is_down_trains_and_is_recorded_once_it_answers(repro, tmp_path: Path):
    """With the tracking URI on a server that is not up, `repro run` trains; the server comes up mid-run
    (an `mlflow server` on a sqlite store) and the run is there, every step once, FINISHED."""
    server = MlflowServer(f"sqlite:///{tmp_path}/server.db", tmp_path, start=False)
    repro.env["MLFLOW_TRACKING_URI"] = server.uri
    repro.env["REPRO_DELIVERY_BUDGET_S"] = "900"  # the server's start takes minutes on a loaded machine
    job = repro.start("run", "gpt2", "--framework", "ddp", "--gpus", "1", "--epochs", "2",
                      "--set", "data.max_val_samples=32", "--run-dir", "runs/late", log="late.txt")
    try:
        run_dir, _ = wait_for_event(repro.cwd / "runs", "step", job, timeout=900, step=16)  # training, server down
        assert RunFolder(run_dir).read_spec().mlflow_run_id is None
        server.start()
        assert job.wait(timeout=900) == 0, (repro.cwd / "late.txt").read_text()[-3000:]
        steps = [e["step"] for e in events.read_all(RunFolder(run_dir).events_file) if e["event"] == events.STEP]
        run_id = RunFolder(run_dir).read_spec().mlflow_run_id
        client = MlflowClient(server.uri)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.tags["repro.framework"] == "ddp"
        history = client.get_metric_history(run_id, names.TRAIN_LOSS)
        assert sorted(m.step for m in history) == steps == list(range(1, len(steps) + 1)) and len(steps) > 16
        assert not (run_dir / DEFERRED_FILE).exists()
    finally:
        job.kill()
        server.stop()


@pytest.mark.units
def test_two_runs_creating_the_experiment_at_once_both_get_its_id(tmp_path: Path):
    """The run whose creation of a missing experiment loses the race takes the one the other made."""
    store = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")

    class LosesTheRace:
        def get_experiment_by_name(self, name):
            return store.get_experiment_by_name(name)

        def create_experiment(self, name):
            made = store.create_experiment(name)  # the other run's, just before ours
            assert made
            return store.create_experiment(name)  # ours: RESOURCE_ALREADY_EXISTS

    assert tracking.experiment_id(LosesTheRace(), "repro") == store.get_experiment_by_name("repro").experiment_id
