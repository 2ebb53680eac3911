"""Every bad input is refused before launch, in one line: a generated walk over classes of bad input.

Each case runs `repro run` in-process (click's runner) with process starts and MLflow runs made
impossible, and asserts exit code 2, exactly one line on stderr (`repro: ...`), no traceback,
no MLflow run, no process started. A handful go through the real command line as well.
"""
from __future__ import annotations

import importlib
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from repro import cli, hardware, registry, tracking
from repro.run import extensions, preflight
from repro.run.options import Launch, LaunchError
from repro.run.preflight import CPU_PROCESSES_PER_CORE
from repro.data.sets import DATASETS
from repro.recipe import SCALES, load_file, recipe_path

pytestmark = pytest.mark.units

CASES_PER_CLASS = 22
TESTED: Counter[str] = Counter()  # cases walked per class

VGG16 = ["vgg16"]  # digits: the smoke data every checkout has
GPT2_SYNTHETIC = ["gpt2", "--set", "data.dataset=synthetic"]  # needs no data
models = st.sampled_from([VGG16, GPT2_SYNTHETIC])


def setting(key: str, value: object) -> list[str]:
    return ["--set", f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"]


INT_FIELDS = ["train.epochs", "train.batch_per_gpu", "train.max_steps", "train.log_every", "run.gpus", "run.nodes",
              "run.timeout_s", "data.max_train_samples", "data.max_val_samples", "train.eval_batch",
              "train.checkpoint_every", "train.micro_batch", "train.recompute_layers"]
FLOAT_FIELDS = ["train.optimizer.lr", "train.optimizer.weight_decay", "train.optimizer.momentum",
                "train.optimizer.eps", "train.grad_clip", "model.dropout"]
POSITIVE_FLOATS = ["train.optimizer.lr", "train.optimizer.eps", "train.grad_clip"]

# YAML-dumped by `setting`, so each keeps its Python type: a string stays a string, 2.0 stays a float
not_int = st.one_of(st.text(min_size=1, max_size=8), st.lists(st.integers(), max_size=3),
                    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.booleans(), st.floats())
VALID_NAMES = {*registry.FRAMEWORKS, *DATASETS, *registry.WORKLOADS, *SCALES,
               "fp32", "fp16", "bf16", "auto", "cpu", "cuda", "sgd", "adam", "adamw", "lamb"}

# class name -> strategy of (command-line arguments, recipe file bytes or None)
BAD_INPUTS: dict[str, st.SearchStrategy] = {
    "recipe file not a mapping of sections": st.tuples(
        st.just([]), st.one_of(st.lists(st.integers(), min_size=1), st.text(), st.integers(), st.floats())
        .map(lambda value: yaml.safe_dump(value).encode())),
    "recipe file not UTF-8 or not YAML": st.tuples(st.just([]), st.one_of(
        st.binary(min_size=1).filter(lambda b: not _utf8(b)),
        st.sampled_from([b"workload: [gpt2", b"a: b: c", b"{unclosed", b"key: 'open", b"\tworkload: gpt2\n-"]),
        st.binary(min_size=1).map(lambda b: b"workload: gpt2\n\xff" + b))),
    "recipe section not a mapping": st.tuples(st.just([]), st.builds(
        lambda section, value: _shipped_with(section, value),
        st.sampled_from(["run", "train", "data", "model", "zero"]),
        st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(min_size=1, max_size=5)))),
    "wrong type": st.builds(lambda model, key, value: model + setting(key, value),
                            models, st.sampled_from(INT_FIELDS), not_int).map(lambda a: (a, None)),
    "whole section replaced by a value": st.builds(
        lambda model, key, value: model + setting(key, value), models,
        st.sampled_from(["run", "train", "data", "model", "train.optimizer"]),
        st.one_of(st.integers(), st.text(min_size=1, max_size=5), st.lists(st.integers(), max_size=2)))
    .map(lambda a: (a, None)),
    "integer out of range": st.builds(lambda model, key, value: model + setting(key, value), models,
                                      st.sampled_from(INT_FIELDS + ["data.workers"]),
                                      st.integers(max_value=-1) | st.just(0))
    .filter(lambda a: not ("data.workers=0" in a[-1])).map(lambda a: (a, None)),
    "float out of range": st.one_of(
        st.builds(lambda model, key, value: model + setting(key, value), models, st.sampled_from(POSITIVE_FLOATS),
                  st.floats(max_value=0, allow_nan=False, allow_infinity=False)),
        st.builds(lambda model, key, value: model + setting(key, value), models,
                  st.sampled_from(["train.optimizer.momentum", "model.dropout"]),
                  st.floats(min_value=1, allow_nan=False, allow_infinity=False)
                  | st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False)),
    ).map(lambda a: (a, None)),
    "not a finite number": st.builds(lambda model, key, value: model + ["--set", f"{key}={value}"], models,
                                     st.sampled_from(FLOAT_FIELDS + ["train.target_metric"]),
                                     st.sampled_from([".nan", ".NaN", ".inf", "-.inf", ".Inf", "-.INF"]))
    .map(lambda a: (a, None)),
    "unknown field or choice": st.one_of(
        st.builds(lambda model, section, name: model + ["--set", f"{section}.{name}=1"], models,
                  st.sampled_from(["train", "run", "data", "model", "train.optimizer", "zero", "megatron"]),
                  st.from_regex(r"[a-z]{1,6}_x[a-z0-9]{0,4}", fullmatch=True)),
        st.builds(lambda model, key, value: model + ["--set", f"{key}={value}"], models,
                  st.sampled_from(["train.precision", "run.device", "train.optimizer.name", "data.dataset",
                                   "run.framework", "workload", "scale"]),
                  st.from_regex(r"[a-z][a-z0-9-]{1,10}", fullmatch=True).filter(lambda v: v not in VALID_NAMES)),
    ).map(lambda a: (a, None)),
    "cross-field rule": st.one_of(
        st.builds(lambda heads, width: GPT2_SYNTHETIC + setting("model.n_head", heads) + setting("model.d_model", width),
                  st.integers(2, 64), st.integers(2, 512)).filter(lambda a: int(a[-1].split("=")[1]) % int(a[-3].split("=")[1])),
        st.builds(lambda gpus, nodes: VGG16 + ["--gpus", str(gpus), "--nodes", str(nodes)],
                  st.integers(1, 64), st.integers(2, 16)).filter(lambda a: int(a[2]) % int(a[4])),
        st.builds(lambda batch, samples: GPT2_SYNTHETIC + setting("train.batch_per_gpu", batch)
                  + setting("data.max_train_samples", samples), st.integers(2, 10**6), st.integers(1, 10**6))
        .filter(lambda a: int(a[-3].split("=")[1]) > int(a[-1].split("=")[1])),
        st.builds(lambda tp: GPT2_SYNTHETIC + ["--framework", "megatron", "--gpus", "2"] + setting("megatron.tp", tp),
                  st.integers(3, 64)),
        st.builds(lambda size: VGG16 + setting("model.image_size", size), st.integers(33, 1024)),
        st.builds(lambda betas: GPT2_SYNTHETIC + setting("train.optimizer.betas", betas),
                  st.lists(st.floats(0, 0.99), max_size=5).filter(lambda b: len(b) != 2)),
        st.builds(lambda dataset: VGG16 + setting("data.dataset", dataset), st.sampled_from(["wikitext-2", "wikitext-103"])),
        st.builds(lambda micro: GPT2_SYNTHETIC + setting("train.micro_batch", micro), st.integers(3, 10**6)),  # batch 8
        st.builds(lambda layers: GPT2_SYNTHETIC + setting("train.recompute_layers", layers), st.integers(1, 4)),  # no recompute
        st.builds(lambda layers: GPT2_SYNTHETIC + setting("train.recompute", "full") + setting("train.recompute_layers", layers),
                  st.integers(5, 10**6)),  # 4 blocks
    ).map(lambda a: (a, None)),
    "memory setting the framework does not apply": st.one_of(
        st.builds(lambda framework, value: GPT2_SYNTHETIC + ["--framework", framework, "--gpus", "2"] + value,
                  st.sampled_from(["torchgpipe", "pipedream"]),
                  st.sampled_from([setting("train.recompute", "full"), setting("train.recompute", "selective"),
                                   setting("train.micro_batch", 2), setting("train.micro_batch", 4)])),
        st.builds(lambda value: GPT2_SYNTHETIC + ["--framework", "torch-pipeline", "--gpus", "2"] + value,  # micro-batches it takes
                  st.sampled_from([setting("train.recompute", "full"), setting("train.recompute", "selective")])),
        st.just(GPT2_SYNTHETIC + ["--framework", "fsdp", "--gpus", "2"] + setting("train.recompute", "selective")),
        st.just(GPT2_SYNTHETIC + ["--framework", "megatron", "--gpus", "2"] + setting("train.recompute", "selective")
                + setting("train.recompute_layers", 2)),
    ).map(lambda a: (a, None)),
    "malformed --set": st.builds(lambda model, text: model + ["--set", text], models, st.one_of(
        st.from_regex(r"[a-z.]{1,12}", fullmatch=True),  # no '='
        st.from_regex(r"(\.[a-z]{1,5}|[a-z]{1,5}\.\.[a-z]{1,5}|[a-z]{1,5}\.)=[0-9]", fullmatch=True),  # empty key part
        st.sampled_from(["train.epochs=[1,", "train.epochs={a", "run.gpus='2", "train.epochs=*x", "=3"]),
        st.builds(lambda key, sub: f"{key}.{sub}=1", st.sampled_from(["train.epochs", "seed", "run.gpus", "model.n_head"]),
                  st.from_regex(r"[a-z]{1,5}", fullmatch=True)),  # into a value
    )).map(lambda a: (a, None)),
    "bad command-line option value": st.builds(
        lambda model, option, value: model + [option, value], models,
        st.sampled_from(["--gpus", "--nodes", "--epochs", "--max-steps", "--seed", "--node-rank"]),
        st.text(min_size=1, max_size=6).filter(lambda t: not _int(t) and not t.startswith("-")),
    ).map(lambda a: (a, None)),
    "more devices than the machine has": st.one_of(
        st.builds(lambda extra: GPT2_SYNTHETIC + ["--set", "run.device=cuda", "--gpus", str(hardware.gpu_count() + extra)],
                  st.integers(1, 10**6)),
        st.builds(lambda extra: GPT2_SYNTHETIC + ["--set", "run.device=cpu", "--set", "data.max_train_samples=null",
                                                  "--set", "train.batch_per_gpu=1",
                                                  "--gpus", str(CPU_PROCESSES_PER_CORE * hardware.cpu_cores() + extra)],
                  st.integers(1, 200)),
    ).map(lambda a: (a, None)),
    "data missing or too small": st.one_of(
        st.builds(lambda batch: VGG16 + ["--set", "data.max_train_samples=null"] + setting("train.batch_per_gpu", batch),
                  st.integers(1434, 10**7)),  # digits has 1,433 training images
        st.builds(lambda size: VGG16 + ["--set", "data.dataset=imagenet"] + setting("model.image_size", size),
                  st.integers(32, 512)),  # not in the test data
    ).map(lambda a: (a, None)),
}


def _int(text: str) -> bool:
    """Whether click's INT type accepts `text` (Python's int(): ' 5', '+5', '1_0', '٣' all are)."""
    try:
        int(text)
        return True
    except ValueError:
        return False


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _shipped_with(section: str, value: object) -> bytes:
    raw = yaml.safe_load(recipe_path("gpt2", "smoke").read_text())
    raw[section] = value
    return yaml.safe_dump(raw).encode()


class Started(AssertionError):
    """A bad input reached a launch: a process or an MLflow run was about to start."""


@pytest.fixture
def nothing_may_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    def refuse(*args: object, **kwargs: object) -> None:
        raise Started(f"started: {args[:2]}")

    importlib.import_module("repro.runner")  # its launcher classes derive from Popen: defined before it is replaced
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(tracking.Run, "create", refuse)
    monkeypatch.setattr(tracking.Run, "reopen", refuse)
    monkeypatch.setenv("REPRO_DATA", str(REPO / "data"))
    monkeypatch.setenv("REPRO_STAGED_DATA", str(tmp_path / "nothing-staged"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def assert_refused(args: list[str], recipe: bytes | None, scratch: Path) -> None:
    if recipe is not None:
        (scratch / "recipe.yaml").write_bytes(recipe)
        args = ["gpt2", "--recipe", str(scratch / "recipe.yaml")]
    result = CliRunner().invoke(cli.main, ["run", *args])
    assert not isinstance(result.exception, Started), f"{args}: {result.exception}"
    assert result.exit_code == 2, f"{args}: exit {result.exit_code}: {result.output}{result.exception!r}"
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("repro: "), f"{args}: {result.stderr}"
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert not (scratch / "mlflow.db").exists() and not (scratch / "runs").exists()


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_refused_in_one_line_before_launch(name: str, nothing_may_start: Path) -> None:
    @settings(max_examples=CASES_PER_CLASS, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(BAD_INPUTS[name])
    def walk(case: tuple[list[str], bytes | None]) -> None:
        TESTED[name] += 1
        assert_refused(*case, nothing_may_start)

    walk()
    print(f"{TESTED[name]:4d} cases: {name}")  # the closing note's table (pytest -s)
    assert TESTED[name] >= CASES_PER_CLASS // 2  # the strategy yields enough distinct cases


@pytest.mark.parametrize("args, recipe", [
    (["gpt2"], b"workload: gpt2\n\xff\n"),
    (["gpt2", "--set", "run=5"], None),
    (["vgg16", "--gpus", "1000000", "--set", "data.max_train_samples=null"], None),
], ids=["invalid-utf8", "run=5", "million-gpus"])
def test_real_command_line_refuses_in_one_line(repro, args: list[str], recipe: bytes | None) -> None:
    if recipe is not None:
        (repro.cwd / "recipe.yaml").write_bytes(recipe)
        args = [*args, "--recipe", "recipe.yaml"]
    out = repro("run", *args)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("repro: "), out.stderr
    assert "Traceback" not in out.stderr
    assert not (repro.cwd / "mlflow.db").exists() and not (repro.cwd / "runs").exists()


def test_table2_names_why_each_cell_cannot_run_and_reports_carry_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paper scale with no paper data (and, here, fewer GPUs than the cells): every cell gets one line
    with the reasons and the fixing commands, --dry-run runs nothing, the report says the same."""
    from repro import table2
    from repro.matrix import expand, load_matrix
    from repro.report.collect import collect

    monkeypatch.setenv("REPRO_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("REPRO_STAGED_DATA", str(tmp_path / "nothing-staged"))
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = CliRunner().invoke(cli.main, ["table2", "--scale", "paper", "--rows", "ddp", "--dry-run", "--tracking-uri", uri])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if " cannot run: " in line]
    assert len(lines) == 14 and result.stdout == ""  # 2 workloads x 7 GPU counts, none to run
    assert "matrix: 14 runs, 0 already in MLflow, 0 to run, 14 cannot run here" in result.stderr
    assert not (tmp_path / "reports").exists() and not (tmp_path / "runs").exists()
    for line in lines:
        workload, _, gpus = line.split()[:3]
        gpus = int(gpus.removesuffix("g"))
        per_node = min(gpus, 4)  # configs/table2.yaml: 4 GPUs per node at paper scale
        fix = "repro data prepare wikitext-103" if workload == "gpt2" else "repro data prepare imagenet"
        assert fix in line, line
        if gpus > per_node:
            assert f"--nodes {gpus // per_node} with the local launcher" in line, line
            assert f"fix: repro run {workload} --framework ddp --gpus {gpus} --nodes {gpus // per_node} --scale paper " \
                   f"--launcher slurm --experiment table2-paper" in line, line
        elif hardware.gpu_count() < per_node:
            assert f"needs {per_node} GPU{'s' * (per_node > 1)}, this machine has {hardware.gpu_count()}" in line, line

    cells = expand(load_matrix(rows=["ddp"]), "paper")
    todo, counts = table2.plan(cells, uri, "table2-paper", out=lambda line: None)
    assert todo == [] and counts["blocked"] == 14
    results = collect(cells, uri, "table2-paper")
    assert [r.error for r in results] == [c.skip for c in cells] and all(r.status == "missing" for r in results)


def test_zero_on_cpu_stand_ins_without_a_compiler_or_headers_is_refused_naming_the_packages(monkeypatch, tmp_path):
    """DeepSpeed builds its shared-memory op as a CPU run starts unless it is installed prebuilt; a machine that
    must build it and cannot is told before."""
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.framework=zero", "run.gpus=2", "run.device=cpu"])
    preflight.check_devices(recipe, Launch())  # this machine builds it
    monkeypatch.setattr(extensions.shutil, "which", lambda program: None if program == "c++" else f"/usr/bin/{program}")
    monkeypatch.setattr(extensions.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})  # no Python.h there
    with pytest.raises(LaunchError, match=r"^run.framework: zero on CPU stand-ins builds a C\+\+ extension as it "
                                          r"starts, and this machine lacks a compiler or Python's headers: "
                                          r"apt-get install g\+\+ python3-dev$"):
        preflight.check_devices(recipe, Launch())
    preflight.check_devices(load_file(recipe_path("gpt2", "smoke"), ["run.gpus=2", "run.device=cpu"]), Launch())
    monkeypatch.setattr(preflight, "installed_prebuilt", lambda extension: True)  # as in the image: nothing to build
    preflight.check_devices(recipe, Launch())


def test_zero_fp16_on_a_cpu_that_computes_no_fp16_is_refused_in_one_line_before_launch(monkeypatch):
    """DeepSpeed refuses fp16 on a CPU without oneDNN's fp16 in every rank as it starts; the kit refuses it first,
    naming train.precision, by the same test DeepSpeed makes (so the two agree on this machine). DDP's autocast
    trains fp16 on any CPU, and ZeRO's bf16 is not refused."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert hardware.cpu_computes_fp16() == bool(CPU_Accelerator().is_fp16_supported())
    zero_fp16 = load_file(recipe_path("gpt2", "smoke"), ["run.framework=zero", "run.gpus=2", "run.device=cpu",
                                                         "train.precision=fp16"])
    monkeypatch.setattr(hardware, "cpu_computes_fp16", lambda: False)
    monkeypatch.setattr(hardware, "cpu_model", lambda: "AMD EPYC")
    with pytest.raises(LaunchError, match=r"^train.precision: fp16 under zero on CPU stand-ins, and this CPU \(AMD "
                                          r"EPYC\) computes no fp16: DeepSpeed trains fp16 on a CPU only where oneDNN "
                                          r"computes fp16 \(AVX512-FP16 or AMX-FP16\); set train.precision to bf16 "
                                          r"or fp32, or run on GPUs$"):
        preflight.check_devices(zero_fp16, Launch())
    for sets in (["run.framework=ddp", "train.precision=fp16"], ["run.framework=zero", "train.precision=bf16"]):
        preflight.check_devices(load_file(recipe_path("gpt2", "smoke"), ["run.gpus=2", "run.device=cpu", *sets]), Launch())
    monkeypatch.setattr(hardware, "cpu_computes_fp16", lambda: True)
    preflight.check_devices(zero_fp16, Launch())


def test_building_the_ops_ahead_says_why_not_where_this_machine_cannot(monkeypatch, tmp_path):
    """`make setup` builds DeepSpeed's CPU op ahead of the first ZeRO run; without a compiler it says what to
    install and goes on (setup does not fail), and where the op is installed prebuilt it builds nothing."""
    said: list[str] = []
    monkeypatch.setattr(extensions.shutil, "which", lambda program: None)
    monkeypatch.setattr(extensions.subprocess, "run", lambda *a, **k: pytest.fail("nothing may be built"))
    extensions.build_cpu_extensions(said.append)
    assert said == ["zero: deepspeed.ops.comm.deepspeed_shm_comm_op not built: run.framework: zero on CPU stand-ins "
                    "builds a C++ extension as it starts, and this machine lacks a compiler or Python's headers: "
                    "apt-get install g++"]
    monkeypatch.setattr(extensions, "installed_prebuilt", lambda extension: True)
    said.clear()
    extensions.build_cpu_extensions(said.append)
    assert said == ["zero: deepspeed.ops.comm.deepspeed_shm_comm_op is installed prebuilt"]


def test_a_run_over_its_gpus_memory_is_refused_naming_the_setting_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2-medium under DDP at paper scale fits a V100-16GB with its recipe's own settings (every block
    recomputed, micro-batches of 8: 12.1 GiB); without them (every activation kept) it needs 54.5 GiB per GPU,
    and the refusal names micro-batches of 4 (no recompute needed), with the model's peak for the recipe
    with that --set applied; torch's 1F1B at 1 GPU applies neither setting (its schedule sets its
    micro-batches), so its refusal names none."""
    from repro.model import costs

    monkeypatch.setattr(hardware, "gpu_count", lambda: 1)
    monkeypatch.setattr(hardware, "gpu_memory_bytes", lambda: 16 * 2**30)
    paper = recipe_path("gpt2", "paper")
    preflight.check_memory(load_file(paper, ["run.framework=ddp", "run.gpus=1"]), Launch())  # not refused
    unset = ["run.framework=ddp", "run.gpus=1", "train.recompute=null", "train.micro_batch=null"]
    with pytest.raises(LaunchError) as refused:
        preflight.check_memory(load_file(paper, unset), Launch())
    fitted = load_file(paper, [*unset, "train.micro_batch=4"])
    peak = costs.predict(costs.cell_of(fitted)).fit_bytes
    assert round(peak / 2**30, 2) == 13.17
    assert str(refused.value) == (
        "memory: predicted 54.5 GiB per GPU (ddp, repro.model.costs), over this machine's GPU memory, 16.0 GiB; "
        f"--set train.micro_batch=4 fits ({peak / 2**30:.1f} GiB per GPU); --ignore-memory-check to launch anyway")
    with pytest.raises(LaunchError) as refused:
        preflight.check_memory(load_file(paper, ["run.framework=pipedream", "run.gpus=1"]), Launch())  # no setting of its own
    assert str(refused.value).endswith("over this machine's GPU memory, 16.0 GiB; --ignore-memory-check to launch anyway")
