"""DeepSpeed ZeRO end to end: its arithmetic against DDP, the model state each stage holds, its errors.

The derivation of the bytes each rank holds (fp32, Adam; every term counted in 4-byte elements):
Psi parameters, N ranks, B elements per reduction bucket, Psi_1 parameters of the first layer.

    DDP      params 4 Psi      grads 4 Psi + 4 Psi (reducer buckets)   Adam 8 Psi
    stage 1  params 4 Psi      grads 4 Psi + 4 B                        master + Adam 12 Psi / N
    stage 2  params 4 Psi      grads 4 Psi / N + 4 B                    master + Adam 12 Psi / N
    stage 3  params 4 Psi / N  grads 4 Psi / N + 4 B                    master + Adam 12 Psi / N
             + 4 Psi_1 (the first layer is still gathered when backward ends)

docs/memory.md explains each term.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ranks
from conftest import REPO, Repro
from references import STEPS, gpt2
from repro import registry
from repro.recipe import load_file
from repro.schema import RecipeError

ADAM = "{name: adam, lr: 0.001, weight_decay: 0.01}"
SAME_ADAM = [f"train.optimizer={ADAM}", f"zero.optimizer={ADAM}"]
FRAMEWORKS = {"ddp": ["run.framework=ddp"]} | {f"stage{s}": ["run.framework=zero", f"zero.stage={s}"] for s in (1, 2, 3)}
SMOKE = REPO / "configs" / "gpt2-smoke.yaml"
FOUR_RANKS = ["run.gpus=4", "train.max_steps=3", "data.max_val_samples=64", *SAME_ADAM]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The events of the whole GPT-2 smoke model under DDP and ZeRO stages 1-3 on 4 ranks, all with the same Adam."""
    folder = tmp_path_factory.mktemp("zero4")
    return {name: ranks.train(load_file(SMOKE, [*FOUR_RANKS, *sets]), folder / name) for name, sets in FRAMEWORKS.items()}


def losses(events: list[dict]) -> list[float]:
    return [e["loss"] for e in events if e["event"] == "step"]


def model_state(events: list[dict]) -> int:
    """The largest model state of any rank (what MLflow records as memory/model_state_bytes)."""
    (epoch,) = [e for e in events if e["event"] == "epoch"]
    return max(r["parameters"] + r["gradients"] + r["optimizer"] for r in epoch["ranks"])


def derived_bytes(name: str, params: int, first_layer: int, ranks: int, bucket: int) -> float:
    """The table in this module's docstring, in bytes."""
    master_and_adam = 12 * params / ranks
    return {
        "ddp": 4 * params + 8 * params + 8 * params,
        "stage1": 4 * params + (4 * params + 4 * bucket) + master_and_adam,
        "stage2": 4 * params + (4 * params / ranks + 4 * bucket) + master_and_adam,
        "stage3": (4 * params / ranks + 4 * first_layer) + (4 * params / ranks + 4 * bucket) + master_and_adam,
    }[name]


@pytest.mark.ranks
def test_every_stage_trains_like_ddp_on_two_ranks(references) -> None:
    """Parity's recipes (tests/references.py): the same Adam for DDP and every stage."""
    ddp = references.losses(gpt2("ddp", 2))
    assert len(ddp) == STEPS and ddp[-1] < ddp[0]
    for stage in (1, 2, 3):
        zero = references.losses(gpt2("zero", 2, f"zero.stage={stage}"))
        assert len(zero) == STEPS
        assert max(abs(a - b) for a, b in zip(zero, ddp)) < 1e-5, (stage, zero, ddp)


@pytest.mark.ranks
def test_model_state_per_rank_shrinks_with_the_stage_as_derived(four_ranks: dict[str, list[dict]]) -> None:
    recipe = load_file(SMOKE)
    model = registry.workload_class("gpt2")(recipe.model, recipe.data, Path()).build_model()
    params = sum(p.numel() for p in model.parameters())
    first_layer = sum(p.numel() for p in model[0].parameters())
    bucket = recipe.options("zero").reduce_bucket_size
    measured = {name: model_state(events) for name, events in four_ranks.items()}
    assert measured["ddp"] > measured["stage1"] > measured["stage2"] > measured["stage3"]
    for name, value in measured.items():
        derived = derived_bytes(name, params, first_layer, 4, bucket)
        print(f"{name}: {value} bytes per rank, {value / measured['ddp']:.3f} of DDP (derived {derived:.0f})")
        assert value == pytest.approx(derived, rel=0.10), name


@pytest.mark.end_to_end
def test_zero_run_lands_in_mlflow_with_memory_and_deepspeed_config(repro: Repro) -> None:
    from mlflow.tracking import MlflowClient

    sets = [arg for value in [*FOUR_RANKS, *FRAMEWORKS["stage3"]] for arg in ("--set", value)]
    out = repro("run", "gpt2", "--framework", "zero", "--gpus", "4", *sets)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(tracking_uri=repro.tracking_uri)
    (run,) = [
        r for r in client.search_runs(client.get_experiment_by_name("repro").experiment_id)
        if r.data.params.get("zero.stage") == "3" and r.data.tags["repro.framework"] == "zero"
    ]
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["memory/model_state_bytes"] == model_state(out.events())
    for key in ("memory/peak_bytes", *(f"memory/rank{r}/model_state_bytes" for r in range(4))):
        assert metrics[key] > 0, key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"deepspeed_config.json", "events.jsonl", "output.log"} <= artifacts
    config = client.download_artifacts(run.info.run_id, "deepspeed_config.json", str(repro.cwd))
    text = Path(config).read_text()
    assert '"gradient_clipping": 0.0' in text and '"stage": 3' in text


@pytest.mark.units
@pytest.mark.parametrize(
    "recipe, override, field",
    [
        ("gpt2-smoke", "zero.stage=4", "zero.stage"),
        ("gpt2-smoke", "zero.stage=0", "zero.stage"),
        ("gpt2-smoke", "zero.optimizer.name=lamb", "zero.optimizer.name"),
        ("vgg16-smoke", "train.optimizer.name=sgd", "train.optimizer.name"),
        ("gpt2-paper", "zero.reduce_bucket_size=0", "zero.reduce_bucket_size"),
    ],
)
def test_impossible_settings_fail_naming_the_field(recipe: str, override: str, field: str) -> None:
    with pytest.raises(RecipeError) as error:
        load_file(REPO / "configs" / f"{recipe}.yaml", ["run.framework=zero", override])
    assert error.value.field == field


@pytest.mark.units
def test_cli_reports_a_bad_stage_before_launching(repro: Repro) -> None:
    out = repro.here("run", "gpt2", "--framework", "zero", "--set", "zero.stage=5", "--dry-run")
    assert out.returncode == 2
    assert "zero.stage: got 5; ZeRO stages are 1, 2 and 3" in out.stderr


@pytest.mark.units
def test_deepspeed_builds_its_cpu_op_in_a_folder_of_this_environment(monkeypatch, tmp_path: Path) -> None:
    from repro.adapters.zero_plan import extension_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = extension_folder()
    monkeypatch.setattr(sys, "prefix", "/another/checkout/.venv")
    assert here.parent == extension_folder().parent == tmp_path / "torch_extensions"
    assert extension_folder() != here  # another virtualenv builds in its own folder


@pytest.mark.units
@pytest.mark.parametrize("grad_clip, precision", [(None, "fp32"), (1.0, "bf16"), (0.5, "fp16")])
def test_arithmetic_settings_reach_deepspeed_explicitly(grad_clip: float | None, precision: str) -> None:
    from repro.adapters.base import RunContext
    from repro.adapters.zero import ZeroAdapter

    recipe = load_file(SMOKE, ["run.framework=zero", f"train.grad_clip={grad_clip or 'null'}", f"train.precision={precision}"])
    config = ZeroAdapter(RunContext(recipe, None, 0, 1, 0, torch.device("cpu"))).deepspeed_config()
    assert config["gradient_clipping"] == (grad_clip or 0.0)
    autocast = config.get("torch_autocast", {"enabled": False})
    assert autocast["enabled"] == (precision == "bf16")  # fp16: DeepSpeed's own mode, dynamically loss-scaled
    assert autocast.get("dtype") == {"fp32": None, "bf16": "bfloat16", "fp16": None}[precision]
    fp16 = config.get("fp16", {"enabled": False})
    assert fp16["enabled"] == (precision == "fp16") and fp16.get("loss_scale", 0) == 0
    assert config["zero_optimization"]["reduce_bucket_size"] == recipe.options().reduce_bucket_size


@pytest.mark.units
@pytest.mark.parametrize("micro_batch, expected", [(None, (8, 1)), (2, (2, 4)), (8, (8, 1))])
def test_micro_batches_become_deepspeeds_gradient_accumulation(micro_batch: int | None, expected: tuple) -> None:
    from repro.adapters.base import RunContext
    from repro.adapters.zero import ZeroAdapter

    recipe = load_file(SMOKE, ["run.framework=zero", f"train.micro_batch={micro_batch or 'null'}"])
    config = ZeroAdapter(RunContext(recipe, None, 0, 1, 0, torch.device("cpu"))).deepspeed_config()
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == expected
