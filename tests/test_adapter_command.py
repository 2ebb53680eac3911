"""The runner asks the framework's adapter for the job's command line (default: torchrun + repro.loop)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from repro import launch, registry, runner
from repro.recipe import load_file, recipe_path

pytestmark = pytest.mark.units


def test_default_command_is_torchrun_of_the_loop() -> None:
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=3"])
    command = runner.command_for(recipe, runner.Launch(), Path("/runs/x"))
    assert command == launch.torchrun_local(3, Path("/runs/x"), sys.executable)
    assert command[-3:] == ["-m", "repro.loop", "/runs/x"]
    assert command[command.index("--nproc-per-node") + 1] == "3"


def test_several_nodes_need_a_rendezvous_then_join_it() -> None:
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=4", "run.nodes=2"])
    with pytest.raises(registry.Unavailable, match="--nodes 2 with the local launcher: start `repro run` on every node"):
        runner.check_launch(recipe, runner.Launch())
    command = runner.command_for(recipe, runner.Launch(rdzv_endpoint="node0:29400"), Path("/runs/x"))
    assert command == launch.torchrun_node(2, 2, "node0:29400", "x", Path("/runs/x"), sys.executable)
