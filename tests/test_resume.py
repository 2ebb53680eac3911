"""Checkpoint and resume: a run stopped by SIGTERM after its first epoch and resumed ends bit for bit
where the same run left alone ends, in the same MLflow run."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from conftest import framework_params, mlflow_runs, read_events, wait_for_event

SMOKE = ("--epochs", "2", "--set", "data.max_train_samples=512", "--set", "data.max_val_samples=32")
# Megatron-intra with dropout: each rank saves a different shard, and both dropout streams it keeps
# outside the default generators (shared by tp peers, local to a rank) must resume where they were.
SHAPES = {"megatron": ("--set", "megatron.tp=2", "--set", "model.dropout=0.1")}


def final_checkpoint(run_dir: Path) -> Path:
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    return run_dir / "checkpoints" / pointer["folder"]


def tensors(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested checkpoint object, by path (other leaves carry no weights)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out = {}
    for key, value in items:
        out.update(tensors(value, f"{prefix}/{key}"))
    return out


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """The training state a framework saved (the loop's own files hold timings, which differ)."""
    out = {}
    for path in sorted(folder.rglob("*.pt")):
        if not path.name.startswith("loop-rank"):
            out.update(tensors(torch.load(path, weights_only=False), str(path.relative_to(folder))))
    return out


def curve(events: list[dict]) -> list[tuple]:
    steps = [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    epochs = [(e["epoch"], e["step"], json.dumps(e["val"], sort_keys=True)) for e in events if e["event"] == "epoch"]
    return steps + epochs


@pytest.mark.slow
@pytest.mark.parametrize("framework", framework_params("ddp", "zero", "megatron", "torchgpipe", "pipedream"))
def test_sigterm_after_first_epoch_then_resume_is_bit_for_bit(repro, framework):
    args = ("run", "gpt2", "--framework", framework, "--gpus", "2", *SMOKE, *SHAPES.get(framework, ()))
    reference = repro.start(*args, "--run-dir", "alone/run", log="alone.txt")
    stopped = repro.start(*args, "--run-dir", "stopped/run", log="stopped.txt")
    run_dir, first_epoch = wait_for_event(repro.cwd / "stopped", "epoch", stopped, epoch=0)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) != 0
    interrupted = [e for e in read_events(run_dir) if e["event"] == "interrupted"]
    assert interrupted and interrupted[0]["step"] > first_epoch["step"], (repro.cwd / "stopped.txt").read_text()
    (stopped_run,) = [r for r in mlflow_runs(repro.tracking_uri) if r.info.run_name and r.info.status == "KILLED"]
    assert stopped_run.data.tags["repro.interrupted"].startswith("SIGTERM at step")

    resumed = repro(*args, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert reference.wait(timeout=300) == 0, (repro.cwd / "alone.txt").read_text()

    alone, again = weights(final_checkpoint(repro.cwd / "alone/run")), weights(final_checkpoint(run_dir))
    assert alone.keys() == again.keys() and alone
    assert all(torch.equal(alone[k], again[k]) for k in alone), [k for k in alone if not torch.equal(alone[k], again[k])]
    assert curve(read_events(repro.cwd / "alone/run")) == curve(read_events(run_dir))
    (start,) = [e for e in read_events(run_dir) if e["event"] == "start"]
    steps = 2 * start["steps_per_epoch"]  # 512 training samples over the framework's global batch
    assert start["steps_per_epoch"] == 512 // start["global_batch"]
    assert interrupted[0]["step"] < steps  # stopped inside the second epoch (PipeDream: mini-batches in flight)
    assert len([e for e in read_events(run_dir) if e["event"] == "step"]) == steps

    runs = {r.info.run_id: r for r in mlflow_runs(repro.tracking_uri)}
    assert len(runs) == 2  # the resumed run continued its own MLflow run
    (same,) = [r for r in runs.values() if r.info.run_id == stopped_run.info.run_id]
    assert same.info.status == "FINISHED" and same.data.tags["repro.resumed"] == "true"
    assert same.data.tags["repro.resumed_from_step"] == str(interrupted[0]["step"])
    from mlflow.tracking import MlflowClient

    history = MlflowClient(repro.tracking_uri).get_metric_history(same.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))  # every step once: none lost, none repeated
    elapsed = sorted(MlflowClient(repro.tracking_uri).get_metric_history(same.info.run_id, "time/elapsed_s"),
                     key=lambda m: m.step)
    assert [m.step for m in elapsed] == [1, 2] and elapsed[1].value > elapsed[0].value


def test_resume_with_a_different_recipe_refuses_naming_the_fields(repro):
    from repro.recipe import load_file, recipe_path

    run_dir = repro.cwd / "runs" / "old"
    (run_dir / "checkpoints").mkdir(parents=True)
    sets = ["data.max_train_samples=256", "data.max_val_samples=32"]
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=2", "train.epochs=2", *sets])
    (run_dir / "run.json").write_text(json.dumps({"recipe": recipe.to_dict()}))
    (run_dir / "checkpoints" / "latest.json").write_text(json.dumps({"folder": "step-1", "position": {}}))
    out = repro("run", "gpt2", "--gpus", "2", "--epochs", "3", "--seed", "7", "--set", sets[0], "--set", sets[1],
                "--resume", str(run_dir))
    assert out.returncode == 2
    assert "the recipe differs from the run's in seed (1234 -> 7), train.epochs (2 -> 3);" in out.stderr
