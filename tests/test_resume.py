"""Checkpoint and resume, for every framework of the registry: a run stopped by SIGTERM in the middle
of its second epoch and resumed ends bit for bit where the same run left alone ends (every step's
loss, every epoch's validation metric, the saved weights), in the same MLflow run. A framework whose
adapter can make no checkpoint must refuse --resume instead; one that cannot run here is skipped
with the registry's reason. A new framework is in this test the moment it is registered."""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch

from conftest import Repro, mlflow_runs, read_events, wait_for_event
from ranks import train
from repro import registry
from repro.run import lifecycle
from repro.run.options import LaunchError
from repro.adapters.base import Adapter
from repro.adapters.plan import FrameworkPlan
from repro.recipe import Recipe, load_file, recipe_path

# 2 epochs of 128 samples at 4 per GPU: 16 steps an epoch under DDP, 8 under Megatron (4 GPUs), 32 under
# PipeDream (one mini-batch of 4); 2 of the smoke model's 4 layers keep every run to seconds.
SMOKE = ("--epochs", "2", "--set", "data.max_train_samples=128", "--set", "data.max_val_samples=32",
         "--set", "train.batch_per_gpu=4", "--set", "model.n_layer=2")
# The shapes whose state is spread over ranks in the most ways: Megatron tp x dp with dropout (each
# rank its shard and a dropout stream outside the default generators), ZeRO stage 3 (parameters
# partitioned too), torch-pipeline's 1F1B; FSDP2 runs its default, full sharding.
SHAPES = {
    "megatron": ("--gpus", "4", "--set", "megatron.tp=2", "--set", "model.dropout=0.1"),
    "zero": ("--set", "zero.stage=3"),
    "torch-pipeline": ("--set", "torch_pipeline.schedule=1f1b"),
    "torchgpipe": ("--set", "torchgpipe.chunks_per_gpu=1"),  # 2 micro-batches a step: 16 steps an epoch
}


def registered() -> list:
    """Every registered framework, skipped with the registry's reason where it is not installed here."""
    params = []
    for name, entry in registry.FRAMEWORKS.items():
        missing = entry.missing()
        reason = f"{name} is not available here: missing {', '.join(missing)}; {entry.install_hint}"
        params.append(pytest.param(name, marks=pytest.mark.skipif(bool(missing), reason=reason)))
    return params


def arguments(framework: str) -> tuple[str, ...]:
    return ("run", "gpt2", "--framework", framework, "--gpus", "2", *SMOKE, *SHAPES.get(framework, ()))


def recipe_of(framework: str) -> Recipe:
    """The recipe `repro run` resolves from arguments(framework), for the ranks tier."""
    flags = {"--framework": "run.framework", "--gpus": "run.gpus", "--epochs": "train.epochs"}
    args = arguments(framework)[2:]
    overrides = [f"{flags[key]}={value}" if key in flags else value for key, value in zip(args[::2], args[1::2])]
    return load_file(recipe_path("gpt2", "smoke"), overrides)


class Alone:
    """One uninterrupted run per framework, trained once in the ranks tier (tests/ranks.py) and shared by
    the tests that compare with it: the same loop, and the checkpoints it saves, as in `repro run`."""

    def __init__(self, folder: Path):
        self.folder = folder

    def run_dir(self, framework: str) -> Path:
        run_dir = self.folder / framework
        if not (run_dir / "events.jsonl").exists():
            train(recipe_of(framework), run_dir)
        return run_dir


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Alone:
    return Alone(tmp_path_factory.mktemp("alone"))


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


def weights(folder: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The training state a framework saved: torch.save files and distributed checkpoints (read whole
    into one file by PyTorch's own converter); the loop's own files hold timings, which differ."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    files = [p for p in folder.rglob("*.pt") if not p.name.startswith("loop-rank")]
    for index, metadata in enumerate(sorted(folder.rglob(".metadata"))):
        whole = scratch / f"dcp-{index}.pt"
        dcp_to_torch_save(metadata.parent, whole)
        files.append(whole)
    out = {}
    for path in sorted(files):
        name = path.relative_to(folder) if path.is_relative_to(folder) else path.name
        out.update(tensors(torch.load(path, weights_only=False), str(name)))
    return out


def curve(events: list[dict]) -> list[tuple]:
    """Every step's loss and every epoch's validation metrics."""
    steps = [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    epochs = [(e["epoch"], e["step"], json.dumps(e["val"], sort_keys=True)) for e in events if e["event"] == "epoch"]
    return steps + epochs


def mlflow_run(repro: Repro, run_dir: Path):
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    (run,) = [r for r in mlflow_runs(repro.tracking_uri) if r.info.run_id == run_id]
    return run


@pytest.mark.end_to_end
@pytest.mark.parametrize("framework", registered())
def test_stopped_mid_epoch_then_resumed_is_bit_for_bit(shared_repro: Repro, alone: Alone, framework: str,
                                                      tmp_path: Path):
    repro, args = shared_repro, arguments(framework)
    refusal = registry.plan_class(framework).no_checkpoint_because(framework)
    if refusal:  # no checkpoint of its own and no replicated state: it must say so, not resume wrongly
        out = repro(*args, "--resume")
        assert out.returncode != 0 and out.stderr.strip().endswith(f"--resume: {refusal}")
        return
    stopped = repro.start(*args, "--run-dir", f"stopped/{framework}/run", log=f"stopped-{framework}.txt")
    # a loaded machine (several helpers' tests on 2 cores) takes minutes to start a run
    run_dir, first_epoch = wait_for_event(repro.cwd / "stopped" / framework, "epoch", stopped, timeout=900, epoch=0)
    stopped.send_signal(signal.SIGTERM)  # the second epoch has started: the stop lands inside it
    assert stopped.wait(timeout=120) != 0
    (interrupted,) = [e for e in read_events(run_dir) if e["event"] == "interrupted"]
    (start,) = [e for e in read_events(run_dir) if e["event"] == "start"]
    steps = 2 * start["steps_per_epoch"]
    assert first_epoch["step"] < interrupted["step"] < steps, (repro.cwd / f"stopped-{framework}.txt").read_text()
    assert mlflow_run(repro, run_dir).data.tags["repro.interrupted"].startswith(f"SIGTERM at step {interrupted['step']};")

    resumed = repro(*args, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    uninterrupted = alone.run_dir(framework)

    assert curve(read_events(run_dir)) == curve(read_events(uninterrupted))
    assert len([e for e in read_events(run_dir) if e["event"] == "step"]) == steps
    before, after = weights(final_checkpoint(uninterrupted), tmp_path), weights(final_checkpoint(run_dir), tmp_path)
    assert before.keys() == after.keys() and before
    assert [k for k in before if not torch.equal(before[k], after[k])] == []

    same = mlflow_run(repro, run_dir)
    assert same.info.status == "FINISHED" and same.data.tags["repro.resumed"] == "true"
    assert same.data.tags["repro.resumed_from_step"] == str(interrupted["step"])
    from mlflow.tracking import MlflowClient

    history = MlflowClient(repro.tracking_uri).get_metric_history(same.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))  # every step once: none lost, none repeated


@pytest.mark.end_to_end
def test_resume_of_a_finished_run_changes_nothing_and_more_epochs_extend_it(shared_repro: Repro, alone: Alone):
    from mlflow.tracking import MlflowClient

    repro, args = shared_repro, arguments("ddp")
    one_epoch = [*args, "--epochs", "1"]
    first = repro(*one_epoch, "--run-dir", "finished/ddp")
    assert first.returncode == 0, first.stderr
    run_dir = repro.cwd / "finished" / "ddp"
    before = mlflow_run(repro, run_dir)
    losses = MlflowClient(repro.tracking_uri).get_metric_history(before.info.run_id, "train/loss")

    again = repro(*one_epoch, "--resume", str(run_dir))
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        f"{run_dir}: the run is complete (MLflow run {before.info.run_id}, 1 epochs); nothing to resume; "
        f"to train longer: --resume {run_dir} --epochs N"
    ]
    untouched = mlflow_run(repro, run_dir)
    assert (untouched.info.status, untouched.info.end_time, untouched.data.tags) == \
        (before.info.status, before.info.end_time, before.data.tags)
    assert len(MlflowClient(repro.tracking_uri).get_metric_history(before.info.run_id, "train/loss")) == len(losses)

    longer = repro(*args, "--resume", str(run_dir))  # SMOKE's 2 epochs
    assert longer.returncode == 0, longer.stderr
    extended = mlflow_run(repro, run_dir)
    assert extended.info.status == "FINISHED"
    assert extended.data.tags["repro.extended"] == f"train.epochs 1 -> 2 at step {len(losses)}"
    assert curve(read_events(run_dir)) == curve(read_events(alone.run_dir("ddp")))


@pytest.mark.units
def test_a_plan_without_checkpoint_or_replicated_state_refuses_resume(repro: Repro, monkeypatch):
    class Sharded(FrameworkPlan):
        pass

    class Replicated(FrameworkPlan):
        replicated_state = True

    class OwnCheckpoint(FrameworkPlan):
        own_checkpoint = True

    assert Replicated.no_checkpoint_because("x") == OwnCheckpoint.no_checkpoint_because("x") == ""
    reason = Sharded.no_checkpoint_because("fsdp")
    assert reason.startswith("fsdp cannot checkpoint: its plan (test_resume.Sharded)")
    monkeypatch.setattr(registry, "plan_class", lambda name: Sharded)
    from repro.recipe import load_file, recipe_path

    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.framework=fsdp"])
    with pytest.raises(LaunchError, match=f"^{re.escape(f'--resume: {reason}')}$"):
        lifecycle.find_resumable(recipe, "latest")


@pytest.mark.units
def test_an_adapter_brings_its_own_checkpoint_exactly_when_its_plan_says_so():
    """The parent refuses --resume from the plan alone; an adapter that disagreed with it would be refused
    wrongly, or resumed from the base checkpoint of state that is not replicated."""
    with pytest.raises(TypeError, match="Undeclared: own_checkpoint is False but it overrides save_checkpoint, load_checkpoint$"):
        class Undeclared(Adapter):
            def save_checkpoint(self, folder: Path) -> None:
                pass

            def load_checkpoint(self, folder: Path) -> None:
                pass
    with pytest.raises(TypeError, match="HalfBuilt: own_checkpoint is True but it overrides save_checkpoint$"):
        class HalfBuilt(Adapter):
            own_checkpoint = True

            def save_checkpoint(self, folder: Path) -> None:
                pass

    class Declared(Adapter):
        own_checkpoint = True

        def save_checkpoint(self, folder: Path) -> None:
            pass

        def load_checkpoint(self, folder: Path) -> None:
            pass

    assert Declared.no_checkpoint_because("x") == ""
    for name, entry in registry.FRAMEWORKS.items():  # and every registered adapter is its plan: both answer alike
        if entry.adapter and not entry.missing():
            assert issubclass(registry.adapter_class(name), registry.plan_class(name)), name


@pytest.mark.units
def test_resume_with_a_different_recipe_refuses_naming_the_fields(repro):
    from repro.recipe import load_file, recipe_path

    run_dir = repro.cwd / "runs" / "old"
    (run_dir / "checkpoints").mkdir(parents=True)
    sets = ["data.max_train_samples=256", "data.max_val_samples=32"]
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=2", "train.epochs=2", *sets])
    (run_dir / "run.json").write_text(json.dumps({"recipe": recipe.to_dict()}))
    (run_dir / "checkpoints" / "latest.json").write_text(json.dumps({"folder": "step-1", "position": {}}))
    out = repro.here("run", "gpt2", "--gpus", "2", "--epochs", "1", "--seed", "7", "--set", sets[0], "--set", sets[1],
                "--resume", str(run_dir))
    assert out.returncode == 2
    assert "the recipe differs from the run's in seed (1234 -> 7), train.epochs (2 -> 1);" in out.stderr


@pytest.mark.ranks
def test_checkpoints_land_after_every_nth_epoch_and_after_the_last(tmp_path: Path) -> None:
    """train.checkpoint_every: 2 over 5 epochs saves after epochs 2, 4 and 5 (the last), not after 1 and 3."""
    recipe = load_file(recipe_path("gpt2", "smoke"), [
        "run.gpus=1", "train.epochs=5", "train.checkpoint_every=2", "data.max_train_samples=32",
        "data.max_val_samples=16", "train.batch_per_gpu=16", "model.n_layer=1"])
    events = train(recipe, tmp_path / "run")
    assert [e["epoch"] for e in events if e["event"] == "checkpoint"] == [2, 4, 5]
    assert len([e for e in events if e["event"] == "epoch"]) == 5
