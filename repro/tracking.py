"""MLflow: the only module that imports it. One rank's events become one MLflow run."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from repro import events, names

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "repro"
RETRIES = 12
SQLITE_PREFIX = "sqlite:///"
TRANSIENT_SIGNS = ("database is locked", "database table is locked")
# An HTTP server's client gives up after these (MLflow's own defaults retry for minutes): repro.delivery
# does the retrying, with its own pauses, and a request never holds a follower for long.
HTTP_RETRIES, REQUEST_TIMEOUT_S = 2, 10
HTTP_PREFIXES = ("http://", "https://")
# MLflow's own tag names, which its UI shows (Source column, run page)
SOURCE_NAME, SOURCE_TYPE, SOURCE_COMMIT = "mlflow.source.name", "mlflow.source.type", "mlflow.source.git.commit"
UNFINISHED = ("RUNNING", "SCHEDULED")
DIGEST_CHARS = 36  # MLflow's longest dataset digest (validation.py); a SHA-256 is shown by its first 36 hex digits


def tracking_uri(explicit: str | None = None) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI, else an embedded sqlite file in the working directory."""
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def server_unanswered(error: BaseException) -> bool:
    """Whether `error` says the tracking server did not answer (refused, unreachable, timed out, or failing
    every retry), rather than refusing what was asked: the run goes on and is recorded later (repro.deferred).

    MLflow's HTTP client wraps requests' errors in an MlflowException, implicitly chained (`__context__`)
    when it does not name the cause (mlflow/utils/rest_utils.py, `http_request`)."""
    import requests

    while error is not None:
        if isinstance(error, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                              requests.exceptions.RetryError)):
            return True
        error = error.__cause__ or error.__context__
    return False


def transient(error: Exception) -> bool:
    """Errors a concurrent writer causes on a shared sqlite store; trying again succeeds."""
    text = str(error)
    return any(sign in text for sign in TRANSIENT_SIGNS)


def with_retries(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call`, tried again with growing pauses while the store is locked by another writer."""
    for attempt in range(RETRIES):
        try:
            return call(*args, **kwargs)
        except Exception as error:  # mlflow wraps sqlalchemy's OperationalError in several ways
            if attempt == RETRIES - 1 or not transient(error):
                raise
            time.sleep(min(0.1 * 2**attempt, 5.0))


@contextlib.contextmanager
def store_creation_lock(uri: str) -> Iterator[None]:
    """Held while opening a sqlite store: MLflow creates a new store's tables on first use, and two
    processes doing so at once fail ("table experiments already exists")."""
    if not uri.startswith(SQLITE_PREFIX):
        yield
        return
    database = Path(uri[len(SQLITE_PREFIX):])
    with open(database.with_name(database.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class RetryingClient:
    """An MlflowClient whose every call is retried on transient store errors (see with_retries)."""

    def __init__(self, uri: str):
        from mlflow.tracking import MlflowClient

        with store_creation_lock(uri):
            self.inner = MlflowClient(tracking_uri=uri)
            with_retries(self.inner.search_experiments, max_results=1)  # opens (and if new, creates) the store

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        return functools.partial(with_retries, attribute) if callable(attribute) else attribute


def client(uri: str) -> Any:
    import logging

    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    if uri.startswith(HTTP_PREFIXES):  # read by MLflow at each request; an explicit setting wins
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(HTTP_RETRIES))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))
    return RetryingClient(uri)


def experiment_id(mlflow_client: Any, name: str) -> str:
    """The experiment's id, creating it where missing; two runs that start at once against a new store
    both find it missing, and the one whose creation loses takes the other's."""
    from mlflow.exceptions import MlflowException

    found = mlflow_client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    try:
        return mlflow_client.create_experiment(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return mlflow_client.get_experiment_by_name(name).experiment_id


def event_metrics(event: dict[str, Any]) -> list[tuple[str, float, int]]:
    """(key, value, step) triples that one event contributes to MLflow."""
    kind = event["event"]
    if kind == events.STEP and event.get("loss") is not None:
        return [(names.TRAIN_LOSS, event["loss"], event["step"])]
    if kind != events.EPOCH:
        return []
    step = event["epoch"] + 1
    # `train`: per-epoch training metrics, from frameworks that report them (LBANN's accuracy).
    out = [(key, value, step) for key, value in {**event.get("train", {}), **event["val"]}.items()]
    out += [
        (names.EPOCH_TIME, event["epoch_s"], step),
        (names.ELAPSED, event["elapsed_s"], step),
        (names.THROUGHPUT, event["samples_per_s"], step),
    ]
    step_s = event.get("step_s") or {}  # the loop's step-time distribution (absent from LBANN's driver)
    out += [(names.STEP_TIME.format(k), step_s[k], step) for k in ("median", "p10", "p90", "mean", "framework_median")
            if step_s.get(k) is not None]
    out += [(names.STEP_COUNT, step_s["count"], step)] if "count" in step_s else []
    loop_us = event.get("loop_us") or {}  # the loop's own time (absent from LBANN's driver)
    out += [(key, loop_us[name], step) for key, name in ((names.HARNESS_TIME, "harness"), (names.COUNTERS_TIME, "counters"))
            if loop_us.get(name) is not None]
    ranks = event["ranks"]
    state = {r["rank"]: r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks}
    out += [(names.PEAK_MEMORY, max(r["peak_bytes"] for r in ranks), step)]
    out += [(names.MODEL_STATE, max(state.values()), step)]
    activations = {r["rank"]: r["activation_peak_bytes"] for r in ranks if "activation_peak_bytes" in r}
    if activations:  # not from frameworks with their own runtime (LBANN)
        out += [(names.ACTIVATION_PEAK, max(activations.values()), step)]
        out += [(names.ESTIMATED_PEAK, max(state[rank] + activations[rank] for rank in activations), step)]
    out += comm_metrics(ranks, step) + flop_metrics(ranks, step)
    for r in ranks:
        out += [(f"memory/rank{r['rank']}/peak_bytes", r["peak_bytes"], step)]
        out += [(f"memory/rank{r['rank']}/model_state_bytes", state[r["rank"]], step)]
    return out


def comm_metrics(ranks: list[dict[str, Any]], step: int) -> list[tuple[str, float, int]]:
    """The busiest rank's payload per step in all, and per operation kind the most any rank hands over
    (absent before the counter ran)."""
    counted = [r["comm"]["bytes"] for r in ranks if r.get("comm")]
    if not counted:
        return []
    out = [(names.COMM_BYTES, max(sum(kinds.values()) for kinds in counted), step)]
    for kind in sorted({kind for kinds in counted for kind in kinds}):
        name = kind.replace(":", "_")  # MLflow keys allow no colon
        out += [(names.COMM_KIND_BYTES.format(name), max(kinds.get(kind, 0) for kinds in counted), step)]
    return out


def flop_metrics(ranks: list[dict[str, Any]], step: int) -> list[tuple[str, float, int]]:
    """The counted FLOPs of the step of the rank that computes the most, by phase and in all (absent
    before the counter ran)."""
    counted = [r["flops"] for r in ranks if r.get("flops")]
    if not counted:
        return []
    busiest = max(counted, key=lambda phases: sum(phases.values()))
    return [(names.FLOPS.format(phase), value, step) for phase, value in {**busiest, "total": sum(busiest.values())}.items()]


class Run:
    """An MLflow run fed from the events file of one training job (only the job's follower logs)."""

    def __init__(self, mlflow_client: Any, run_id: str):
        self.client, self.run_id = mlflow_client, run_id

    @classmethod
    def create(
        cls, uri: str, experiment: str, name: str, tags: dict[str, str], params: dict[str, str],
        dataset: tuple[str, str, str] | None = None, status: str = "RUNNING",
    ) -> "Run":
        """A new run with its tags and params and, as an MLflow dataset input (the UI's Dataset column),
        `dataset`: (name, digest, source); the full digest is also a tag of the caller's. SCHEDULED
        (MLflow's "waits") for a job that is queued, not yet running."""
        from mlflow.entities import Dataset, DatasetInput, InputTag, Param, RunTag

        mlflow_client = client(uri)
        run_id = mlflow_client.create_run(experiment_id(mlflow_client, experiment), run_name=name).info.run_id
        mlflow_client.log_batch(
            run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()],
            params=[Param(k, str(v)[:6000]) for k, v in params.items()],
        )
        if dataset:
            name, digest, source = dataset
            context = InputTag("mlflow.data.context", "training")
            mlflow_client.log_inputs(run_id, [DatasetInput(Dataset(name, digest[:DIGEST_CHARS], "local", source), [context])])
        if status != "RUNNING":
            mlflow_client.update_run(run_id, status=status)
        return cls(mlflow_client, run_id)

    @classmethod
    def connect(cls, uri: str, run_id: str) -> "Run":
        return cls(client(uri), run_id)

    @classmethod
    def reopen(cls, uri: str, run_id: str, status: str = "RUNNING") -> "Run":
        """An existing run, marked running again (a resumed job continues it), or SCHEDULED (its job is queued)."""
        run = cls.connect(uri, run_id)
        run.client.update_run(run_id, status=status)
        return run

    def mark_running(self) -> None:
        self.client.update_run(self.run_id, status="RUNNING")

    def log_events(self, new_events: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        facts = [Param(f"{names.ADAPTER}{k}", json.dumps(v)[:6000]) for e in new_events if e["event"] == events.START
                 for k, v in e.get("adapter", {}).items()]
        facts += [Param(f"{names.EFFECTIVE}{k}", str(v)) for e in new_events if e["event"] == events.START
                  for k, v in e.get("effective", {}).items()]  # what the ranks built (Adapter.pieces)
        if facts:  # the adapter's setup decisions (a computed pipeline balance, say)
            self.client.log_batch(self.run_id, params=facts)

        metrics = [Metric(k, float(v), int(e["wall"] * 1000), s) for e in new_events for k, v, s in event_metrics(e)]
        tags = [RunTag(names.MEMORY_METHOD, r["method"]) for e in new_events if e["event"] == events.EPOCH for r in e["ranks"][:1]]
        for start in range(0, len(metrics), 900):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 900])
        if tags:
            self.client.log_batch(self.run_id, tags=tags)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_values(self, values: dict[str, float], tags: dict[str, str] | None = None) -> None:
        """Metrics of the run as a whole (one value each, step 0: the run's model check, say), and `tags`, in one call."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in values.items()],
                              tags=[RunTag(k, v) for k, v in (tags or {}).items()])

    def delete_tags(self, keys: tuple[str, ...]) -> None:
        """Remove those of `keys` the run has (MLflow refuses to delete a tag that is not there)."""
        present = self.client.get_run(self.run_id).data.tags
        for key in set(keys) & set(present):
            self.client.delete_tag(self.run_id, key)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def log_dict(self, data: Any, name: str) -> None:
        self.client.log_text(self.run_id, json.dumps(data, indent=2, sort_keys=True, default=str), name)

    def end(self, status: str, error: str | None = None) -> None:
        if error:
            self.client.set_tag(self.run_id, names.ERROR, error[-names.ERROR_CHARS:])
        self.client.set_terminated(self.run_id, status)


def unfinished_runs(uri: str) -> list[tuple[str, str, dict[str, str]]]:
    """(run id, status, tags) of every RUNNING or SCHEDULED run in the store, all experiments."""
    mlflow_client = client(uri)
    ids = [e.experiment_id for e in mlflow_client.search_experiments()]
    found = []
    for status in UNFINISHED:
        for run in mlflow_client.search_runs(ids, f"attributes.status = '{status}'", max_results=50000) if ids else []:
            found.append((run.info.run_id, run.info.status, run.data.tags))
    return found


def runs_view(uri: str, experiment: str, address: str) -> str:
    """The address of the MLflow UI's runs table of `experiment` (the UI opens an experiment on its GenAI
    overview otherwise), or of the experiments list while the experiment does not exist."""
    found = client(uri).get_experiment_by_name(experiment)
    return f"{address}/#/experiments/{found.experiment_id}/runs" if found else f"{address}/#/experiments"
