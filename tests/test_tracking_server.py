"""Real `repro run` jobs against a real MLflow server on PostgreSQL: every point, param, tag and
artifact arrives exactly once, also across a server outage longer than the client's retries, and
runs whose job is gone are settled."""
from __future__ import annotations

import collections
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from conftest import Repro, read_events
from mlflow_server import POSTGRESQL
from repro import names
from repro.adapters.zero_plan import extension_folder
from repro.delivery import State
from repro.recipe import resolve
from repro.run import record
from repro.runfiles import RunFolder
from repro.tracking import event_metrics

pytestmark = [pytest.mark.services, pytest.mark.programs(*POSTGRESQL)]

SMALL = ("--set", "data.max_val_samples=16")
CREATION_ARTIFACTS = {"recipe.yaml", "environment.json", "packages.json"}


@pytest.fixture
def served(repro: Repro, tracking_server) -> Repro:
    """`repro` in a scratch folder, logging to the PostgreSQL-backed server; the follower delivers every
    second (so that an outage can begin mid-run, after the first points) and gives up after 3 s."""
    repro.env["MLFLOW_TRACKING_URI"] = tracking_server.uri
    repro.env["REPRO_DELIVERY_INTERVAL_S"] = "1"
    repro.env["REPRO_DELIVERY_BUDGET_S"] = "3"
    isolate_caches(repro)
    return repro


def isolate_caches(repro: Repro) -> None:
    """The data checks' hash cache of this test alone (no other process rewrites it); compiled
    extensions (DeepSpeed's) from this environment's folder, not built again."""
    repro.env.setdefault("TORCH_EXTENSIONS_DIR", str(extension_folder()))
    repro.env["XDG_CACHE_HOME"] = str(repro.cwd / "cache")


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def spec(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def produced_points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Metric key -> sorted (step, value) of every point the run's events hold, and, once it has ended,
    its outcome's metrics (the model check, at step 0)."""
    points = collections.defaultdict(list)
    for event in read_events(run_dir):
        for key, value, step in event_metrics(event):
            points[key].append((step, float(value)))
    outcome = RunFolder(run_dir).read_outcome()
    for key, value in (outcome.metrics if outcome else {}).items():
        points[key].append((0, float(value)))
    return {key: sorted(values) for key, values in points.items()}


def logged_points(uri: str, run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Metric key -> sorted (step, value) in MLflow, less the step-time check `repro run` logs after
    delivery (repro.report.model_check.check_run), which holds one point per key when present."""
    mlflow = client(uri)
    run_id = spec(run_dir)["mlflow_run_id"]
    keys = mlflow.get_run(run_id).data.metrics
    points = {key: sorted((m.step, m.value) for m in mlflow.get_metric_history(run_id, key)) for key in keys}
    for key in (names.STEP_TIME_PREDICTED, names.STEP_TIME_ERROR):
        assert len(points.pop(key, [None])) == 1, key
    return points


def count(points: dict[str, list]) -> int:
    return sum(map(len, points.values()))


def assert_exactly_once(uri: str, run_dir: Path, status: str) -> None:
    """The MLflow run holds each metric point, param, tag and file of its run folder once, and `status`."""
    run = client(uri).get_run(spec(run_dir)["mlflow_run_id"])
    assert run.info.status == status
    assert logged_points(uri, run_dir) == produced_points(run_dir)
    recorded = spec(run_dir)
    params = record.run_params(resolve(recorded["recipe"], recorded["recipe"]["source"]))
    start = next(e for e in read_events(run_dir) if e["event"] == "start")
    params.update({f"adapter.{k}": json.dumps(v) for k, v in start["adapter"].items()})
    params.update({f"{names.EFFECTIVE}{k}": str(v) for k, v in start["effective"].items()})  # as the ranks built it
    assert run.data.params == params
    assert run.data.tags["repro.run_dir"] == str(run_dir)
    assert run.data.tags["mlflow.source.git.commit"] == run.data.tags["repro.git_sha"]
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.dataset.digest == recorded["data_sha256"][:36]
    artifacts = {a.path: a.file_size or 0 for a in client(uri).list_artifacts(run.info.run_id)}  # None: empty
    files = {p.name: p.stat().st_size for p in RunFolder(run_dir).artifacts()}
    assert {k: v for k, v in artifacts.items() if k not in CREATION_ARTIFACTS} == files
    assert CREATION_ARTIFACTS <= artifacts.keys()


def test_both_workloads_at_once_arrive_exactly_once(served: Repro, tracking_server) -> None:
    """A VGG-16 DDP run and a GPT-2 ZeRO run at once; the ZeRO run's params say Adam with its lr and weight decay."""
    jobs = {
        "vgg": served.start("run", "vgg16", "--max-steps", "6", "--set", "data.max_train_samples=64", *SMALL,
                            "--run-dir", "runs/vgg", log="vgg.txt"),
        "zero": served.start("run", "gpt2", "--framework", "zero", "--max-steps", "6",
                             "--set", "data.max_train_samples=64", *SMALL, "--run-dir", "runs/zero", log="zero.txt"),
    }
    for name, job in jobs.items():
        assert job.wait(timeout=600) == 0, (served.cwd / f"{name}.txt").read_text()[-3000:]
    for name in jobs:
        run_dir = served.cwd / "runs" / name
        assert State.load(run_dir).undelivered is None
        assert count(produced_points(run_dir)) > 6
        assert_exactly_once(tracking_server.uri, run_dir, "FINISHED")
    params = client(tracking_server.uri).get_run(spec(served.cwd / "runs" / "zero")["mlflow_run_id"]).data.params
    assert {k: params[k] for k in params if k.startswith("effective.")} == {
        "effective.optimizer": "adam", "effective.lr": "0.001", "effective.weight_decay": "0.01",
        "effective.global_batch": "8", "effective.micro_batches": "1", "effective.recompute": "none",
        "effective.precision": "fp32",  # what the ranks trained with (train.precision auto: decided there)
    }
    assert "train.optimizer.name" not in params


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)


def test_outage_longer_than_retries_then_sync_delivers_every_point(served: Repro, tracking_server) -> None:
    """The server goes away mid-run and stays away past the job's end: the job finishes, the run folder
    says what is missing, and `repro sync` delivers it exactly once (twice run, nothing twice)."""
    run_dir = served.cwd / "runs" / "outage"
    job = served.start("run", "gpt2", "--epochs", "2", "--set", "data.max_train_samples=768", *SMALL,
                       "--run-dir", "runs/outage", log="outage.txt")
    wait_until(lambda: (run_dir / "delivery.json").exists() and State.load(run_dir).points_delivered > 0, 300,
               "first points delivered")
    tracking_server.stop()
    down_at = time.monotonic()
    steps_at_stop = sum(e["event"] == "step" for e in read_events(run_dir))
    assert job.wait(timeout=600) == 0, (served.cwd / "outage.txt").read_text()[-3000:]
    events = read_events(run_dir)
    assert events[-1]["event"] == "end" and sum(e["event"] == "step" for e in events) > steps_at_stop
    left = State.load(run_dir)
    assert left.undelivered and "repro sync" in left.undelivered and left.ended is None
    tracking_server.start()
    outage_s = time.monotonic() - down_at

    produced, before = produced_points(run_dir), logged_points(tracking_server.uri, run_dir)
    assert left.points_delivered <= count(before) < count(produced)
    assert client(tracking_server.uri).get_run(spec(run_dir)["mlflow_run_id"]).info.status == "RUNNING"
    synced = served("sync", str(run_dir))
    assert synced.returncode == 0 and "ended FINISHED" in synced.stdout, synced.stderr
    assert_exactly_once(tracking_server.uri, run_dir, "FINISHED")
    again = served("sync", str(run_dir))
    assert again.returncode == 0, again.stderr
    after = logged_points(tracking_server.uri, run_dir)
    assert after == produced
    print(f"\noutage {outage_s:.0f} s; points produced {count(produced)}, in MLflow before sync {count(before)}, "
          f"after sync {count(after)}, duplicates {count(after) - len({(k, p) for k in after for p in after[k]})}")


def test_settle_ends_a_run_whose_follower_and_job_died(served: Repro, tracking_server) -> None:
    """The follower and its job are killed (SIGKILL: nothing records an end); once the heartbeat is
    stale, `repro settle` finds the RUNNING run in the store, delivers its events and ends it FAILED."""
    run_dir = served.cwd / "runs" / "lost"
    follower = served.start("run", "gpt2", "--epochs", "3", "--set", "data.max_train_samples=512", *SMALL,
                            "--run-dir", "runs/lost", log="lost.txt")
    wait_until(lambda: sum(e["event"] == "step" for e in read_events(run_dir)) >= 3, 300, "three steps")
    tree = [psutil.Process(follower.pid), *psutil.Process(follower.pid).children(recursive=True)]
    for process in tree:
        os.kill(process.pid, signal.SIGKILL)
    follower.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)

    early = served("settle", "--stale-after", "60")
    assert early.returncode == 0 and "left running: its heartbeat is" in early.stdout, early.stdout
    settled = served("settle", "--stale-after", "0")
    assert settled.returncode == 0 and f"{run_dir}: ended FAILED" in settled.stdout, settled.stdout
    run = client(tracking_server.uri).get_run(spec(run_dir)["mlflow_run_id"])
    steps = [e["step"] for e in read_events(run_dir) if e["event"] == "step"]
    assert run.data.tags["repro.settled"].startswith(f"the job is gone without an end event, after step {steps[-1]}")
    assert f"follower pid {follower.pid} on" in run.data.tags["repro.settled"]
    assert_exactly_once(tracking_server.uri, run_dir, "FAILED")
    assert served("settle", str(run_dir)).stdout.strip() == f"{run_dir}: already ended FAILED"
