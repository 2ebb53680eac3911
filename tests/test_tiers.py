"""The tiers themselves: every test in exactly one, and a units test that starts a process group fails."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import tiers

pytestmark = pytest.mark.units


def item(nodeid: str, *marks: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: name if name in marks else None)


def test_a_test_in_no_tier_or_in_two_stops_the_suite_naming_it() -> None:
    tiers.check_every_test_has_one_tier([item("a", "units"), item("b", "ranks")])
    with pytest.raises(pytest.UsageError) as error:
        tiers.check_every_test_has_one_tier([item("a", "units"), item("b"), item("c", "units", "services")])
    assert str(error.value).splitlines()[1:] == ["  b: no tier", "  c: units, services"]


def refused_here() -> str:
    """What the guard refused during this test so far; cleared, so that the refusals below do not fail it."""
    marks = Path(os.environ[tiers.GUARD.VARIABLE])
    text = marks.read_text()
    marks.write_text("")
    return text


def test_the_units_guard_refuses_a_process_group_here_and_in_a_child() -> None:
    with pytest.raises(RuntimeError, match="units tier: this test must start no process group"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    assert refused_here().startswith("torch.distributed.init_process_group was called")
    child = ("import torch.distributed as dist\n"
             "try:\n    dist.init_process_group('gloo', init_method='tcp://127.0.0.1:1', rank=0, world_size=1)\n"
             "except RuntimeError:\n    pass  # swallowed: the file still tells\n")
    assert subprocess.run([sys.executable, "-c", child], timeout=120).returncode == 0
    with pytest.raises(RuntimeError, match="it launched ranks"):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "x.py"])
    refused = refused_here().splitlines()
    assert refused[0].startswith("torch.distributed.init_process_group was called (pid ")
    assert refused[1].startswith(f"it launched ranks: {sys.executable} -m torch.distributed.run")
    assert not dist.is_initialized()
