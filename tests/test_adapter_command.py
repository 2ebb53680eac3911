"""The runner asks the framework's adapter for the job's command line (default: torchrun + repro.loop)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from repro import launch, registry
from repro.run.executors import for_launch
from repro.run.options import Launch
from repro.recipe import load_file, recipe_path

pytestmark = pytest.mark.units


def test_default_command_is_torchrun_of_the_loop() -> None:
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=3", "run.device=cuda"])  # GPUs keep torchrun
    command = for_launch(recipe, Launch()).command(Path("/runs/x"))
    assert command == launch.torchrun_local(3, Path("/runs/x"), sys.executable)
    assert command[-3:] == ["-m", "repro.loop", "/runs/x"]
    assert command[command.index("--nproc-per-node") + 1] == "3"


def test_cpu_stand_ins_of_one_node_start_warm_and_one_process_without_a_launcher() -> None:
    """docs/launch.md: torchrun's workers of the loop, on CPU, are forked from a warm launcher instead."""
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=3", "run.device=cpu"])
    command = for_launch(recipe, Launch()).command(Path("/runs/x"))
    assert command[:3] == [sys.executable, "-m", "repro.warm"] and command[-3:] == ["::", "3 x repro.warm.ranks:loop_rank", "/runs/x"]
    one = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=1", "run.device=cpu"])
    assert for_launch(one, Launch()).command(Path("/runs/x")) == launch.single_rank(Path("/runs/x"), sys.executable)
    assert launch.single_rank(Path("/runs/x"))[-3:] == ["-m", "repro.loop", "/runs/x"]


def test_several_nodes_need_a_rendezvous_then_join_it() -> None:
    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.gpus=4", "run.nodes=2"])
    with pytest.raises(registry.Unavailable, match="--nodes 2 with the local launcher: start `repro run` on every node"):
        for_launch(recipe, Launch()).check()
    command = for_launch(recipe, Launch(rdzv_endpoint="node0:29400")).command(Path("/runs/x"))
    assert command == launch.torchrun_node(2, 2, "node0:29400", "x", Path("/runs/x"), sys.executable)
