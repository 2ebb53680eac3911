"""DDP: its arithmetic and determinism (ranks tier), and what a real run lands in MLflow (end to end)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import ranks
from conftest import Repro, Result, mlflow_runs
from references import STEPS, gpt2, plain_gpt2
from repro.recipe import load_file, recipe_path


@pytest.mark.ranks
def test_two_ranks_equal_one_process_with_double_batch(references) -> None:
    ddp, one = references.losses(gpt2("ddp", 2)), references.losses(plain_gpt2())
    assert gpt2("ddp", 2).train.batch_per_gpu * 2 == plain_gpt2().train.batch_per_gpu
    assert len(ddp) == len(one) == STEPS
    assert max(abs(a - b) for a, b in zip(ddp, one)) < 1e-5
    assert ddp[-1] < ddp[0]  # it trains


@pytest.mark.ranks
def test_same_recipe_and_seed_give_identical_curves(tmp_path: Path) -> None:
    short = ["run.gpus=1", "train.max_steps=5", "data.max_val_samples=64"]  # validation is not what is compared

    def losses(folder: str, *sets: str) -> list[float]:
        recipe = load_file(recipe_path("vgg16", "smoke"), [*short, *sets])
        return [e["loss"] for e in ranks.train(recipe, tmp_path / folder) if e["event"] == "step"]

    first, second = losses("first"), losses("second")
    assert first == second
    assert len(first) == 5
    assert losses("other-seed", "seed=7") != first


@pytest.fixture(scope="module")
def ddp_repro(tmp_path_factory: pytest.TempPathFactory) -> Repro:
    return Repro(tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def two_ranks(ddp_repro: Repro) -> Result:
    """A real `repro run` of the reference DDP-2 recipe, in a scratch folder and MLflow store of its own."""
    repro, recipe = ddp_repro, gpt2("ddp", 2)
    (repro.cwd / "ddp-2.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    out = repro("run", "gpt2", "--recipe", "ddp-2.yaml", "--framework", "ddp", "--gpus", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.end_to_end
def test_mlflow_holds_the_run_with_tags_params_metrics_and_artifacts(two_ranks, ddp_repro, references) -> None:
    from mlflow.tracking import MlflowClient

    (run,) = [r for r in mlflow_runs(ddp_repro.tracking_uri) if r.info.run_name == "gpt2-ddp-2g-smoke-s1234"]
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags["repro.model"], tags["repro.framework"], tags["repro.gpus"], tags["repro.nodes"]) == ("gpt2", "ddp", "2", "1")
    assert (tags["repro.scale"], tags["repro.seed"]) == ("smoke", "1234")
    assert len(tags["repro.recipe_sha256"]) == len(tags["repro.data_sha256"]) == 64
    assert "repro.git_sha" in tags and "repro.unverified_data" not in tags
    assert run.data.params["train.batch_per_gpu"] == "4" and run.data.params["run.gpus"] == "2"
    assert tags["repro.recipe_sha256"] == gpt2("ddp", 2).fingerprint()
    client = MlflowClient(tracking_uri=ddp_repro.tracking_uri)
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == list(range(1, STEPS + 1))
    assert [m.value for m in losses] == pytest.approx(two_ranks.losses(), abs=0)
    # torchrun's ranks and the ranks tier's forked ones train alike: the launcher changes no number
    assert two_ranks.losses() == references.losses(gpt2("ddp", 2))
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


@pytest.mark.end_to_end
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


@pytest.mark.end_to_end
def test_unverified_data_is_explicit_and_recorded(shared_repro) -> None:
    out = shared_repro("run", "gpt2", "--gpus", "1", "--max-steps", "1", "--allow-unverified", "--seed", "99")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = [r for r in mlflow_runs(shared_repro.tracking_uri) if r.info.run_name == "gpt2-ddp-1g-smoke-s99"]
    assert run.data.tags["repro.unverified_data"] == "true"
