"""DDP end to end: its arithmetic, determinism, and what lands in MLflow."""
from __future__ import annotations

import os

import pytest

from conftest import mlflow_runs

pytestmark = pytest.mark.slow
STEPS = "6"


@pytest.fixture(scope="module")
def two_ranks(shared_repro):
    out = shared_repro("run", "gpt2", "--gpus", "2", "--max-steps", STEPS, "--set", "train.batch_per_gpu=4")
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_two_ranks_equal_one_process_with_double_batch(two_ranks, repro) -> None:
    single = repro("run", "gpt2", "--gpus", "1", "--max-steps", STEPS, "--set", "train.batch_per_gpu=8")
    assert single.returncode == 0, single.stderr[-3000:]
    ddp, one = two_ranks.losses(), single.losses()
    assert len(ddp) == len(one) == int(STEPS)
    assert max(abs(a - b) for a, b in zip(ddp, one)) < 1e-5
    assert ddp[-1] < ddp[0]  # it trains


def test_same_recipe_and_seed_give_identical_curves(repro) -> None:
    short = ("--gpus", "1", "--max-steps", "5", "--set", "data.max_val_samples=64")  # validation is not what is compared
    first = repro("run", "vgg16", *short)
    second = repro("run", "vgg16", *short)
    assert first.returncode == second.returncode == 0, first.stderr[-3000:]
    assert first.losses() == second.losses()
    assert len(first.losses()) == 5
    other_seed = repro("run", "vgg16", *short, "--seed", "7")
    assert other_seed.losses() != first.losses()


def test_mlflow_holds_the_run_with_tags_params_metrics_and_artifacts(two_ranks, shared_repro) -> None:
    from mlflow.tracking import MlflowClient

    (run,) = [r for r in mlflow_runs(shared_repro.tracking_uri) if r.info.run_name == "gpt2-ddp-2g-smoke-s1234"]
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags["repro.model"], tags["repro.framework"], tags["repro.gpus"], tags["repro.nodes"]) == ("gpt2", "ddp", "2", "1")
    assert (tags["repro.scale"], tags["repro.seed"]) == ("smoke", "1234")
    assert len(tags["repro.recipe_sha256"]) == len(tags["repro.data_sha256"]) == 64
    assert "repro.git_sha" in tags and "repro.unverified_data" not in tags
    assert run.data.params["train.batch_per_gpu"] == "4" and run.data.params["run.gpus"] == "2"
    client = MlflowClient(tracking_uri=shared_repro.tracking_uri)
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == list(range(1, 7))
    assert [m.value for m in losses] == pytest.approx(two_ranks.losses(), abs=0)
    for key in ("val/perplexity", "time/epoch_s", "throughput/samples_per_s", "memory/peak_bytes",
                "memory/model_state_bytes", "memory/rank1/peak_bytes"):
        assert run.data.metrics[key] > 0, key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.yaml", "environment.json", "packages.json", "events.jsonl", "output.log"} <= artifacts


# Loaded by every Python process of the job (sitecustomize): each rank's first training step raises.
# Every bad input is refused before launch now, so a failure inside the job has to be injected.
FAIL_IN_JOB = '''
import os
if "LOCAL_RANK" in os.environ:
    from repro.adapters.ddp import DDPAdapter

    def broken_step(self, inputs, targets):
        raise RuntimeError("injected failure inside the job")

    DDPAdapter.train_step = broken_step
'''


def test_a_failing_run_ends_failed_with_its_error(shared_repro, tmp_path) -> None:
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FAIL_IN_JOB)
    env = dict(shared_repro.env)
    shared_repro.env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "inject"), env.get("PYTHONPATH", "")])
    try:
        out = shared_repro("run", "gpt2", "--gpus", "1", "--seed", "77")
    finally:
        shared_repro.env = env
    assert out.returncode != 0
    (run,) = [r for r in mlflow_runs(shared_repro.tracking_uri) if r.info.run_name == "gpt2-ddp-1g-smoke-s77"]
    assert run.info.status == "FAILED"
    assert "injected failure inside the job" in run.data.tags["repro.error"]


def test_unverified_data_is_explicit_and_recorded(shared_repro) -> None:
    out = shared_repro("run", "gpt2", "--gpus", "1", "--max-steps", "1", "--allow-unverified", "--seed", "99")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = [r for r in mlflow_runs(shared_repro.tracking_uri) if r.info.run_name == "gpt2-ddp-1g-smoke-s99"]
    assert run.data.tags["repro.unverified_data"] == "true"
