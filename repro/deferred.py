"""The MLflow calls a run's parent could not make because the tracking server did not answer, kept in
order in the run folder (RUN_DIR/deferred.json) until delivery makes them.

A run that starts while the server is down trains anyway: its MLflow run is created (or, on --resume,
reopened) with its tags, params and input files by whoever delivers the run folder first once the
server answers: the follower's courier thread (repro.delivery) or `repro sync`. Each call leaves the
file once made, so an outage in the middle of the replay resumes at the next call; the run id of a
run created late is written into RUN_DIR/run.json before anything else is.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from repro import tracking
from repro.checkpoint import atomic_write_text
from repro.runfiles import RUN_FILE

DEFERRED_FILE = "deferred.json"


def pending(run_dir: Path) -> list[list[Any]]:
    """The calls still to make, oldest first (empty when none)."""
    path = run_dir / DEFERRED_FILE
    return json.loads(path.read_text())["calls"] if path.exists() else []


def keep(run_dir: Path, calls: list[list[Any]], reason: str | None = None) -> None:
    path = run_dir / DEFERRED_FILE
    if not calls:
        path.unlink(missing_ok=True)
        return
    previous = json.loads(path.read_text()) if path.exists() else {}
    atomic_write_text(path, json.dumps({"reason": reason or previous.get("reason"), "calls": calls}, indent=2))


class DeferredRun:
    """Stands in for a tracking.Run whose server does not answer: every call is kept, to be made later.

    `run_id` is None while the run is not created; after `create` the folder knows the run by its spec."""

    def __init__(self, run_dir: Path, reason: str, run_id: str | None = None):
        self.run_dir, self.reason, self.run_id = run_dir, reason, run_id

    def _keep(self, *call: Any) -> None:
        keep(self.run_dir, [*pending(self.run_dir), list(call)], self.reason)

    @classmethod
    def create(cls, run_dir: Path, reason: str, experiment: str, name: str, tags: dict[str, str],
               params: dict[str, str], dataset: tuple[str, str, str] | None, status: str) -> "DeferredRun":
        run = cls(run_dir, reason)
        run._keep("create", experiment, name, tags, params, list(dataset) if dataset else None, status)
        return run

    @classmethod
    def reopen(cls, run_dir: Path, reason: str, run_id: str | None, status: str) -> "DeferredRun":
        run = cls(run_dir, reason, run_id)
        run._keep("reopen", status)
        return run

    def set_tag(self, key: str, value: str) -> None:
        self._keep("set_tag", key, value)

    def delete_tags(self, keys: tuple[str, ...]) -> None:
        self._keep("delete_tags", list(keys))

    def log_artifact(self, path: Path) -> None:
        self._keep("log_artifact", str(path))

    def log_dict(self, data: Any, name: str) -> None:
        self._keep("log_dict", data, name)


def replay(run_dir: Path) -> tracking.Run:
    """Make the kept calls of `run_dir` in order and return its MLflow run (raises while the server is away)."""
    spec = json.loads((run_dir / RUN_FILE).read_text())
    run = tracking.Run.connect(spec["tracking_uri"], spec["mlflow_run_id"]) if spec.get("mlflow_run_id") else None
    calls = pending(run_dir)
    while calls:
        name, *args = calls[0]
        if name == "create":
            experiment, run_name, tags, params, dataset, status = args
            run = tracking.Run.create(spec["tracking_uri"], experiment, run_name, tags, params,
                                      tuple(dataset) if dataset else None, status)
            spec = {**json.loads((run_dir / RUN_FILE).read_text()), "mlflow_run_id": run.run_id}
            atomic_write_text(run_dir / RUN_FILE, json.dumps(spec, indent=2))
        elif name == "reopen":
            run = tracking.Run.reopen(spec["tracking_uri"], run.run_id, args[0])
        elif name == "log_artifact":
            run.log_artifact(Path(args[0]))
        else:
            getattr(run, name)(*args)
        calls = calls[1:]
        keep(run_dir, calls)
    return run


def create_or_defer(run_dir: Path, uri: str, experiment: str, name: str, tags: dict[str, str], params: dict[str, str],
                    dataset: tuple[str, str, str] | None, status: str) -> tracking.Run | DeferredRun:
    """A new MLflow run, or, while the server does not answer, its creation kept for later."""
    try:
        return tracking.Run.create(uri, experiment, name, tags, params, dataset, status)
    except Exception as error:
        if not tracking.server_unanswered(error):
            raise
        return DeferredRun.create(run_dir, unanswered(uri, error), experiment, name, tags, params, dataset, status)


def reopen_or_defer(run_dir: Path, uri: str, run_id: str | None, status: str) -> tracking.Run | DeferredRun:
    """The run of `run_dir` in `status` again, or, while the server does not answer (or calls of an
    earlier outage still wait), its reopening kept for later, after those calls."""
    if not pending(run_dir):
        try:
            return tracking.Run.reopen(uri, run_id, status)
        except Exception as error:
            if not tracking.server_unanswered(error):
                raise
            return DeferredRun.reopen(run_dir, unanswered(uri, error), run_id, status)
    return DeferredRun.reopen(run_dir, "calls of an earlier outage wait", run_id, status)


def unanswered(uri: str, error: Exception) -> str:
    return f"MLflow at {uri} did not answer ({type(error).__name__}: {str(error)[:200]})"
