"""No torch in the parent: `repro run` (a dry run, and the parent of a real run), the matrix's planning
step, `repro sync` and `repro settle` import no training framework.

Each command runs under `python -X importtime`, which lists every module the process imported
(CPython's -X importtime, one "import time:" line per module on stderr); torch, deepspeed,
megatron and torchvision must not be among them. The ranks import them, each in its own process.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import read_events
from repro import events, tracking
from repro.runfiles import Outcome, RunFolder, Spec

FRAMEWORKS = ("torch", "deepspeed", "megatron", "torchvision")


def imported(repro, *args: str) -> set[str]:
    """The top-level packages `repro ARGS` imported; the command must succeed."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "repro.cli", *args], cwd=repro.cwd,
                         env=repro.env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split("|")[-1] for line in out.stderr.splitlines() if line.startswith("import time:")]
    return {line.strip().split(".")[0] for line in lines[1:]}  # the first line is the header


def ended_run_folder(repro) -> RunFolder:
    """A run folder as a job leaves it: its spec, two steps' events and how the job ended, not yet in MLflow."""
    folder = RunFolder(repro.cwd / "runs" / "done")
    folder.path.mkdir(parents=True)
    run = tracking.Run.create(repro.tracking_uri, "imports", "done", {}, {})
    folder.write_spec(Spec({"source": "test"}, str(repro.cwd), "0" * 64, repro.tracking_uri, run.run_id))
    writer = events.EventWriter(folder.events_file)
    for step in (1, 2):
        writer.emit(events.STEP, step=step, epoch=0, loss=1.0 / step)
    writer.emit(events.END, step=2, elapsed_s=0.1)
    writer.close()
    folder.write_outcome(Outcome("FINISHED"))
    return folder


@pytest.mark.units
def test_sync_and_settle_import_no_framework(repro) -> None:
    folder = ended_run_folder(repro)
    assert not imported(repro, "settle", str(folder.path)) & set(FRAMEWORKS)  # delivers the end it finds
    assert not imported(repro, "sync", str(folder.path)) & set(FRAMEWORKS)
    run = tracking.client(repro.tracking_uri).get_run(folder.read_spec().mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert [m.value for m in tracking.client(repro.tracking_uri).get_metric_history(run.info.run_id, "train/loss")] == [1.0, 0.5]


@pytest.mark.units
def test_run_dry_run_imports_no_framework(repro) -> None:
    """Resolving and checking a recipe reads the framework's and the workload's plans (repro.adapters.plan,
    repro.workloads.plan), never their adapter or workload modules."""
    assert not imported(repro, "run", "gpt2", "--framework", "ddp", "--gpus", "2", "--dry-run") & set(FRAMEWORKS)


@pytest.mark.units
def test_the_matrix_plan_imports_no_framework(repro) -> None:
    assert not imported(repro, "table2", "--dry-run", "--rows", "ddp,zero,megatron-intra") & set(FRAMEWORKS)
    # its reports and the parity section's (nothing run: --reports-only), which the matrix's parent writes too
    assert not imported(repro, "table2", "--reports-only", "--reports", "reports") & set(FRAMEWORKS)


@pytest.mark.end_to_end
def test_a_run_imports_no_framework_in_its_parent(repro) -> None:
    """A real run: its warm launcher's fork server and its ranks import the frameworks, each a process of
    its own; the parent checks, records the run in MLflow, supervises the job and delivers its events
    without them."""
    assert not imported(repro, "run", "gpt2", "--framework", "ddp", "--gpus", "2", "--max-steps", "2",
                        "--run-dir", "runs/real") & set(FRAMEWORKS)
    assert [e["step"] for e in read_events(repro.cwd / "runs" / "real") if e["event"] == events.STEP] == [1, 2]
