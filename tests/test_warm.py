"""Warm stand-in ranks (repro.warm): forked from a fork server that imported torch once, given what
torchrun gives its workers, ending as torchrun's workers end (the first failure stops the rest, a stop
signal reaches every rank, which saves before it exits), with torchrun's failure summary."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import rank_probe
from repro import launch
from repro.recipe import load_file, recipe_path
from repro.run.executors import for_launch
from repro.run.options import Launch
from repro.run.torchrun_failure import describe_failure
from repro.warm import plan, ranks
from repro.warm.client import Launcher

pytestmark = pytest.mark.ranks


def test_ranks_get_torchruns_environment_and_start_with_one_thread_and_no_cuda(tmp_path: Path):
    codes = ranks.run(rank_probe.report, 3, (str(tmp_path),))
    assert codes == {0: 0, 1: 0, 2: 0}
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert [f["env"]["RANK"] for f in found] == [f["env"]["LOCAL_RANK"] for f in found] == ["0", "1", "2"]
    assert {(f["env"]["WORLD_SIZE"], f["env"]["LOCAL_WORLD_SIZE"], f["env"]["MASTER_ADDR"], f["env"]["MASTER_PORT"],
             f["env"]["TORCHELASTIC_USE_AGENT_STORE"], f["env"]["OMP_NUM_THREADS"]) for f in found} == {
        ("3", "3", "127.0.0.1", found[0]["env"]["MASTER_PORT"], "True", "1")}
    assert [(f["threads"], f["cuda"], f["unsafe"]) for f in found] == [(1, False, [])] * 3
    assert [f["sum"] for f in found] == [0 + 1 + 2] * 3  # one process group of the three


def test_a_failed_rank_stops_the_others_and_is_named_as_torchrun_names_it():
    group = ranks.start(rank_probe.fail_on_rank_one, 3, ("7",))
    assert group.wait(timeout=120)
    assert group.exit_codes() == {0: -signal.SIGTERM, 1: 7, 2: -signal.SIGTERM} and group.returncode() == 1
    message, rank = describe_failure(group.failure_summary(), group.returncode(), 4800)  # as the follower reads it
    assert rank == "1" and message.startswith("rank 1 (local rank 1) failed with exit code 7\n")


@pytest.fixture
def probe_importable(monkeypatch) -> None:
    """A launcher is a process of its own: it finds rank_probe on PYTHONPATH, as pytest's does on sys.path."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(rank_probe.__file__).parent), *sys.path]))


def test_a_launcher_runs_jobs_one_after_another_and_a_stop_signal_lets_every_rank_save(tmp_path: Path, probe_importable):
    with Launcher() as launcher:
        job = launcher.start("rank_probe:report", 2, [str(tmp_path)], tmp_path / "logs")
        output = job.stdout.read()
        assert job.wait(60) == 0 and job.exit_codes == {"0": 0, "1": 0}, output
        assert "[default0]:rank 0 summed 1" in output and "[default1]:rank 1 summed 1" in output
        assert sorted(p.name for p in (tmp_path / "logs").rglob("stdout.log")) == ["stdout.log"] * 2

        job = launcher.start("rank_probe:save_on_stop", 2, [str(tmp_path)])
        lines = iter(job.stdout)
        assert {next(lines).split("]:")[1].strip() for _ in range(2)} == {"rank 0 ready", "rank 1 ready"}
        job.send_signal(signal.SIGUSR1)
        assert job.wait(60) == 1 and job.exit_codes == {"0": 128 + signal.SIGUSR1, "1": 128 + signal.SIGUSR1}
        assert [(tmp_path / f"rank{r}.saved").read_text() for r in range(2)] == ["SIGUSR1"] * 2
        assert not [p for p in job.ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert launcher.process.returncode == 0  # the closed channel ended it


def test_a_launcher_whose_parent_goes_stops_its_ranks_which_save(tmp_path: Path, probe_importable):
    launcher = Launcher()
    job = launcher.start("rank_probe:save_on_stop", 2, [str(tmp_path)])
    lines = iter(job.stdout)
    assert {next(lines).split("]:")[1].strip() for _ in range(2)} == {"rank 0 ready", "rank 1 ready"}
    launcher.channel.close()  # as when the parent dies
    assert launcher.process.wait(timeout=60) == 0
    assert [(tmp_path / f"rank{r}.saved").read_text() for r in range(2)] == ["SIGTERM"] * 2


def test_a_one_process_run_primes_its_rank_which_ends_when_no_run_folder_comes():
    """The rank of a one-process run starts importing before its folder and MLflow record exist; a run that
    stops before its job (refused, nothing to resume) ends it, and a rank told nothing ends by itself."""
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=1", "run.device=cpu"])
    executor = for_launch(recipe, Launch())
    with executor.running():
        assert executor.primed.args == launch.primed_single_rank(plan.preload([recipe]))
        primed = psutil.Process(executor.primed.pid)
        assert primed.is_running()
    assert executor.primed.returncode == -signal.SIGKILL and not primed.is_running()
    told_nothing = subprocess.run(launch.primed_single_rank([]), input="", capture_output=True, text=True, timeout=120)
    assert (told_nothing.returncode, told_nothing.stdout) == (0, "")
