"""Megatron (megatron-core) on CPU: recipe checks, Megatron's arithmetic, hybrid runs, memory per rank."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, Repro
from repro import tracking
from repro.adapters.megatron import MegatronAdapter
from repro.loop import RUN_FILE
from repro.recipe import load_file, recipe_path
from repro.runner import verify_data
from repro.schema import RecipeError
from repro.workloads.gpt2 import GPT2Spec, build_gpt2

PROBE = Path(__file__).with_name("logits_probe.py")
STEPS = 5
TOLERANCE = 1e-5  # fp32


def smoke(*overrides: str):
    return load_file(recipe_path("gpt2", "smoke"), ["run.framework=megatron", *overrides])


# -- recipe checks, no processes ------------------------------------------------------------------


def test_world_must_be_tp_times_dp():
    with pytest.raises(RecipeError, match=r"megatron\.tp: gpus \(6\) must be tp \(4\) x dp: 6 % 4 = 2"):
        smoke("run.gpus=6", "megatron.tp=4")


def test_lamb_is_not_a_megatron_optimizer():
    with pytest.raises(RecipeError, match="megatron.optimizer: megatron-core's optimizers are adam, adamw, sgd, not lamb"):
        smoke("megatron.optimizer.name=lamb")


def test_variant_names_the_table_row():
    assert MegatronAdapter.variant(smoke("run.gpus=4", "megatron.tp=1")) == "megatron-data"
    assert MegatronAdapter.variant(smoke("run.gpus=4", "megatron.tp=4")) == "megatron-intra"
    assert MegatronAdapter.variant(smoke("run.gpus=4", "megatron.tp=2")) == "megatron-hybrid"


def test_vgg16_fails_at_once_in_one_line(repro):
    result = repro("run", "vgg16", "--framework", "megatron", "--gpus", "2")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "Megatron's intra-layer scheme targets transformers" in result.stderr
    assert not (result.cwd / "runs").exists()


# -- Megatron's arithmetic: same weights, same logits and losses ----------------------------------


def probe(folder: Path, framework: str, gpus: int, *overrides: str) -> dict:
    """Train STEPS steps through tests/logits_probe.py; its losses, memory and logits."""
    recipe = load_file(recipe_path("gpt2", "smoke"), [
        f"run.framework={framework}", f"run.gpus={gpus}", f"train.max_steps={STEPS}", *overrides,
    ])
    data_dir, _ = verify_data(recipe)
    run_dir = folder / f"{framework}-{gpus}g-{'-'.join(overrides)}"
    run_dir.mkdir()
    (run_dir / RUN_FILE).write_text(json.dumps({"recipe": recipe.to_dict(), "data_dir": str(data_dir)}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
               str(PROBE), str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {
        "losses": [e["loss"] for e in events if e["event"] == "step"],
        "ranks": next(e["ranks"] for e in events if e["event"] == "epoch"),
        **torch.load(run_dir / "logits.pt"),
    }


@pytest.fixture(scope="module")
def same_weights(tmp_path_factory) -> dict[str, dict]:
    """Global batch 16 each: plain GPT-2 under DDP on 1 process, Megatron tp=1 x dp=2, tp=2 x dp=1."""
    folder = tmp_path_factory.mktemp("megatron-arithmetic")
    optimizer = json.dumps(dataclasses.asdict(smoke().optimizer()))  # megatron-core's, for all three
    return {
        "plain": probe(folder, "ddp", 1, "train.batch_per_gpu=16", f"train.optimizer={optimizer}"),
        "tp1": probe(folder, "megatron", 2, "megatron.tp=1"),
        "tp2": probe(folder, "megatron", 2, "megatron.tp=2"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("run", ["tp1", "tp2"])
def test_same_logits_and_losses_as_plain_gpt2(same_weights, run):
    plain, megatron = same_weights["plain"], same_weights[run]
    assert len(megatron["losses"]) == STEPS
    assert megatron["losses"] == pytest.approx(plain["losses"], abs=TOLERANCE, rel=0)
    for moment in ("before", "after"):
        assert megatron[moment].shape == plain[moment].shape == (4, 64, 256)
        assert (megatron[moment] - plain[moment]).abs().max() < TOLERANCE
    assert (plain["after"] - plain["before"]).abs().max() > 100 * TOLERANCE  # training moved the logits


@pytest.mark.slow
def test_tp2_matches_tp1(same_weights):
    assert same_weights["tp2"]["losses"] == pytest.approx(same_weights["tp1"]["losses"], abs=TOLERANCE, rel=0)
    assert (same_weights["tp2"]["after"] - same_weights["tp1"]["after"]).abs().max() < TOLERANCE


# -- runs through the CLI, recorded in MLflow ------------------------------------------------------


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, object]:
    """tp=2 (the issue's command), tp=2 x dp=2 (global batch 16 as tp=2's), tp=4; STEPS steps each."""
    repro = Repro(tmp_path_factory.mktemp("megatron-cli"))
    command = ("run", "gpt2", "--framework", "megatron", "--scale", "smoke", "--max-steps", str(STEPS))
    runs = {}
    for name, gpus, extra in (
        ("tp2", 2, ["--set", "megatron.tp=2"]),
        ("hybrid", 4, ["--set", "megatron.tp=2", "--set", "train.batch_per_gpu=4"]),
        ("tp4", 4, ["--set", "megatron.tp=4"]),
    ):
        result = repro(*command, "--gpus", str(gpus), *extra)
        recipe = smoke(f"run.gpus={gpus}", *extra[1::2])
        runs[name] = {"result": result, "recipe": recipe, "events": result.events() if result.returncode == 0 else []}
    runs["mlflow"] = tracking.client(repro.tracking_uri)
    return runs


def mlflow_run(runs: dict, name: str):
    """The MLflow run of the CLI run `name`, found by its run name and tp (hybrid and tp4 share a name)."""
    client, recipe = runs["mlflow"], runs[name]["recipe"]
    experiment = client.get_experiment_by_name("repro")
    found = [
        r for r in client.search_runs([experiment.experiment_id])
        if r.info.run_name == recipe.run_name() and r.data.params["megatron.tp"] == str(recipe.options().tp)
    ]
    assert len(found) == 1
    return found[0]


@pytest.mark.slow
def test_issue_command_finishes(cli_runs):
    result = cli_runs["tp2"]["result"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.losses()) == STEPS


@pytest.mark.slow
def test_hybrid_trains_and_lands_in_mlflow(cli_runs):
    result = cli_runs["hybrid"]["result"]
    assert result.returncode == 0, result.stderr[-3000:]
    run = mlflow_run(cli_runs, "hybrid")
    assert run.info.status == "FINISHED"
    assert run.data.tags["repro.framework"] == "megatron" and run.data.params["megatron.tp"] == "2"
    history = [m.value for m in cli_runs["mlflow"].get_metric_history(run.info.run_id, "train/loss")]
    assert history == pytest.approx(result.losses()) and len(history) == STEPS
    assert history[-1] < history[0]
    # dp=2 with 4 samples a rank sees the same global batch of 16 as tp=2 alone: same losses.
    assert history == pytest.approx(cli_runs["tp2"]["result"].losses(), abs=TOLERANCE, rel=0)
    assert {f"memory/rank{r}/model_state_bytes" for r in range(4)} <= set(run.data.metrics)


@pytest.mark.slow
def test_parameter_share_per_rank_falls_as_tp_grows(cli_runs, same_weights):
    plain_bytes = sum(p.numel() * 4 for p in build_gpt2(smoke().model).parameters())
    parameters = {1: same_weights["tp1"]["ranks"]}
    for tp, name in ((2, "tp2"), (4, "tp4")):
        assert cli_runs[name]["result"].returncode == 0
        parameters[tp] = next(e["ranks"] for e in cli_runs[name]["events"] if e["event"] == "epoch")
        logged = mlflow_run(cli_runs, name).data.metrics
        for rank in parameters[tp]:
            held = rank["parameters"] + rank["gradients"] + rank["optimizer"]
            assert logged[f"memory/rank{rank['rank']}/model_state_bytes"] == held
    share = {tp: {r["parameters"] for r in ranks} for tp, ranks in parameters.items()}
    assert all(len(values) == 1 for values in share.values())  # every rank of a run holds as much
    share = {tp: values.pop() for tp, values in share.items()}
    print(f"parameter bytes per rank by tp: {share} (plain GPT-2: {plain_bytes})")
    assert share[1] == plain_bytes
    assert share[1] > share[2] > share[4] > plain_bytes / 4  # layer norms and biases stay replicated
