"""The command line: fast help, listings, and refusals that say what to do."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.units


def test_help_imports_no_torch() -> None:
    code = "import sys; from repro.cli import main; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "ok", out.stderr


def test_list_shows_models_frameworks_and_recipes(repro) -> None:
    out = repro.here("list")
    assert out.returncode == 0
    assert "models:     vgg16, gpt2" in out.stdout
    assert "ddp" in out.stdout and "gpt2-smoke.yaml" in out.stdout
    assert "findings.yaml" not in out.stdout and "table2.yaml" not in out.stdout  # not recipes


def test_a_missing_name_is_said_once() -> None:
    from repro.doctor import availability
    from repro.registry import FrameworkEntry

    entry = FrameworkEntry("x", "x:XPlan", "x:XAdapter", "data", ("no_such_module_x",), ("no_such_module_x",))
    assert entry.missing() == ["no_such_module_x"]
    assert availability(entry) == "unavailable: missing no_such_module_x"


def test_unknown_framework_lists_valid_ones(repro) -> None:
    out = repro.here("run", "gpt2", "--framework", "horovod")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("repro: unknown framework 'horovod'; valid frameworks: ddp, zero")


def test_unknown_model_is_refused(repro) -> None:
    out = repro.here("run", "resnet50")
    assert out.returncode == 2
    assert "'resnet50' is not one of 'vgg16', 'gpt2'" in out.stderr


def test_dry_run_prints_the_launch_command(repro) -> None:
    out = repro.here("run", "gpt2", "--gpus", "2", "--dry-run")
    assert out.returncode == 0, out.stderr
    # CPU stand-ins on this machine: the warm launcher and the job it is sent (docs/launch.md); on GPUs it is
    # torchrun's line (tests/test_adapter_command.py)
    assert "-m repro.warm --channel 3 --preload repro.adapters.ddp,repro.workloads.gpt2" in out.stdout
    assert out.stdout.strip().endswith(":: 2 x repro.warm.ranks:loop_rank RUN_DIR")
    assert not (repro.cwd / "runs").exists()


def test_doctor_reports_versions_and_data(repro) -> None:
    out = repro.here("doctor", "--json")
    assert out.returncode == 0
    import json

    report = json.loads(out.stdout)
    assert report["versions"]["torch"] == "2.14.1"
    assert report["data"]["digits"].startswith("present")
