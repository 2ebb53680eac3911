"""Several nodes on one machine: one launcher per node, joined by the c10d rendezvous on 127.0.0.1.
Only the first node records the run, so the job lands once in MLflow."""
from __future__ import annotations


import pytest

from conftest import framework_params, mlflow_runs, read_events
from host import free_port

SETS = ("--max-steps", "6", "--set", "data.max_train_samples=256", "--set", "data.max_val_samples=32")


@pytest.mark.end_to_end
@pytest.mark.parametrize("framework", framework_params("ddp", "zero"))
def test_two_nodes_train_like_one_and_land_once_in_mlflow(repro, framework):
    shape = ("run", "gpt2", "--framework", framework, "--gpus", "2", *SETS)
    job = (*shape, "--nodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-dir", "runs/job")
    one_node = repro.start(*shape, "--run-dir", "runs/single", log="single.txt")
    second = repro.start(*job, "--node-rank", "1", log="node1.txt")
    first = repro(*job, "--node-rank", "0")
    assert first.returncode == 0, first.stderr
    assert second.wait(timeout=120) == 0, (repro.cwd / "node1.txt").read_text()
    assert one_node.wait(timeout=300) == 0, (repro.cwd / "single.txt").read_text()

    runs = [r for r in mlflow_runs(repro.tracking_uri) if r.data.tags["repro.nodes"] == "2"]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    events = read_events(repro.cwd / "runs" / "job")
    assert [e["world"] for e in events if e["event"] == "start"] == [2]
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 6
    assert losses == [e["loss"] for e in read_events(repro.cwd / "runs" / "single") if e["event"] == "step"]
    launchers = list((repro.cwd / "runs" / "job" / "ranks").glob("job_*"))  # torchrun's folder, one per node
    assert len(launchers) == 2


@pytest.mark.units
def test_several_nodes_without_slurm_need_an_endpoint_and_a_shared_folder(repro):
    out = repro.here("run", "gpt2", "--gpus", "2", "--nodes", "2", "--dry-run")
    assert out.returncode == 2
    assert "--rdzv-endpoint HOST:PORT" in out.stderr and "--launcher slurm" in out.stderr
