"""Megatron (megatron-core) on CPU: the pinned CPU adaptations, recipe checks, GPTModel's arithmetic
against the plain GPT-2, hybrid runs, what each run records it trained with, memory per rank."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch

import logits_probe
import ranks
from conftest import REPO, Repro, Result
from repro import tracking
from repro.adapters import megatron_cpu
from repro.adapters.megatron import MegatronAdapter
from repro.adapters.megatron_model import qkv_by_head
from repro.recipe import load_file, recipe_path
from repro.schema import RecipeError
from repro.workloads.gpt2 import build_gpt2

STEPS = 5
TOLERANCE = 1e-5  # fp32


def smoke(*overrides: str):
    return load_file(recipe_path("gpt2", "smoke"), ["run.framework=megatron", *overrides])


# -- the CPU adaptations, pinned to the megatron-core they were read from --------------------------

MEGATRON_CORE = "0.16.1"
# sha256 (first 16 hex digits) of the source of each internal that repro/adapters/megatron_cpu.py
# works around or relies on, read from megatron-core 0.16.1. When one changes, re-read it, check the
# adaptation still holds (this file's other tests must stay green), then record the new digest.
PINNED_SOURCE = {
    "megatron.core.utils:GlobalMemoryBuffer.get_tensor": "2b843a83eb762098",
    "megatron.core.parallel_state:get_global_memory_buffer": "77b942465509bf83",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add": "e5e9ab39a7c1e085",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork": "6821e1e397253d43",
    "megatron.core.tensor_parallel.random:initialize_rng_tracker": "4bc461df7c7f7a43",
    "megatron.core.tensor_parallel.random:get_cuda_rng_tracker": "6b91df8078dcd24b",
    "megatron.core.transformer.utils:get_default_causal_mask": "4638b2c6665fc284",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward_torch_softmax": "af74f78c0020665e",
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward": "1450046fe34ea330",
    "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining": "84399467bcc06296",
    "megatron.core.tensor_parallel.random:_get_all_rng_states": "0fd22c8e723e13ee",
    "megatron.core.tensor_parallel.random:_set_all_rng_states": "ecfe91a8fe3d8a00",
    "megatron.core.tensor_parallel.random:_fork_rng": "5a75f51c563dd3e2",
    "megatron.core.tensor_parallel.random:CheckpointFunction.forward": "07b45db6c50f404b",
    "megatron.core.tensor_parallel.random:CheckpointFunction.backward": "43b157a2ebec22ef",
}


def source_digest(item: str) -> str:
    module, name = item.split(":")
    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:16]


@pytest.mark.units
def test_pin_guard_megatron_core_internals_unchanged():
    assert importlib.metadata.version("megatron-core") == MEGATRON_CORE
    assert set(PINNED_SOURCE) == set(megatron_cpu.PINNED)
    changed = [item for item, digest in PINNED_SOURCE.items() if source_digest(item) != digest]
    assert not changed, f"megatron-core changed what the CPU adaptations rely on: {changed}"


@pytest.fixture
def cpu_adaptations(monkeypatch):
    """megatron_cpu.install() on this process, megatron-core's globals restored afterwards."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    for module, name in ((parallel_state, "_GLOBAL_MEMORY_BUFFER"), (mcore_random, "_CUDA_RNG_STATE_TRACKER"),
                         (mcore_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED"), (mcore_random, "_get_all_rng_states"),
                         (mcore_random, "_set_all_rng_states")):
        assert hasattr(module, name), f"pin guard: megatron-core has no {module.__name__}.{name} any more"
        monkeypatch.setattr(module, name, getattr(module, name))
    megatron_cpu.install()
    return parallel_state, mcore_random


@pytest.mark.units
def test_pin_guard_megatron_core_reads_the_cpu_buffer_and_tracker(cpu_adaptations):
    parallel_state, mcore_random = cpu_adaptations
    buffer = parallel_state.get_global_memory_buffer()
    assert isinstance(buffer, megatron_cpu.CpuMemoryBuffer)
    first = buffer.get_tensor((2, 3, 4), torch.float32, "mpu")
    again = buffer.get_tensor((4, 6), torch.float32, "mpu")
    assert first.device.type == "cpu" and first.shape == (2, 3, 4) and again.data_ptr() == first.data_ptr()
    assert isinstance(mcore_random.get_cuda_rng_tracker(), megatron_cpu.CpuRngTracker)


@pytest.mark.units
def test_cpu_tracker_keeps_its_own_stream(cpu_adaptations):
    """Dropout inside fork() draws from the named stream, continues it on the next fork, and leaves
    the default generator where it was: the attention dropout of a tp rank, as on CUDA."""
    _, mcore_random = cpu_adaptations
    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(7)
    with tracker.fork():
        first = torch.rand(5)
    with tracker.fork():
        second = torch.rand(5)
    outer = torch.rand(5)
    torch.manual_seed(1234)
    assert torch.equal(torch.cat([first, second]), torch.rand(10))
    torch.manual_seed(7)
    assert torch.equal(outer, torch.rand(5))
    with pytest.raises(ValueError, match="already added"):
        tracker.add("model-parallel-rng", 99)


@pytest.mark.units
def test_megatron_cores_checkpoint_recomputes_the_same_dropout_on_the_cpu(cpu_adaptations):
    """CheckpointFunction (recompute) saves the RNG states before its forward and restores them before
    recomputing, through megatron_cpu's CPU states: the CPU generator's dropout and the tracker's stream draw
    the same masks again, so the gradient is the plain one, bit for bit."""
    _, mcore_random = cpu_adaptations
    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", 1234)

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            inner = torch.nn.functional.dropout(x, 0.5)
        return torch.nn.functional.dropout(inner * x, 0.5)

    def gradient(recompute: bool) -> torch.Tensor:
        torch.manual_seed(3)
        tracker.set_states({"model-parallel-rng": megatron_stream(1234)})
        x = torch.rand(64, requires_grad=True)
        (mcore_random.checkpoint(block, False, x) if recompute else block(x)).sum().backward()
        return x.grad

    assert torch.equal(gradient(True), gradient(False))


def megatron_stream(seed: int) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.get_rng_state()


@pytest.mark.units
def test_the_schedules_cuda_allocations_land_on_the_cpu():
    with megatron_cpu.CudaAllocationsOnCpu():
        count = torch.zeros([], dtype=torch.int, device="cuda")
        plain = torch.ones(2) + 1
    assert count.device.type == "cpu" and plain.tolist() == [2.0, 2.0]


@pytest.mark.units
def test_causal_mask_is_megatron_cores():
    """The explicit mask equals what transformer/utils.py would build on CUDA (read from its source)."""
    mask = megatron_cpu.causal_mask(5)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], torch.triu(torch.ones(5, 5), diagonal=1).bool())
    assert 'torch.triu(torch.ones(sq, sq, device="cuda"), diagonal=1).bool()' in inspect.getsource(
        importlib.import_module("megatron.core.transformer.utils").get_default_causal_mask)


@pytest.mark.units
def test_qkv_rows_regrouped_head_by_head():
    heads, width = 2, 3  # 2 heads of 3 units: q rows 0-5, k rows 6-11, v rows 12-17
    rows = qkv_by_head(torch.arange(3 * heads * width).float().unsqueeze(1), heads).squeeze(1).tolist()
    assert rows == [0, 1, 2, 6, 7, 8, 12, 13, 14, 3, 4, 5, 9, 10, 11, 15, 16, 17]


# -- recipe checks, no processes ------------------------------------------------------------------


@pytest.mark.units
def test_world_must_be_tp_times_dp():
    with pytest.raises(RecipeError, match=r"megatron\.tp: gpus \(6\) must be tp \(4\) x dp: 6 % 4 = 2"):
        smoke("run.gpus=6", "megatron.tp=4")


@pytest.mark.units
def test_lamb_is_not_a_megatron_optimizer():
    with pytest.raises(RecipeError, match="megatron.optimizer: megatron-core's optimizers are adam, adamw, sgd, not lamb"):
        smoke("megatron.optimizer.name=lamb")


@pytest.mark.units
def test_variant_names_the_table_row():
    assert MegatronAdapter.variant(smoke("run.gpus=4", "megatron.tp=1")) == "megatron-data"
    assert MegatronAdapter.variant(smoke("run.gpus=4", "megatron.tp=4")) == "megatron-intra"
    assert MegatronAdapter.variant(smoke("run.gpus=4", "megatron.tp=2")) == "megatron-hybrid"


@pytest.mark.units
def test_vgg16_fails_at_once_in_one_line(repro):
    result = repro.here("run", "vgg16", "--framework", "megatron", "--gpus", "2")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "Megatron's intra-layer scheme targets transformers" in result.stderr
    assert not (result.cwd / "runs").exists()


# -- Megatron's arithmetic: same weights, same logits and losses ----------------------------------


def probe(folder: Path, framework: str, gpus: int, *overrides: str) -> dict:
    """Train STEPS steps through tests/logits_probe.py in the ranks tier; its losses, memory and logits."""
    recipe = load_file(recipe_path("gpt2", "smoke"), [
        f"run.framework={framework}", f"run.gpus={gpus}", f"train.max_steps={STEPS}", *overrides,
    ])
    run_dir = ranks.write_run_file(recipe, folder / f"{framework}-{gpus}g-{'-'.join(overrides)}")
    ranks.start_ranks(gpus, logits_probe.main, run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {
        "losses": [e["loss"] for e in events if e["event"] == "step"],
        "ranks": next(e["ranks"] for e in events if e["event"] == "epoch"),
        "states": [torch.load(run_dir / f"state-{rank}.pt") for rank in range(gpus)],
        **torch.load(run_dir / "logits.pt"),
    }


@pytest.fixture(scope="module")
def same_weights(tmp_path_factory) -> dict[str, dict]:
    """Global batch 16 each: plain GPT-2 under DDP on 1 process, Megatron tp=1 x dp=2, tp=2 x dp=1;
    and tp=4 with dropout (the paper scale's 0.1) for the replicas and the bytes per rank."""
    folder = tmp_path_factory.mktemp("megatron-arithmetic")
    spec = smoke().optimizer()  # megatron-core's AdamW, for all three (YAML reads 1e-08 as text: eps stays default)
    optimizer = json.dumps({"name": spec.name, "lr": spec.lr, "weight_decay": spec.weight_decay})
    return {
        "plain": probe(folder, "ddp", 1, "train.batch_per_gpu=16", f"train.optimizer={optimizer}"),
        "tp1": probe(folder, "megatron", 2, "megatron.tp=1"),
        "tp2": probe(folder, "megatron", 2, "megatron.tp=2"),
        "tp4": probe(folder, "megatron", 4, "megatron.tp=4", "model.dropout=0.1"),
    }


@pytest.mark.ranks
@pytest.mark.parametrize("run", ["tp1", "tp2"])
def test_same_logits_and_losses_as_plain_gpt2(same_weights, run):
    plain, megatron = same_weights["plain"], same_weights[run]
    assert len(megatron["losses"]) == STEPS
    gaps = [abs(a - b) for a, b in zip(megatron["losses"], plain["losses"])]
    print(f"{run}: max loss gap {max(gaps):.2e}, max logit gap {(megatron['after'] - plain['after']).abs().max():.2e}")
    assert megatron["losses"] == pytest.approx(plain["losses"], abs=TOLERANCE, rel=0)
    for moment in ("before", "after"):
        assert megatron[moment].shape == plain[moment].shape == (4, 64, 256)
        assert (megatron[moment] - plain[moment]).abs().max() < TOLERANCE
    assert (plain["after"] - plain["before"]).abs().max() > 100 * TOLERANCE  # training moved the logits


@pytest.mark.ranks
def test_tp_peers_keep_replicated_weights_equal_under_dropout(same_weights):
    """Dropout on replicated activations must draw the same mask on every tp peer, or the replicas drift."""
    states = same_weights["tp4"]["states"]
    replicated = [k for k in states[0] if "layernorm" in k or "position_embeddings" in k
                  or k.endswith(("linear_proj.bias", "linear_fc2.bias"))]
    sharded = [k for k in states[0] if k.endswith("linear_fc1.weight")]
    assert len(replicated) == 4 * 6 + 3 and len(sharded) == 4
    for key in replicated:
        assert all(torch.equal(state[key], states[0][key]) for state in states[1:]), key
    for key in sharded:
        assert not torch.equal(states[0][key], states[1][key])


@pytest.mark.ranks
def test_tp2_matches_tp1(same_weights):
    assert same_weights["tp2"]["losses"] == pytest.approx(same_weights["tp1"]["losses"], abs=TOLERANCE, rel=0)
    assert (same_weights["tp2"]["after"] - same_weights["tp1"]["after"]).abs().max() < TOLERANCE


# -- runs through the CLI, recorded in MLflow ------------------------------------------------------


@dataclasses.dataclass
class CliRun:
    result: Result
    events: list[dict]
    client: object
    mlflow: object  # the one MLflow run of its scratch folder

    def history(self, key: str) -> list[float]:
        return [m.value for m in self.client.get_metric_history(self.mlflow.info.run_id, key)]

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.events if e["event"] == "step"]

    def ranks(self) -> list[dict]:
        return next(e["ranks"] for e in self.events if e["event"] == "epoch")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, CliRun]:
    """tp=2 (the issue's command) and tp=2 x dp=2 (global batch 16, as tp=2's); STEPS steps each."""
    command = ("run", "gpt2", "--framework", "megatron", "--scale", "smoke", "--max-steps", str(STEPS))
    runs = {}
    for name, gpus, extra in (
        ("tp2", 2, ["--set", "megatron.tp=2"]),
        ("hybrid", 4, ["--set", "megatron.tp=2", "--set", "train.batch_per_gpu=4"]),
    ):
        repro = Repro(tmp_path_factory.mktemp(f"megatron-{name}"))
        result = repro(*command, "--gpus", str(gpus), *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        client = tracking.client(repro.tracking_uri)
        (mlflow,) = client.search_runs([client.get_experiment_by_name("repro").experiment_id])
        runs[name] = CliRun(result, result.events(), client, mlflow)
    return runs


@pytest.mark.end_to_end
def test_issue_command_finishes(cli_runs):
    run = cli_runs["tp2"]
    assert run.result.returncode == 0 and run.mlflow.info.status == "FINISHED"
    assert len(run.losses()) == STEPS


@pytest.mark.end_to_end
def test_hybrid_trains_and_lands_in_mlflow(cli_runs):
    hybrid = cli_runs["hybrid"]
    run = hybrid.mlflow
    assert run.info.status == "FINISHED"
    assert run.data.tags["repro.framework"] == "megatron" and run.data.params["megatron.tp"] == "2"
    assert {k: v for k, v in run.data.params.items() if k.endswith(("_impl", "layer_spec"))} == {
        "effective.model_impl": "megatron-core GPTModel", "effective.layer_spec": "local",
        "effective.dp_impl": "repro all-reduce (megatron-core DDP needs CUDA)",
        "effective.optimizer_impl": "torch AdamW (megatron-core's needs CUDA)",
    }
    history = hybrid.history("train/loss")
    assert history == pytest.approx(hybrid.losses()) and len(history) == STEPS
    assert history[-1] < history[0]
    # dp=2 with 4 samples a rank sees the same global batch of 16 as tp=2 alone: same losses.
    assert history == pytest.approx(cli_runs["tp2"].losses(), abs=TOLERANCE, rel=0)
    assert {f"memory/rank{r}/model_state_bytes" for r in range(4)} <= set(run.data.metrics)


@pytest.mark.end_to_end
def test_parameter_share_per_rank_falls_as_tp_grows(cli_runs, same_weights):
    plain_bytes = sum(p.numel() * 4 for p in build_gpt2(smoke().model).parameters())
    parameters = {tp: same_weights[f"tp{tp}"]["ranks"] for tp in (1, 2, 4)}
    for run in cli_runs.values():
        logged = run.mlflow.data.metrics
        for rank in run.ranks():
            held = rank["parameters"] + rank["gradients"] + rank["optimizer"]
            assert logged[f"memory/rank{rank['rank']}/model_state_bytes"] == held
    share = {tp: {r["parameters"] for r in ranks} for tp, ranks in parameters.items()}
    assert all(len(values) == 1 for values in share.values())  # every rank of a run holds as much
    share = {tp: values.pop() for tp, values in share.items()}
    print(f"parameter bytes per rank by tp: {share} (plain GPT-2: {plain_bytes})")
    assert share[1] == plain_bytes
    assert share[1] > share[2] > share[4] > plain_bytes / 4  # layer norms and biases stay replicated


@pytest.mark.units
def test_doctor_lists_the_gpu_path_until_a_result_is_committed(tmp_path, monkeypatch):
    from repro import doctor

    monkeypatch.setattr(doctor, "MEASURED", tmp_path)
    command = "python bench/gpu_check.py --only gpt2:megatron"
    assert doctor.gpu_paths()["megatron"].startswith(f"not yet run on a GPU: {command}")
    (tmp_path / "gpu_check-megatron-H100-2026-12-03.json").write_text("{}")
    assert doctor.gpu_paths()["megatron"] == "measured: gpu_check-megatron-H100-2026-12-03.json"


@pytest.mark.units
def test_gpu_check_judges_megatron_against_the_plain_loss_with_parity_bands():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    from repro.parity import TOLERANCE

    plain = {"losses": [5.0, 4.0, 3.0]}
    cell = {"losses": [5.0, 4.02, 3.01], "device_type": "cuda", "precision": "bf16"}
    assert gpu_check.loss_against(cell, plain, TOLERANCE) == {
        "max_loss_diff_vs_plain": pytest.approx(0.02), "tolerance": 5e-2, "verdict": "pass"}
    assert gpu_check.loss_against({**cell, "precision": "fp32"}, plain, TOLERANCE)["verdict"] == "FAIL"
    assert gpu_check.loss_against({**cell, "device_type": "cpu"}, plain, TOLERANCE)["verdict"] == "measured (no band)"
    assert gpu_check.loss_against({**cell, "error": "out of memory"}, plain, TOLERANCE) == {}
    assert [name for name, gpus, _ in gpu_check.MEGATRON_VARIANTS if gpus == 2] == [
        "megatron-tp2", "megatron-dp2-distributed-optimizer"]
