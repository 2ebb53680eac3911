"""fp16 with dynamic loss scaling (issue 39), and `train.precision: auto`, decided where the device is known.

Units: the device -> precision rule, its resolution on a rank and the plan checks run again there, the
refusals (one line naming train.precision), the cost model's view of auto and of DeepSpeed's fp16 mode,
the report's settings. Ranks: an inf in one gradient element of one rank skips the step on every rank,
weights unchanged bit for bit and the scale halved (FSDP2's sharded scaler); fp16 runs on this CPU (DDP,
FSDP2, ZeRO) within a stated band of fp32. What needs a GPU is listed in docs/memory.md
("Precision: fp16, bf16 and auto").
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import overflow_probe
import ranks
from conftest import NO_DEEPSPEED_FP16
from references import gpt2, plain_gpt2
from repro import hardware
from repro.model import costs
from repro.model.predict import recipe_cell
from repro.rank import resolve_precision
from repro.recipe import load_file, recipe_path
from repro.schema import RecipeError

# Largest per-step loss difference between an fp16 run on this CPU and plain fp32 over the first steps:
# fp16 keeps an 11-bit significand (a relative rounding of 2^-11, about 5e-4), over a loss of about 5
# and a handful of layers, each rounding its output once.
FP16_CPU_TOLERANCE = 1e-2


def smoke(*sets: str):
    return load_file(recipe_path("gpt2", "smoke"), list(sets))


@pytest.mark.units
@pytest.mark.parametrize("device_type, capability, expected", [
    ("cuda", 7, "fp16"),  # the paper's V100 (Lassen): no bf16 arithmetic
    ("cuda", 8, "bf16"),  # the A100 (ThetaGPU)
    ("cuda", 9, "bf16"),  # H100, H200
    ("cuda", None, "bf16"),  # a GPU not yet asked: today's GPUs compute in bf16
    ("cpu", None, "bf16"),  # torch's CPU autocast dtype
])
def test_auto_is_bf16_where_the_device_computes_in_it_else_fp16(device_type, capability, expected) -> None:
    assert hardware.automatic_precision(device_type, capability) == expected


@pytest.mark.units
def test_device_names_give_their_compute_capability() -> None:
    assert [hardware.capability_of(name) for name in ("V100-16GB", "Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-40GB",
                                                     "NVIDIA H200", "a GPU nobody listed")] == [7, 7, 8, 9, None]


@pytest.mark.units
def test_a_rank_decides_auto_for_its_device_and_checks_the_result_again(monkeypatch) -> None:
    assert resolve_precision(smoke("train.precision=auto"), torch.device("cpu")).train.precision == "bf16"
    assert resolve_precision(smoke("train.precision=fp32"), torch.device("cpu")).train.precision == "fp32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    v100 = torch.device("cuda", 0)
    assert resolve_precision(smoke("run.framework=fsdp", "train.precision=auto"), v100).train.precision == "fp16"
    # torch's pipeline schedules have no loss scaling: auto that became fp16 is refused on the rank, in one line
    with pytest.raises(RecipeError, match=r"auto -> fp16 on cuda\): train.precision: torch-pipeline runs fp32 or bf16"):
        resolve_precision(smoke("run.framework=torch-pipeline", "run.gpus=2", "train.precision=auto"), v100)


@pytest.mark.units
@pytest.mark.parametrize("framework, sets, reason", [
    ("torch-pipeline", ["train.precision=fp16"], "torch-pipeline runs fp32 or bf16 (no loss scaling across stages)"),
    ("pipedream", ["train.precision=auto"], "pipedream runs fp32 as in the paper; got auto"),
    ("torchgpipe", ["train.precision=fp16"], "torchgpipe runs fp32 as in the paper; got fp16"),
    ("megatron", ["train.precision=fp16", "run.device=cpu"], "megatron's CPU path runs fp32, not fp16"),
])
def test_a_framework_without_fp16_refuses_it_in_one_line(repro, framework, sets, reason) -> None:
    options = [arg for text in sets for arg in ("--set", text)]
    result = repro.here("run", "gpt2", "--framework", framework, "--gpus", "2", *options)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"train.precision: {reason}" in result.stderr


@pytest.mark.units
def test_the_cost_model_decides_auto_as_the_device_would() -> None:
    # repro predict: the paper's V100, fp16; a rank's check: the GPU it knows
    assert recipe_cell("gpt2", "zero", 8, "paper", ["train.precision=auto"]).precision == "fp16"
    recipe = load_file(recipe_path("gpt2", "paper"), ["run.framework=zero", "run.gpus=8", "train.precision=auto"])
    assert [costs.cell_of(recipe, capability=c).precision for c in (7, 8)] == ["fp16", "bf16"]
    # DeepSpeed's fp16 mode holds weights and gradients in fp16 (bf16 autocasts fp32 weights): 2 bytes, not 4
    fp16, bf16 = (costs.predict(recipe_cell("gpt2", "zero", 8, "paper", [f"train.precision={p}"])) for p in ("fp16", "bf16"))
    assert 2 * fp16.parameters == bf16.parameters and fp16.optimizer == bf16.optimizer
    # 2-byte elements both, but bf16 autocasts an fp32 module (fp32 residual stream and layer norms, 16-bit copies
    # of the weights: docs/memory.md, "16-bit activations"), fp16 runs an fp16 module
    unset = ["train.recompute=null", "train.micro_batch=null"]  # every activation kept, in closed form
    fp16, bf16 = (costs.predict(recipe_cell("gpt2", "zero", 8, "paper", [f"train.precision={p}", *unset])) for p in ("fp16", "bf16"))
    shape = recipe_cell("gpt2", "zero", 8, "paper").shape
    assert (fp16.activations, bf16.activations) == (shape.activation_bytes(32, 2, 1), shape.activation_bytes(32, 2, 1, autocast=True))


@pytest.mark.units
def test_the_report_reads_the_precision_the_ranks_decided() -> None:
    from repro.report.settings import from_params

    recipe = smoke("train.precision=auto")
    assert from_params({"train.precision": "auto", "effective.precision": "fp16"}, recipe)["precision"] == "fp16"
    assert from_params({"train.precision": "bf16"}, recipe)["precision"] == "bf16"  # a run from before


@pytest.mark.units
def test_megatron_refuses_16_bit_on_cpu_and_leaves_gpus_to_decide() -> None:
    from repro.adapters.megatron_plan import MegatronPlan

    with pytest.raises(RecipeError, match="train.precision: megatron's CPU path runs fp32, not bf16"):
        smoke("run.framework=megatron", "run.device=cpu", "train.precision=bf16")
    with pytest.raises(RecipeError, match="train.precision: megatron's CPU path runs fp32, not auto"):
        smoke("run.framework=megatron", "run.device=cpu", "train.precision=auto")  # bf16 on any CPU
    recipe = smoke("run.framework=megatron", "train.precision=fp16")  # run.device auto: a GPU may take it
    MegatronPlan.check_device(recipe, "gpt2-smoke.yaml", "cuda")
    with pytest.raises(RecipeError, match="train.precision: megatron's CPU path runs fp32, not fp16"):
        MegatronPlan.check_device(recipe, "gpt2-smoke.yaml", "cpu")  # what the adapter's setup asks on a rank


def overflow(folder: Path, framework: str, gpus: int, *sets: str) -> list[dict]:
    """Each rank's record of tests/overflow_probe.py: a good fp16 step, then rank 1 alone finds an inf."""
    recipe = load_file(recipe_path("gpt2", "smoke"), [f"run.framework={framework}", f"run.gpus={gpus}",
                                                      "train.precision=fp16", *sets])
    run_dir = ranks.write_run_file(recipe, folder / "run")
    ranks.start_ranks(gpus, overflow_probe.main, run_dir, folder)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(gpus)]


@pytest.mark.ranks
@pytest.mark.parametrize("sets", [[], ["fsdp.sharding=grad-op"]])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale(tmp_path, sets) -> None:
    records = overflow(tmp_path, "fsdp", 2, *sets)  # FSDP2's DTensor shards: rank 0's are all finite
    assert [r["unchanged"] for r in records] == [True, True]  # the step skipped everywhere, weights bit for bit
    assert [r["scale_after"] for r in records] == [r["scale_before"] / 2 for r in records] == [2.0**15] * 2
    assert all(r["loss_finite"] for r in records)  # the forward was fine: the inf came after


@pytest.mark.ranks
@pytest.mark.parametrize("framework, sets", [("ddp", []), ("fsdp", []), ("zero", []), ("zero", ["zero.stage=3"])])
def test_fp16_on_this_cpu_trains_within_its_band_of_fp32(references, framework, sets) -> None:
    if framework == "zero" and not hardware.cpu_computes_fp16():
        pytest.skip(NO_DEEPSPEED_FP16)
    fp16 = references.losses(gpt2(framework, 2, *sets, "train.precision=fp16"))
    plain = references.losses(plain_gpt2())
    assert len(fp16) == len(plain) and all(map(torch.isfinite, torch.tensor(fp16)))
    assert max(abs(a - b) for a, b in zip(fp16, plain)) < FP16_CPU_TOLERANCE


@pytest.mark.ranks
def test_auto_is_decided_on_the_ranks_and_recorded(references) -> None:
    events = references.events(gpt2("ddp", 2, "train.precision=auto"))
    (start,) = [e for e in events if e["event"] == "start"]
    assert start["effective"]["precision"] == "bf16"  # MLflow's effective.precision (repro.tracking)
