"""Shared test helpers: run the real `repro` command in a scratch folder and read what it recorded."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

import lanes
import tiers
from host import need
from references import References
from mlflow_server import tracking_server  # noqa: F401 (a fixture: the PostgreSQL-backed MLflow server)

REPO = Path(__file__).resolve().parent.parent
STORES: set[str] = set()  # every MLflow store the tests used: none may hold a RUNNING run at the end


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
        return read_events(self.run_dir)

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.events() if e["event"] == "step"]


class Repro:
    """Runs `python -m repro.cli ...` in a scratch folder with its own MLflow store."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.env = {**os.environ, "REPRO_DATA": str(REPO / "data"), "MLFLOW_TRACKING_URI": f"sqlite:///{cwd}/mlflow.db"}
        self.env.pop("REPRO_CONFIGS", None)
        STORES.add(self.env["MLFLOW_TRACKING_URI"])

    def __call__(self, *args: str, timeout: int = 600) -> Result:
        out = subprocess.run(
            [sys.executable, "-m", "repro.cli", *args], cwd=self.cwd, env=self.env,
            capture_output=True, text=True, timeout=timeout,
        )
        return Result(out.returncode, out.stdout, out.stderr, self.cwd)

    def here(self, *args: str) -> Result:
        """`repro ARGS` in this process (click's runner), with this scratch folder's environment and working
        folder: for the units tier's refusals, dry runs and listings, which then pay no cold start of a
        fresh interpreter importing torch. What reaches a real process's stderr reaches `stderr` here,
        an uncaught exception as its traceback."""
        from click.testing import CliRunner

        from repro import cli

        unset = {key: None for key in os.environ if key not in self.env}
        before = Path.cwd()
        os.chdir(self.cwd)
        try:
            out = CliRunner(env={**self.env, **unset}).invoke(cli.main, list(args))
        finally:
            os.chdir(before)
        stderr = out.stderr
        if out.exception is not None and not isinstance(out.exception, SystemExit):
            stderr += "".join(traceback.format_exception(*out.exc_info))
        return Result(out.exit_code, out.stdout, stderr, self.cwd)

    def start(self, *args: str, log: str = "output.txt") -> subprocess.Popen:
        """`repro ARGS` in the background, its output going to the file `log` in the scratch folder."""
        with open(self.cwd / log, "w") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "repro.cli", *args], cwd=self.cwd, env=self.env,
                stdout=out, stderr=subprocess.STDOUT, text=True,
            )

    @property
    def tracking_uri(self) -> str:
        return self.env["MLFLOW_TRACKING_URI"]


NO_DEEPSPEED_FP16 = "DeepSpeed refuses fp16 on a CPU without AVX512-FP16 or AMX-FP16 (cpu_accelerator.is_fp16_supported)"


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for_event(
    runs: Path, kind: str, process: subprocess.Popen, timeout: float = 300, **fields: object,
) -> tuple[Path, dict]:
    """(run folder, event): the first event of `kind` with `fields` that `process` writes in a run under `runs`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        for run_dir in runs.glob("*"):
            for event in read_events(run_dir):
                if event["event"] == kind and all(event.get(k) == v for k, v in fields.items()):
                    return run_dir, event
        time.sleep(0.1)
    raise TimeoutError(f"no {kind} event with {fields} under {runs} (exit code {process.poll()}, {timeout} s)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: an unmarked test must not vanish from every tier
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.check_every_test_has_one_tier(items)
    lanes.group_by_shared_fixtures(items)
    lanes.publish_groups(config, items)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadgroup by tests/lanes.py's groups (xdist's own loses them under pytest 9)."""
    return lanes.group_scheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.hookimpl(tryfirst=True)  # before any fixture starts a daemon
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked programs(...) fails in one line naming the Debian packages missing here."""
    for mark in item.iter_markers("programs"):
        need(*mark.args)


@pytest.fixture(autouse=True)
def units_guard(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                monkeypatch: pytest.MonkeyPatch):
    """A units test that starts a process group, or launches ranks, fails (tests/tiers.py)."""
    if not request.node.get_closest_marker("units"):
        yield
        return
    marks = tmp_path_factory.mktemp("guard") / "refused.txt"
    tiers.guard_units(marks, monkeypatch)
    yield
    if refused := tiers.refused(marks):
        pytest.fail(f"a units test started a process group or ranks; give it another tier:\n{refused}", pytrace=False)


def rank_of(process, run_dir: Path) -> str | None:
    """The rank of the training loop that a process of a run is (None: not one): a torchrun worker's
    command line and environment say it; a warm rank, forked with its fork server's command line and
    /proc environment, is named in RUN_DIR/ranks/pids.json."""
    if "repro.loop" in process.cmdline():
        return process.environ().get("RANK")
    pids = run_dir / "ranks" / "pids.json"
    found = json.loads(pids.read_text()) if pids.exists() else {}
    return next((rank for rank, pid in found.items() if pid == process.pid), None)


@pytest.fixture
def repro(tmp_path: Path) -> Repro:
    return Repro(tmp_path)


def framework_params(*names: str) -> list:
    """pytest params over frameworks, skipped with the reason where one cannot run in this checkout."""
    import importlib.util

    from repro import registry

    params = []
    for name in names:
        entry = registry.FRAMEWORKS[name]
        reason = None
        if importlib.util.find_spec(entry.plan.partition(":")[0]) is None:
            reason = "adapter not in this branch"
        elif entry.missing():
            reason = f"needs {', '.join(entry.missing())}"
        params.append(pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or "")))
    return params


@pytest.fixture(scope="module")
def shared_repro(tmp_path_factory: pytest.TempPathFactory) -> Repro:
    """One scratch folder and MLflow store for all tests of a module (to share expensive runs)."""
    return Repro(tmp_path_factory.mktemp("repro"))


@pytest.fixture(scope="session")
def references(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> References:
    """The session's store of reference runs (tests/references.py): each trained once, on first use, by
    whichever of the session's processes needs it first."""
    return References(lanes.session_folder(request.config, tmp_path_factory, "references"))


def mlflow_runs(uri: str, experiment: str = "repro") -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def running_runs(uri: str) -> list[str]:
    """Ids of the unsettled (RUNNING or SCHEDULED) runs of every experiment of the store `uri` (a sqlite file that was never made has none)."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        return []
    client = MlflowClient(tracking_uri=uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    return [r.info.run_id for r in client.search_runs(ids) if r.info.status in ("RUNNING", "SCHEDULED")] if ids else []


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller: a worker has finished
def pytest_testnodedown(node, error) -> None:
    STORES.update(getattr(node, "workeroutput", {}).get("mlflow_stores", ()))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when a test left a RUNNING or SCHEDULED run behind (a run nobody will ever end).

    A pytest-xdist worker hands its stores to the controller, which checks them all at its own end."""
    if lanes.worker(session.config):
        session.config.workeroutput["mlflow_stores"] = sorted(STORES)
        return
    left = {uri: ids for uri in sorted(STORES) if (ids := running_runs(uri))}
    if left:
        print(f"\nunsettled runs left behind: {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module", params=["cpu"])
def slurm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A real Slurm cluster of two nodes on this host (tests/slurm_cluster.py), for one test module.

    Parametrize indirectly with "gpu" for nodes that declare fake GPU GRES."""
    from slurm_cluster import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("slurm"), gpus=request.param == "gpu").start()
    yield cluster
    cluster.stop()
