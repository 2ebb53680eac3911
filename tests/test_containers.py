"""The container files: lint, parse and agree with CI; and a run logs to a real MLflow server.

Fast checks of the files themselves; tests/test_image.py builds the image and runs it. Apptainer and
GPUs are absent here (docs/containers.md has the commands that verify the rest).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from host import free_port, program

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = [REPO / "Dockerfile", REPO / "docker" / "mlflow" / "Dockerfile", REPO / "docker" / "postgres" / "Dockerfile"]


def tool(name: str) -> str:
    """Path of a command-line tool: on PATH or beside this interpreter (the venv's bin)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip(f"needs {name} (.ci/run installs it)")
    return found


def pins() -> dict[str, str]:
    """requirements.txt as {distribution: version}."""
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


@pytest.mark.units
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_passes(dockerfile: Path) -> None:
    out = subprocess.run(
        [tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
        capture_output=True, text=True,
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


@pytest.mark.units
def test_every_ignored_lint_rule_gives_its_reason() -> None:
    text = (REPO / ".hadolint.yaml").read_text()
    for rule in yaml.safe_load(text)["ignored"]:
        assert re.search(rf"^\s*#\s*{rule} \(.+\): \S.+", text, re.M), f"{rule} is ignored without a reason"
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        for index, line in enumerate(lines):
            for rule in re.findall(r"^# hadolint ignore=(\S+)", line):
                assert re.match(rf"# {rule} \(.+\): \S.+", lines[index - 1]), f"{dockerfile}:{index + 1}: no reason"


def dockerfile_make_calls() -> list[list[str]]:
    """The `make` invocations of the image's RUN instructions, as argument lists."""
    runs = re.findall(r"^RUN (.*)$", (REPO / "Dockerfile").read_text().replace("\\\n", " "), re.M)
    return [call.split() for run in runs for call in re.findall(r"\bmake (install[\w-]*[^&]*)", run)]


def make_dry_run(*args: str) -> list[str]:
    out = subprocess.run(["make", "-s", "-n", "-C", str(REPO), *args], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@pytest.mark.units
def test_image_installs_with_the_same_make_targets_as_ci() -> None:
    tool("make")
    makefile = (REPO / "Makefile").read_text()
    install_steps = re.search(r"^install: ([^#\n]*)", makefile, re.M).group(1).split()
    image_steps = [call[0] for call in dockerfile_make_calls()]
    assert image_steps == install_steps == ["install-requirements", "install-kit"]
    assert "make setup" in (REPO / ".ci" / "run").read_text()
    assert re.search(r"^setup:.*\n(\t.*\n)*\t\$\(MAKE\) install PYTHON=", makefile, re.M)
    # The commands themselves: the image's differ from CI's only in the interpreter and editability.
    image_commands = [line for call in dockerfile_make_calls() for line in make_dry_run(*call)]
    ci_commands = make_dry_run("install", "PYTHON=/opt/venv/bin/python", "EDITABLE=")
    assert image_commands == ci_commands
    assert "-r requirements.txt" in " ".join(ci_commands)


@pytest.mark.units
def test_image_labels_are_read_from_the_build_and_servers_match_the_pins() -> None:
    """Versions are labelled from what the image contains (docker/labels.py, run by `make image`;
    tests/test_image.py compares them with requirements.txt), never written as constants."""
    text = (REPO / "Dockerfile").read_text()
    assert not re.search(r"io\.repro\.(torch|deepspeed|python|cuda|cudnn|lbann)[\w.]*=", text), "a version label written by hand"
    assert "docker/labels.py" in (REPO / "Makefile").read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M | re.I)  # a frontend image would be pulled from Docker Hub
    # LBANN: the version built is the one `repro` tells users to install.
    from repro.registry import FRAMEWORKS

    lbann_version = re.search(r"^ARG LBANN_VERSION=(\S+)$", text, re.M).group(1)
    assert f'lbann@${{LBANN_VERSION}} +cuda cuda_arch=${{cuda_arch}} +vision +pfe"' in text
    assert f"spack install lbann@{lbann_version} +cuda +vision +pfe" in FRAMEWORKS["lbann"].install_hint
    pinned = pins()
    server = (REPO / "docker" / "mlflow" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=ghcr\.io/mlflow/mlflow:v([\d.]+)$", server, re.M).group(1) == pinned["mlflow"]
    assert f"mlflow=={pinned['mlflow']}" in server and f'"psycopg[binary]=={pinned["psycopg[binary]"]}"' in server


@pytest.mark.services
@pytest.mark.programs("docker-compose")
def test_compose_file_is_accepted_and_wires_the_services() -> None:
    out = subprocess.run(
        [program("docker-compose"), "-f", str(REPO / "docker-compose.yml"), "config"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    services = config["services"]
    mlflow, repro = services["mlflow"], services["repro"]
    command = " ".join(mlflow["command"])
    assert "--backend-store-uri=postgresql://" in command and "@postgres:5432/" in command
    assert "psycopg[binary]==" in (REPO / mlflow["build"]["context"] / "Dockerfile").read_text()
    artifacts = re.search(r"--artifacts-destination=(\S+)", command).group(1)
    assert any(v.startswith(f"mlflow-artifacts:{artifacts}") for v in map(volume_spec, mlflow["volumes"]))
    assert set(config["volumes"]) >= {"postgres-data", "mlflow-artifacts", "repro-work"}
    assert [volume_spec(v).removesuffix(":rw") for v in repro["volumes"]] == ["repro-work:/work"]  # the image's one working folder
    assert [p["host_ip"] if isinstance(p, dict) else p.split(":")[0] for p in mlflow["ports"]] == ["127.0.0.1"]
    assert repro["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert "--port=5000" in command and "mlflow:5000" in command  # reachable by service name
    assert "deploy" not in repro  # GPUs are opt-in: a reservation stops the stack where there are none
    assert repro["command"][0] == "run"  # the image's entrypoint is `repro`
    gpu = subprocess.run(
        [program("docker-compose"), "-f", str(REPO / "docker-compose.yml"), "-f", str(REPO / "docker" / "compose.gpu.yml"),
         "config"], capture_output=True, text=True, cwd=REPO, check=True,
    )
    device = yaml.safe_load(gpu.stdout)["services"]["repro"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["capabilities"] == ["gpu"]


def volume_spec(volume: str | dict) -> str:
    """A compose volume as 'source:target', whatever form `config` printed it in."""
    return volume if isinstance(volume, str) else f"{volume['source']}:{volume['target']}"


def render_definition(text: str, **overrides: str) -> str:
    """The definition as Apptainer builds it: {{ NAME }} replaced by --build-arg or %arguments values."""
    section = re.search(r"^%arguments\n((?:[ \t]+.*\n)+)", text, re.M).group(1)
    values = {**dict(re.findall(r"^\s+(\w+)=(\S+)$", section, re.M)), **overrides}
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values[m.group(1)], text)


@pytest.mark.units
@pytest.mark.parametrize("bootstrap, source", [
    (None, None), ("docker-archive", "repro.tar"), ("docker", "registry.example/repro:0.1.0"),
])
def test_apptainer_definition_parses_and_runs_repro_run(tmp_path: Path, bootstrap: str | None, source: str | None) -> None:
    pytest.importorskip("spython", reason="needs spython (requirements.txt)")
    from spython.main.parse.parsers import SingularityParser

    overrides = {"BOOTSTRAP": bootstrap, "FROM": source} if bootstrap else {}
    rendered = render_definition((REPO / "apptainer.def").read_text(), **overrides)
    assert re.search(r"^Bootstrap: (\S+)$", rendered, re.M).group(1) == (bootstrap or "docker-daemon")
    definition = tmp_path / "repro.def"
    definition.write_text(rendered)
    recipe = SingularityParser(str(definition)).recipe["spython-base"]
    assert recipe.fromHeader == (source or "repro:latest")
    assert recipe.cmd == 'exec repro run "$@"'
    assert 'echo "repro doctor" >> /tests.sh' in recipe.install  # spython's form of %test
    assert "PYTHONNOUSERSITE=1" in recipe.environ


@pytest.fixture
def mlflow_server(tmp_path: Path):
    """A real `mlflow server` on 127.0.0.1 (sqlite, as compose runs it on PostgreSQL); yields its URI."""
    port = free_port()
    store = tmp_path / "server"
    store.mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}/mlflow.db",
         "--artifacts-destination", str(store / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        cwd=store, stdout=open(store / "server.log", "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no background job runner
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (store / "server.log").read_text()
                assert time.monotonic() < deadline, "mlflow server did not answer in 120 s"
                time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.services
def test_smoke_run_logs_to_a_tracking_server(repro, mlflow_server: str) -> None:
    from mlflow.tracking import MlflowClient

    repro.env["REPRO_IMAGE"] = "repro:under-test"
    result = repro("run", "gpt2", "--framework", "ddp", "--gpus", "1", "--max-steps", "3",
                   "--tracking-uri", mlflow_server)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (repro.cwd / "mlflow.db").exists(), "the run must not fall back to the local store"
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("repro")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["repro.framework"] == "ddp"
    assert run.data.tags["repro.image"] == "repro:under-test"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2, 3]
    assert [m.value for m in losses] == result.losses()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"events.jsonl", "recipe.yaml", "environment.json"} <= artifacts
    environment = Path(client.download_artifacts(run.info.run_id, "environment.json", str(repro.cwd)))
    assert json.loads(environment.read_text())["image"] == "repro:under-test"


@pytest.mark.units
def test_doctor_reports_the_image_it_runs_in(repro) -> None:
    repro.env.update(REPRO_IMAGE="repro:0123abcd", REPRO_GIT_SHA="0123abcd")
    result = repro.here("doctor", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["image"] == "repro:0123abcd"


@pytest.mark.units
def test_make_targets_print_the_container_commands() -> None:
    tool("make")
    image = make_dry_run("image", "BASE_IMAGE=debian", "BASE_DIGEST=sha256:0123", "TAG=t", "WITH_LBANN=0",
                         "CA_BUNDLE=/etc/ca.pem", "DEEPSPEED_OPS=cpu_adam")
    for part in ("docker build", "--build-arg BASE_IMAGE=debian", "--build-arg BASE_DIGEST=sha256:0123",
                 "--secret id=ca,src=/etc/ca.pem", '--build-arg DEEPSPEED_OPS="cpu_adam"', "--build-arg WITH_LBANN=0",
                 "--build-arg REPRO_IMAGE=repro:t", "--build-arg SOURCE_DATE_EPOCH=", "--tag repro:t"):
        assert part in image[-2] and part in image[-1]
    assert image[-1].endswith("$(docker run --rm -i --entrypoint python repro:t - < docker/labels.py) .")
    assert "--secret" not in " ".join(make_dry_run("image", "BASE_DIGEST=sha256:0123"))
    assert make_dry_run("sif", "TAG=t")[-1] == "apptainer build --build-arg FROM=repro:t repro.sif apptainer.def"
    for compose in ("docker compose", "docker-compose"):
        up = make_dry_run("compose-up", "TAG=t", f"COMPOSE={compose}", "GPUS=1")[-1]
        assert f"{compose} -f docker-compose.yml -f docker/compose.gpu.yml up --build" in up
    unpinned = subprocess.run(["make", "-s", "-C", str(REPO), "image", "BASE_DIGEST="], capture_output=True, text=True)
    assert unpinned.returncode != 0 and "docker buildx imagetools inspect" in unpinned.stdout
